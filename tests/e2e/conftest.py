"""Helpers for the e2e tests: the real `burstrl run` as a child process on a reduced quickstart."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# Ray's memory monitor is off in the clusters these tests start (read by each raylet from its
# environment): it kills a node's actors when the *machine* nears 95% used, and here the rest of
# the suite holds that memory, so it failed a Ray test for others' (CI of 17de2e8). The kernel decides.
os.environ["RAY_memory_monitor_refresh_ms"] = "0"
# The quickstart at test size: small batches, few steps, tight timeouts; one torch thread per replica
# and for the trainer (examples/toy-swe.toml's choice): the default, one per core each, oversubscribes
# the 2 shared cores the suite runs on, where a waiting OpenMP thread spins on a core another needs.
SMALL = ["--trainer.batch_groups", "3", "--orchestrator.group_size", "6", "--fleet.start_timeout_s", "120",
         "--engine.num_threads", "1", "--trainer.num_threads", "1"]


def init_local_ray(attempts: int = 3, **kwargs):
    """`ray.init(address="local", ...)`, tried again when Ray's node start times out.

    Why: Ray waits a fixed 30 s for its raylet to register (ray/_private/node.py, not configurable),
    which a loaded 2-core machine running tests in parallel can miss ("The current node timed out
    during startup"). `address="local"`: a new instance, never another worker's (a bare
    `ray.init()` joins whatever cluster this machine started last).
    """
    import ray

    for attempt in range(1, attempts + 1):
        try:
            return ray.init(address="local", **kwargs)
        except Exception as e:  # Ray raises a bare Exception for this timeout
            if "timed out during startup" not in str(e) or attempt == attempts:
                raise
            print(f"Ray start {attempt} timed out ({e}); trying again")
            ray.shutdown()
    raise AssertionError("unreachable")


def burstrl_cmd(*args: str) -> list[str]:
    return [sys.executable, "-c", "from burstrl.cli import main; main()", *args]


def start_run(run_dir: Path, model: Path, *args: str) -> subprocess.Popen:
    """`burstrl run` with the quickstart plus overrides, output to run_dir.parent/NAME.out."""
    out = open(run_dir.parent / f"{run_dir.name}.out", "a")
    cmd = burstrl_cmd("run", "--run_dir", str(run_dir), "--model.path", str(model), *SMALL, *args)
    return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def start_fleet(fleet_dir: Path, model: Path, *args: str) -> subprocess.Popen:
    """`burstrl fleet up` in FLEET_DIR at test size (one engine thread, 120 s to start a replica) plus
    `args`, its output to FLEET_DIR/../fleet.out."""
    fleet_dir.mkdir(parents=True)
    out = open(fleet_dir.parent / "fleet.out", "w")  # noqa: SIM115 - the child holds it
    cmd = burstrl_cmd("fleet", "up", "--run_dir", str(fleet_dir), "--model.path", str(model),
                      "--engine.num_threads", "1", "--fleet.start_timeout_s", "120", *args)
    return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def start_ray_run(run_dir: Path, model: Path, address: str, *args: str) -> subprocess.Popen:
    """`start_run` with every role but the orchestrator in a Ray actor on the cluster at `address`."""
    return start_run(run_dir, model, "--provider", "ray", "--ray.address", address, *args)


def finish(proc: subprocess.Popen, run_dir: Path, timeout: float) -> None:
    """Wait for the run; on failure or timeout, stop it and show its output."""
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
        pytest.fail(f"run did not finish in {timeout:.0f} s:\n{output(run_dir)}")
    assert code == 0, f"run exited with {code}:\n{output(run_dir)}"


def interrupt(proc: subprocess.Popen, run_dir: Path) -> None:
    """Ctrl-C for a run the test stops itself: the launcher tears everything down and exits 130.
    A run that already ended is left alone, so the failure that ended it is the one reported."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=120)
    assert proc.returncode == 130, f"run exited with {proc.returncode}:\n{output(run_dir)}"


def output(run_dir: Path) -> str:
    path = run_dir.parent / f"{run_dir.name}.out"
    return path.read_text()[-4000:] if path.exists() else ""


def read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return rows


def events(run_dir: Path, name: str) -> list[dict]:
    return [e for e in read_jsonl(run_dir / "fleet.jsonl") if e.get("kind") == "event" and e["event"] == name]


def wait_until(predicate, timeout: float, what: str, proc: subprocess.Popen | None = None, run_dir: Path | None = None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            pytest.fail(f"run exited ({proc.returncode}) while waiting for {what}:\n{output(run_dir)}")
        time.sleep(0.2)
    pytest.fail(f"timed out waiting for {what}:\n{output(run_dir) if run_dir else ''}")


def last_step(run_dir: Path) -> int:
    """The run's last committed step (0 before the run made its store)."""
    from burstrl.store import RolloutStore

    path = run_dir / "store.sqlite"
    if not path.exists():
        return 0
    with RolloutStore(path) as store:
        return store.last_step()


def audit(run_dir: Path, steps: int, batch_groups: int = 3, group_size: int = 6) -> dict:
    """Nothing lost, nothing twice: every attempt id ended once; every stored rollout's attempt is
    `stored`; each step consumed whole groups, and no group was consumed by two steps."""
    from burstrl.store import RolloutStore

    with RolloutStore(run_dir / "store.sqlite") as store:
        figures = store.audit()
        committed = [s for s in range(1, store.last_step() + 1) if store.step_meta(s) is not None]
        consumed = store.consumed()
    assert figures["lost"] == 0 and figures["consumed_twice"] == 0, figures
    assert "running" not in figures["attempts"], figures
    assert committed == list(range(1, steps + 1))
    assert len(consumed) == steps * batch_groups * group_size
    return figures["attempts"]


def scale(run_dir: Path, replicas: int) -> str:
    """`burstrl scale RUN_DIR --replicas N` against the live run; its stdout."""
    r = subprocess.run(burstrl_cmd("scale", str(run_dir), "--replicas", str(replicas)), capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout


def alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False

