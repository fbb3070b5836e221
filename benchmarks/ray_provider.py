"""Ray provider benchmark: Ray's own costs, replica replacement time and run overhead vs local.

1. Ray: `ray.init()` of a local instance (wall time, and the resident memory of the processes it
   starts), and how long `ray.wait` takes to report an actor whose worker was SIGKILLed.
2. Replacement: `burstrl run` (the quickstart) with `--chaos.kill_fraction 0.34 --chaos.at_step 3`
   under each provider; from fleet.jsonl, the time from `replica_killed` to the replacement's
   `replica_started` (emitted once it is registered and has loaded the newest version: serving
   the current version).
3. Overhead: the quickstart without faults under each provider, alternating local / ray, `--rounds`
   times; the time per step after start-up (first to last step commit, from metrics.jsonl) and the
   ratio ray / local (goal: within 1.2x).

One Ray instance (started here, 16 logical CPUs) serves every Ray run, as a cluster would.

    .venv/bin/python benchmarks/ray_provider.py                 # --steps 20 --rounds 2 (~8 min)
    .venv/bin/python benchmarks/ray_provider.py --steps 6 --rounds 1   # smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def descendants_rss(pid: int) -> int:
    """Resident bytes of every process under `pid` (the Ray processes a driver started)."""
    children: dict[int, list[int]] = {}
    rss: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            status = (entry / "status").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
        for line in status.splitlines():
            if line.startswith("VmRSS:"):
                rss[int(entry.name)] = int(line.split()[1]) * 1024
    total, todo = 0, list(children.get(pid, []))
    while todo:
        p = todo.pop()
        total += rss.get(p, 0)
        todo += children.get(p, [])
    return total


def local_ray() -> str:
    """A new local Ray instance (16 logical CPUs) for every run, as a cluster would be; its GCS address.
    `address="local"`: a new one even if another Ray runs on this machine (ray.init would join it)."""
    import ray

    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    for attempt in range(3):  # Ray gives its raylet 30 s to register: a loaded machine can miss that
        try:
            ctx = ray.init(address="local", num_cpus=16, include_dashboard=False, object_store_memory=100 * 2**20,
                           log_to_driver=False)
            return ctx.address_info["gcs_address"]
        except Exception as exc:  # noqa: BLE001 - Ray raises a bare Exception for this timeout
            if "timed out during startup" not in str(exc) or attempt == 2:
                raise
            print(f"ray.init timed out (load {os.getloadavg()[0]:.0f}); retrying", flush=True)
            ray.shutdown()
    raise AssertionError("unreachable")


def ray_costs(kills: int) -> dict:
    import ray

    t0 = time.monotonic()
    address = local_ray()
    init_s = time.monotonic() - t0
    time.sleep(2)
    memory = descendants_rss(os.getpid())

    @ray.remote(num_cpus=0)
    class Sleeper:
        async def wait(self) -> None:
            import asyncio

            await asyncio.sleep(3600)

        def pid(self) -> int:
            return os.getpid()

    seen = []
    for _ in range(kills):
        actor = Sleeper.remote()
        pid = ray.get(actor.pid.remote())
        ref = actor.wait.remote()
        t = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        ray.wait([ref], timeout=60)
        seen.append(time.monotonic() - t)
    return {"address": address, "init_s": init_s, "ray_processes_rss_mib": memory / 2**20,
            "actor_death_seen_ms": 1000 * statistics.median(seen)}


def run(provider: str, address: str, out: Path, steps: int, model: str, *extra: str) -> Path:
    run_dir = out / f"{provider}-{len(list(out.iterdir()))}"
    cmd = [sys.executable, "-c", "from burstrl.cli import main; main()", "run", "--run_dir", str(run_dir),
           "--provider", provider, "--trainer.steps", str(steps), *extra]
    if model:
        cmd += ["--model.path", model]
    if provider == "ray":
        cmd += ["--ray.address", address]
    t0 = time.monotonic()
    r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "BURSTRL_CACHE": str(REPO / ".cache")})
    if r.returncode != 0:
        raise SystemExit(f"{provider} run failed:\n{r.stderr[-3000:]}")
    print(f"  {provider}: {steps} steps in {time.monotonic() - t0:.1f} s wall ({run_dir})", flush=True)
    return run_dir


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def step_seconds(run_dir: Path) -> float:
    m = rows(run_dir / "metrics.jsonl")
    return (m[-1]["time"] - m[0]["time"]) / (len(m) - 1)


def replacement_times(run_dir: Path) -> list[float]:
    events = [e for e in rows(run_dir / "fleet.jsonl") if e.get("kind") == "event"]
    killed = {e["replica"]: e["t"] for e in events if e["event"] == "replica_killed"}
    out = []
    for e in events:
        if e["event"] == "replica_started" and "(replaces " in e["detail"]:
            name = e["detail"].split("(replaces ")[1].rstrip(")")
            if name in killed:
                out.append(e["t"] - killed[name])
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--model", default="", help="Model dir; default: the quickstart's warm-started tiny model.")
    args = p.parse_args()
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    costs = ray_costs(kills=5)
    print(f"ray.init {costs['init_s']:.1f} s, Ray processes {costs['ray_processes_rss_mib']:.0f} MiB, "
          f"actor death seen by ray.wait in {costs['actor_death_seen_ms']:.0f} ms", flush=True)
    out = Path(tempfile.mkdtemp(prefix="burstrl-ray-bench-"))
    per_step: dict[str, list[float]] = {"local": [], "ray": []}
    for _ in range(args.rounds):
        for provider in ("local", "ray"):
            per_step[provider].append(step_seconds(run(provider, costs["address"], out, args.steps, args.model)))
    chaos = ("--chaos.kill_fraction", "0.34", "--chaos.at_step", "3")
    replace = {pv: replacement_times(run(pv, costs["address"], out, max(args.steps, 8), args.model, *chaos))
               for pv in ("local", "ray")}
    result = {
        "ray": costs,
        "step_s": {pv: statistics.median(v) for pv, v in per_step.items()}, "step_s_all": per_step,
        "overhead_ray_vs_local": statistics.median(per_step["ray"]) / statistics.median(per_step["local"]),
        "replacement_s": {pv: (statistics.median(v) if v else None) for pv, v in replace.items()},
        "replacement_s_all": replace, "steps": args.steps, "rounds": args.rounds,
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
