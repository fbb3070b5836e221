"""Time to a run's first stored rollout: `burstrl run --fleet.url` on a warm shared fleet vs a cold `burstrl run`.

Issue 51's figure "time from `burstrl run --fleet` to its first stored rollout on a warm fleet vs a
cold `burstrl run` (goal: <= 1/5)". Both sides run the same config (the tiny warm-started model, the
toy env, 1 reserved + 1 on-demand replica, one torch thread per role); the cold side starts its own
router and replicas (with the zygote, as `burstrl run` does by default), the warm side joins a fleet
started once before (`burstrl fleet up`) as a fresh tenant each time. Each run is timed from its
process start to the first row in its store's `rollouts` table, then stopped with SIGTERM. The runs
go one after the other (cold, warm, cold, warm, ...), so load drift hits both sides alike.

    .venv/bin/python benchmarks/shared_fleet.py            # 3 of each; ~3 min on 2 busy cores
    .venv/bin/python benchmarks/shared_fleet.py --repeats 2
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

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from burstrl.launcher.preflight import quickstart_model  # noqa: E402

CLI = [sys.executable, "-c", "from burstrl.cli import main; main()"]
SAME = ["--fleet.reserved", "1", "--fleet.on_demand", "1", "--engine.num_threads", "1"]
RUN = ["--trainer.steps", "1000", "--trainer.num_threads", "1", "--trainer.batch_groups", "2",
       "--orchestrator.group_size", "4"]


def first_rollout(store: Path) -> bool:
    if not store.exists():
        return False
    try:
        with sqlite3.connect(f"file:{store}?mode=ro", uri=True, timeout=1) as db:
            return db.execute("SELECT 1 FROM rollouts LIMIT 1").fetchone() is not None
    except sqlite3.Error:  # the schema not made yet
        return False


def timed_run(run_dir: Path, model: Path, *extra: str, timeout: float = 300) -> float:
    """Seconds from `burstrl run`'s start to its first stored rollout; the run is then stopped."""
    out = open(run_dir.parent / f"{run_dir.name}.out", "w")
    t0 = time.monotonic()
    proc = subprocess.Popen([*CLI, "run", "--run_dir", str(run_dir), "--model.path", str(model), *SAME, *RUN,
                             *extra], stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        while not first_rollout(run_dir / "store.sqlite"):
            if proc.poll() is not None or time.monotonic() - t0 > timeout:
                raise RuntimeError(f"{run_dir.name} ended or hung before a rollout:\n"
                                   f"{(run_dir.parent / f'{run_dir.name}.out').read_text()[-2000:]}")
            time.sleep(0.05)
        return time.monotonic() - t0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=120)


def start_fleet(fleet_dir: Path, model: Path) -> tuple[subprocess.Popen, dict, float]:
    out = open(fleet_dir.parent / "fleet.out", "w")
    t0 = time.monotonic()
    proc = subprocess.Popen([*CLI, "fleet", "up", "--run_dir", str(fleet_dir), "--model.path", str(model), *SAME],
                            stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    info_path = fleet_dir / "fleet.json"
    while not info_path.exists():
        if proc.poll() is not None or time.monotonic() - t0 > 300:
            raise RuntimeError((fleet_dir.parent / "fleet.out").read_text()[-2000:])
        time.sleep(0.1)
    return proc, json.loads(info_path.read_text()), time.monotonic() - t0


def token(fleet_dir: Path, tenant: str) -> str:
    return subprocess.run([*CLI, "fleet", "token", tenant, "--key-file", str(fleet_dir / "tenant.key")],
                          capture_output=True, text=True, check=True).stdout.strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    model = quickstart_model()  # the warm-started tiny model `burstrl run` uses by default
    with tempfile.TemporaryDirectory(prefix="burstrl-shared-fleet-") as tmp:
        root = Path(tmp)
        fleet_dir = root / "fleet"
        fleet, info, fleet_up_s = start_fleet(fleet_dir, model)
        cold, warm = [], []
        try:
            time.sleep(5)  # the second replica joins (the ready line comes with the first)
            for i in range(args.repeats):
                cold.append(timed_run(root / f"cold-{i}", model))
                warm.append(timed_run(root / f"warm-{i}", model, "--fleet.url", info["router"], "--fleet.token",
                                      token(fleet_dir, f"bench-{i}")))
        finally:
            os.killpg(fleet.pid, signal.SIGTERM)
            fleet.wait(timeout=120)
    cold_m, warm_m = statistics.median(cold), statistics.median(warm)
    print(json.dumps({"cold_s": [round(x, 2) for x in cold], "warm_s": [round(x, 2) for x in warm],
                      "cold_median_s": round(cold_m, 2), "warm_median_s": round(warm_m, 2),
                      "warm_over_cold": round(warm_m / cold_m, 3), "goal": "<= 0.2",
                      "fleet_up_s": round(fleet_up_s, 1), "cpu_count": os.cpu_count()}, indent=1))


if __name__ == "__main__":
    main()
