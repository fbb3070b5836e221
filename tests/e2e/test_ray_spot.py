"""`burstrl run --provider ray` losing a spot node mid-run: its own two-node `ray.cluster_utils.Cluster`."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .conftest import audit, events, interrupt, last_step, read_jsonl, start_ray_run, wait_until

pytestmark = pytest.mark.slow
os.environ["RAY_USAGE_STATS_ENABLED"] = "0"


def test_losing_a_spot_node_mid_run_loses_no_rollout(tmp_path: Path, warm_model: Path) -> None:
    """Two nodes: the head (reserved replica, trainer, router) and a spot node with the on-demand
    replicas. The spot node is removed mid-run and a new one joins; the run goes on (the test stops
    it two steps after the replacements), nothing lost."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, connect=False,
                      head_node_args={"num_cpus": 8, "num_gpus": 0, "resources": {"reserved": 2},
                                      "include_dashboard": False, "object_store_memory": 100 * 2**20})
    try:
        spot = cluster.add_node(num_cpus=4, resources={"spot": 4}, object_store_memory=100 * 2**20)
        run_dir = tmp_path / "spot"
        # more steps than the test takes: it stops the run once the replacements served two steps
        proc = start_ray_run(run_dir, warm_model, cluster.address, "--trainer.steps", "100000",
                             "--fleet.on_demand", "2", "--ray.on_demand_resources", '{"spot": 1}',
                             "--ray.reserved_resources", '{"reserved": 1}', "--ray.placement_timeout_s", "90")
        wait_until(lambda: last_step(run_dir) >= 3, 300, "step 3", proc, run_dir)
        # the cloud's notice (what Ray's autoscaler sends on a spot preemption), then the node is gone
        ray_cli = Path(sys.executable).parent / "ray"
        subprocess.run([str(ray_cli), "drain-node", "--address", cluster.address, "--node-id", spot.node_id,
                        "--reason", "DRAIN_NODE_REASON_PREEMPTION", "--reason-message", "spot preemption (test)",
                        "--deadline-remaining-seconds", "1"], check=True, capture_output=True, timeout=60)
        time.sleep(3)  # the node's raylet learns of the drain; its death is then a preemption
        cluster.remove_node(spot)
        wait_until(lambda: len(events(run_dir, "replica_died")) >= 2, 120, "both spot replicas lost", proc, run_dir)
        cluster.add_node(num_cpus=4, resources={"spot": 4}, object_store_memory=100 * 2**20)
        wait_until(lambda: len([e for e in events(run_dir, "replica_started") if "(replaces" in e["detail"]]) >= 2,
                   200, "replacements on the new spot node", proc, run_dir)
        step_then = last_step(run_dir)
        wait_until(lambda: last_step(run_dir) >= step_then + 2, 300, "two steps after the replacements", proc,
                   run_dir)
        interrupt(proc, run_dir)
    finally:
        cluster.shutdown()
    died = events(run_dir, "replica_died")
    assert {e["pool"] for e in died} == {"on_demand"}
    assert all("(preempted)" in e["detail"] for e in died), died
    samples = [e for e in read_jsonl(run_dir / "fleet.jsonl") if e.get("kind") == "sample"]
    assert samples[-1]["spot_losses"] == 2
    counts = audit(run_dir, last_step(run_dir))
    print("attempts by status:", counts, "deaths:", [e["detail"] for e in died])
