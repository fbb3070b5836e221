"""Three runs on one shared fleet vs the same three runs each on a fleet of its own, and a 40% loss.

Issue 51's measured figures, side by side in one invocation:

1. **Shared vs dedicated, equal replicas.** Three runs of the quickstart (the tiny warm-started
   model, the toy env, one torch thread per role), equal weights. *Shared*: one `burstrl fleet up`
   of N replicas (reserved), the three runs `burstrl run --fleet.url` on it as tenants. *Dedicated*:
   the same three runs as plain `burstrl run`s, each with N/3 reserved replicas of its own (and its
   own router). Each side's three runs start at once; the figures come from the runs' own stores
   afterwards, over the window in which all three were producing (from the latest first rollout to
   the earliest last rollout): aggregate rollouts/s, aggregate steps/h (steps committed in the
   window), each run's share of the window's rollouts and Jain's fairness index of those shares.
   Sides alternate (dedicated, shared, ...) so load drift hits both alike. On this machine every
   replica shares the same 2 cores, so the goal here is no loss (shared >= 0.95x dedicated); the
   gain of sharing needs separate devices (benchmarks/shared_fleet_sim.py).
2. **A 40% replica loss mid-step with three tenants.** A fleet of 5 replicas, three tenant runs;
   once every run has committed a step and has attempts running, 2 of the 5 replicas (40%) are
   SIGKILLed from outside. The fleet replaces them; every run must finish its steps with nothing
   lost and nothing consumed twice (each store's attempt ledger), the cut attempts re-run.

    .venv/bin/python benchmarks/shared_fleet_runs.py                 # ~25 min on 2 busy cores
    .venv/bin/python benchmarks/shared_fleet_runs.py --rounds 1 --steps 4 --skip-loss
    .venv/bin/python benchmarks/shared_fleet_runs.py --gemma --rounds 1 --steps 3 --skip-loss   # Gemma 3 270M
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from burstrl.launcher.preflight import quickstart_model  # noqa: E402
from burstrl.store import RolloutStore  # noqa: E402

CLI = [sys.executable, "-c", "from burstrl.cli import main; main()"]
ROLE = ["--engine.num_threads", "1", "--fleet.start_timeout_s", "300"]
RUN = ["--trainer.num_threads", "1", "--trainer.batch_groups", "2", "--orchestrator.group_size", "4"]
TENANTS = ("run-a", "run-b", "run-c")
CONFIG: list[str] = []  # `--functions`: examples/functions-gemma.toml (on the tiny model) for the fleet and every run
FUNCTIONS = ["--orchestrator.env.functions.max_sandboxes", "2"]


STARTED: list[subprocess.Popen] = []  # every fleet and run, killed (their groups) when the benchmark ends


def launch(cmd: list[str], out: Path) -> subprocess.Popen:
    proc = subprocess.Popen([*CLI, *cmd], stdout=open(out, "w"), stderr=subprocess.STDOUT,  # noqa: SIM115
                            start_new_session=True)
    STARTED.append(proc)
    return proc


def kill_started() -> None:
    for proc in STARTED:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
    proc.wait(timeout=180)


def wait_for(predicate, timeout: float, what: str, procs: list[subprocess.Popen] = ()):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if any(p.poll() not in (None, 0) for p in procs):
            raise RuntimeError(f"a process ended ({[p.poll() for p in procs]}) while waiting for {what}")
        time.sleep(0.5)
    raise RuntimeError(f"timed out after {timeout:.0f} s waiting for {what}")


def start_fleet(fleet_dir: Path, model: Path, replicas: int) -> tuple[subprocess.Popen, dict]:
    proc = launch(["fleet", "up", *CONFIG, "--run_dir", str(fleet_dir), "--model.path", str(model), "--fleet.reserved",
                   str(replicas), "--fleet.on_demand", "0", *ROLE], fleet_dir.parent / f"{fleet_dir.name}.out")
    info_path = fleet_dir / "fleet.json"
    info = wait_for(lambda: info_path.exists() and json.loads(info_path.read_text()), 600, "the fleet", [proc])
    wait_for(lambda: len(replica_urls(info["router"], admin(fleet_dir))) >= replicas, 600, "every fleet replica",
             [proc])
    return proc, info


def admin(fleet_dir: Path) -> str:
    return (fleet_dir / "admin.token").read_text().strip()


def replica_urls(router: str, token: str) -> list[str]:
    try:
        answer = httpx.get(f"{router}/v1/replicas", headers={"Authorization": f"Bearer {token}"}, timeout=10)
        return [r["url"] for r in answer.json()["replicas"] if r["healthy"]]
    except (httpx.HTTPError, ValueError, KeyError):
        return []


def token(fleet_dir: Path, tenant: str) -> str:
    return subprocess.run([*CLI, "fleet", "token", tenant, "--key-file", str(fleet_dir / "tenant.key")],
                          capture_output=True, text=True, check=True).stdout.strip()


def run_cmd(run_dir: Path, model: Path, steps: int, *extra: str) -> list[str]:
    return ["run", *CONFIG, "--run_dir", str(run_dir), "--model.path", str(model), "--trainer.steps", str(steps),
            *ROLE, *RUN, *(FUNCTIONS if CONFIG else []), *extra]


def finish_all(procs: dict[str, subprocess.Popen], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for name, proc in procs.items():
        try:
            code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for p in procs.values():
                stop(p)
            raise RuntimeError(f"{name} did not finish in {timeout:.0f} s") from None
        if code != 0:
            raise RuntimeError(f"{name} exited with {code}")


def times(run_dir: Path) -> tuple[list[float], list[float]]:
    """(each stored rollout's time, each committed step's time), from the run's store."""
    with sqlite3.connect(f"file:{run_dir / 'store.sqlite'}?mode=ro", uri=True) as db:
        rollouts = sorted(t for (t,) in db.execute("SELECT created FROM rollouts"))
        steps = sorted(t for (t,) in db.execute("SELECT committed_at FROM steps"))
    return rollouts, steps


def jain(xs: list[float]) -> float:
    return sum(xs) ** 2 / (len(xs) * sum(x * x for x in xs)) if any(xs) else 0.0


def window_figures(run_dirs: dict[str, Path]) -> dict:
    """Aggregate rates and shares over the window in which every run was producing rollouts."""
    recorded = {name: times(d) for name, d in run_dirs.items()}
    start = max(r[0] for r, _ in recorded.values())
    end = min(r[-1] for r, _ in recorded.values())
    if end <= start:
        raise RuntimeError("the runs never produced at the same time: give them more steps")
    counts = {name: sum(start <= t <= end for t in r) for name, (r, _) in recorded.items()}
    steps = {name: sum(start <= t <= end for t in s) for name, (_, s) in recorded.items()}
    total = sum(counts.values())
    return {"window_s": round(end - start, 1), "rollouts_per_s": round(total / (end - start), 3),
            "steps_per_h": round(sum(steps.values()) * 3600 / (end - start), 1),
            "shares": {n: round(c / total, 3) for n, c in counts.items()}, "jain": round(jain(list(counts.values())), 4)}


def dedicated_side(root: Path, model: Path, replicas: int, steps: int) -> dict:
    each = max(1, replicas // len(TENANTS))
    dirs = {name: root / name for name in TENANTS}
    procs = {name: launch(run_cmd(d, model, steps, "--fleet.reserved", str(each), "--fleet.on_demand", "0"),
                          root / f"{name}.out") for name, d in dirs.items()}
    finish_all(procs, timeout=3600)
    return window_figures(dirs)


def tenant_runs(root: Path, fleet_dir: Path, router: str, model: Path,
                steps: int) -> tuple[dict[str, Path], dict[str, subprocess.Popen]]:
    """The three runs started at once on the fleet, each as its own tenant: (run dirs, processes)."""
    dirs = {name: root / name for name in TENANTS}
    procs = {name: launch(run_cmd(d, model, steps, "--fleet.url", router, "--fleet.token", token(fleet_dir, name)),
                          root / f"{name}.out") for name, d in dirs.items()}
    return dirs, procs


def shared_side(root: Path, model: Path, replicas: int, steps: int) -> dict:
    fleet_dir = root / "fleet"
    fleet, info = start_fleet(fleet_dir, model, replicas)
    try:
        dirs, procs = tenant_runs(root, fleet_dir, info["router"], model, steps)
        finish_all(procs, timeout=3600)
    finally:
        stop(fleet)
    return window_figures(dirs)


def listening_pid(port: int) -> int:
    """The process listening on a loopback TCP port (the replica behind a URL), from /proc."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                inodes.add(f"socket:[{fields[9]}]")
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if any(os.readlink(f"/proc/{pid}/fd/{fd}") in inodes for fd in os.listdir(f"/proc/{pid}/fd")):
                return int(pid)
        except OSError:
            continue
    raise RuntimeError(f"no process listens on port {port}")


def running_attempts(run_dir: Path) -> int:
    try:
        with sqlite3.connect(f"file:{run_dir / 'store.sqlite'}?mode=ro", uri=True, timeout=1) as db:
            steps = db.execute("SELECT COUNT(*) FROM steps").fetchone()[0]
            running = db.execute("SELECT COUNT(*) FROM attempts WHERE status = 'running'").fetchone()[0]
    except sqlite3.Error:
        return 0
    return running if steps >= 1 else 0


def loss_side(root: Path, model: Path, steps: int, replicas: int = 5, kill: int = 2) -> dict:
    """Three tenants on `replicas`; `kill` of them SIGKILLed mid-step; each run's ledger audited."""
    fleet_dir = root / "fleet"
    fleet, info = start_fleet(fleet_dir, model, replicas)
    try:
        dirs, procs = tenant_runs(root, fleet_dir, info["router"], model, steps)
        wait_for(lambda: all(running_attempts(d) for d in dirs.values()), 1800, "every run mid-step",
                 list(procs.values()))
        urls = replica_urls(info["router"], admin(fleet_dir))[:kill]
        killed_at = time.time()
        steps_at_kill = {name: committed_steps(d) for name, d in dirs.items()}
        for url in urls:
            os.kill(listening_pid(int(url.rsplit(":", 1)[1])), signal.SIGKILL)

        def replaced() -> float | None:  # the killed gone from the router, as many healthy as before
            now = replica_urls(info["router"], admin(fleet_dir))
            return time.time() if len(now) >= replicas and not set(urls) & set(now) else None

        replaced_at = wait_for(replaced, 900, "the fleet to replace the killed replicas", [fleet])
        finish_all(procs, timeout=3600)
    finally:
        stop(fleet)
    ledgers = {}
    for name, d in dirs.items():
        with RolloutStore(d / "store.sqlite") as store:
            ledgers[name] = {**store.audit(), "steps": store.last_step(), "step_at_kill": steps_at_kill[name]}
    fleet_events = [json.loads(line) for line in (fleet_dir / "fleet.jsonl").read_text().splitlines()]
    died = [e["replica"] for e in fleet_events if e.get("event") == "replica_died"]
    return {"replicas": replicas, "killed": len(urls), "died": died,
            "replacements": sum(e.get("event") == "replica_started" and "replaces" in e["detail"]
                                for e in fleet_events),
            "replaced_after_s": round(replaced_at - killed_at, 1), "ledgers": ledgers,
            "nothing_lost": all(v["lost"] == 0 and v["consumed_twice"] == 0 and v["steps"] == steps
                                for v in ledgers.values())}


def committed_steps(run_dir: Path) -> int:
    with sqlite3.connect(f"file:{run_dir / 'store.sqlite'}?mode=ro", uri=True, timeout=5) as db:
        return db.execute("SELECT COUNT(*) FROM steps").fetchone()[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=3, help="N: the shared fleet's replicas (N/3 per run apart)")
    parser.add_argument("--steps", type=int, default=6, help="trainer steps of each run")
    parser.add_argument("--rounds", type=int, default=1, help="dedicated/shared pairs, alternated")
    parser.add_argument("--skip-loss", action="store_true")
    parser.add_argument("--functions", action="store_true", help="functions tasks graded in sandboxes (steps of "
                        "seconds) instead of the quickstart's toy tasks (steps of ~0.5 s)")
    parser.add_argument("--gemma", action="store_true", help="Gemma 3 270M (fp32, `make gemma`) instead of the tiny "
                        "model; implies --functions (its example's config)")
    args = parser.parse_args()
    if args.functions or args.gemma:
        CONFIG.append(str(REPO / "examples" / "functions-gemma.toml"))
    if args.gemma:  # three Gemma trainers at once: logits of 262k-token vocabulary in 512-token micro-batches
        RUN.extend(["--trainer.micro_batch_tokens", "512"])
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so `finally` runs and stops what was started
    model = gemma_dir() if args.gemma else quickstart_model()
    result: dict = {"replicas": args.replicas, "steps": args.steps, "env": "functions" if CONFIG else "toy",
                    "model": "gemma-3-270m" if args.gemma else "tiny",
                    "cpu_count": os.cpu_count(), "rounds": []}
    with tempfile.TemporaryDirectory(prefix="burstrl-shared-runs-") as tmp:
        try:
            measure(Path(tmp), model, args, result)
        finally:
            kill_started()
    print(json.dumps(result, indent=1))


def gemma_dir() -> Path:
    from burstrl.model.gguf import default_gemma_dir

    path = Path(default_gemma_dir())
    if not (path / "config.json").exists():
        raise SystemExit(f"no Gemma 3 270M at {path}: run `make gemma` first")
    return path


def measure(tmp: Path, model: Path, args: argparse.Namespace, result: dict) -> None:
    """The rounds of both sides (alternated), then the loss, into `result`."""
    for i in range(args.rounds):
        pair = {}
        for side, fn in (("dedicated", dedicated_side), ("shared", shared_side)):
            where = tmp / f"{side}-{i}"
            where.mkdir()
            t0 = time.monotonic()
            pair[side] = {**fn(where, model, args.replicas, args.steps), "wall_s": round(time.monotonic() - t0)}
            print(side, json.dumps(pair[side]), flush=True)
        result["rounds"].append(pair)
    rounds = result["rounds"]
    for figure in ("rollouts_per_s", "steps_per_h"):
        result[f"shared_over_dedicated_{figure}"] = round(statistics.median(
            r["shared"][figure] / r["dedicated"][figure] for r in rounds), 3)
    result["goal"] = "shared >= 0.95x dedicated here; Jain >= 0.9"
    if not args.skip_loss:
        where = tmp / "loss"
        where.mkdir()
        result["loss"] = loss_side(where, model, args.steps)
        print("loss", json.dumps(result["loss"]), flush=True)


if __name__ == "__main__":
    main()
