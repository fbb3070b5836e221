"""Sandbox nodes on a multi-node `ray.cluster_utils.Cluster` on this one machine: a head without
sandboxes and three nodes carrying `sandbox_node`. One node-agent actor per sandbox node; a
`ClusterPool` over them holds many sandboxes at once; one node is removed mid-run, its sandboxes are
confirmed lost (the SWE env's infra error) while the others keep working, and new sandboxes go to
the two nodes left. A node added after that gets an agent (`SandboxAgents.poll`, as the launcher's
supervision loop calls it), the nodes file follows, and the pool, watching the file, places there.
A cluster without `sandbox_node` gets no agents. An agent that dies alone is started again.

`BURSTRL_RAY_SANDBOXES` sets how many sandboxes are held at once (default 24: what a busy 2-core
machine starts in a few minutes; benchmarks/sandbox_cluster.py measures 64).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tests.waiting import wait_for

from .conftest import init_local_ray

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap (bwrap) is not installed")]
os.environ["RAY_USAGE_STATS_ENABLED"] = "0"


def _answers(url: str) -> bool:
    """Does anything accept a TCP connection at the agent's address?"""
    import socket
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    try:
        with socket.create_connection((parts.hostname, parts.port), timeout=5):
            return True
    except OSError:
        return False


def test_sandboxes_across_ray_sandbox_nodes_survive_a_node_loss(tmp_path: Path) -> None:
    import ray
    from ray.cluster_utils import Cluster

    from burstrl.providers.ray_sandbox import SandboxAgents
    from burstrl.sandbox.backends import SandboxSpec
    from burstrl.sandbox.client import SandboxError
    from burstrl.sandbox.cluster import ClusterPool, load_nodes

    n = int(os.environ.get("BURSTRL_RAY_SANDBOXES", "24"))
    cluster = Cluster(initialize_head=True, connect=False,
                      head_node_args={"num_cpus": 2, "include_dashboard": False, "object_store_memory": 80 * 2**20})
    agents = pool = None
    try:
        ray.init(address=cluster.address, namespace="sandbox-test", log_to_driver=False)
        none = SandboxAgents(tmp_path, tmp_path / "logs", {}, backend="namespace")
        assert none.start() is None and not (tmp_path / "sandbox-nodes.json").exists()  # no such node: local
        nodes = [cluster.add_node(num_cpus=8, memory=8 * 2**30, resources={"sandbox_node": 1},
                                  object_store_memory=80 * 2**20) for _ in range(3)]
        cluster.wait_for_nodes()
        agents = SandboxAgents(tmp_path, tmp_path / "logs", {}, backend="namespace", timeout_s=300)
        path = agents.start()
        assert path is not None and oct(path.stat().st_mode & 0o777) == "0o600"
        refs = load_nodes(path)
        assert len(refs) == 3 and len({r.url for r in refs}) == 3
        by_node = {r.name: node for r in refs for node in nodes if r.name.endswith(node.node_id[:6])}
        assert len(by_node) == 3

        pool = ClusterPool(refs, "ours", max_concurrent=n + 8, refresh_s=0.5, dead_after_s=5, nodes_file=path)
        spec = SandboxSpec(cpu_limit=1, memory_limit_mb=1024, start_timeout_s=300)
        t0 = time.monotonic()
        with ThreadPoolExecutor(8) as ex:
            boxes = list(ex.map(lambda _: pool.create(spec, timeout=900), range(n)))
        started_s = time.monotonic() - t0
        spread = Counter(sb.node for sb in boxes)
        print(f"{n} sandboxes started in {started_s:.1f} s; by node {dict(spread)}; "
              f"decision p50 {sorted(pool.decision_s)[len(pool.decision_s) // 2] * 1e6:.0f} us")
        assert len(spread) == 3  # the predictor's risk term spreads what packing alone would pile up
        with ThreadPoolExecutor(8) as ex:
            outs = list(ex.map(lambda sb: sb.exec(f"echo {sb.id}", timeout=120).stdout, boxes))
        assert outs == [f"{sb.id}\n" for sb in boxes]

        victim_name = spread.most_common(1)[0][0]
        cluster.remove_node(by_node[victim_name])  # the raylet and its workers die: the agent and its sandboxes too
        # remove_node returns once the raylet is gone; its workers (the agent's actor) notice and exit
        # a moment later (under load, after the next exec had already been answered): wait for that
        victim_url = next(r.url for r in refs if r.name == victim_name)
        wait_for(lambda: not _answers(victim_url), 120, "the removed node's agent to stop answering", interval=0.2)
        lost = [sb for sb in boxes if sb.node == victim_name]
        kept = [sb for sb in boxes if sb.node != victim_name]
        for sb in lost:
            with pytest.raises(SandboxError):
                sb.exec("true", timeout=60)
        assert all(pool.confirm_lost(sb) for sb in lost)
        with ThreadPoolExecutor(8) as ex:
            assert all(ex.map(lambda sb: sb.exec("echo ok", timeout=120).stdout == "ok\n", kept))
        assert not any(pool.confirm_lost(sb) for sb in kept)
        for sb in lost:
            sb.close()  # the slot comes back without asking the dead agent
        more = [pool.create(spec, timeout=900) for _ in range(len(lost))]
        assert victim_name not in {sb.node for sb in more}
        stats = pool.stats()
        assert stats["nodes_lost"] == 1 and stats["sandboxes_lost"] == len(lost) and stats["close_errors"] == 0

        def names() -> set[str]:
            agents.poll()
            return {r.name for r in load_nodes(path, allow_empty=True)}

        wait_for(lambda: victim_name not in names(), 120, "the removed node's agent leaves the nodes file", interval=0.5)
        joined = cluster.add_node(num_cpus=8, memory=8 * 2**30, resources={"sandbox_node": 1},
                                  object_store_memory=80 * 2**20)
        cluster.wait_for_nodes()
        new_name = wait_for(lambda: next((x for x in names() if x.endswith(joined.node_id[:6])), None), 300,
                        "an agent on the node that joined", interval=0.5)
        assert oct(path.stat().st_mode & 0o777) == "0o600" and len(names()) == 3
        wait_for(lambda: any(x.name == new_name and x.state is not None for x in pool.nodes), 60,
             "the pool reads the new node from the file and its first report", interval=0.5)
        pool.policy = _emptiest()  # which node wins is not the point here (packing may prefer the old ones)
        late = [pool.create(spec, timeout=900) for _ in range(3)]
        assert new_name in {sb.node for sb in late}
        assert all(sb.exec("echo late", timeout=120).stdout == "late\n" for sb in late)
        stats = pool.stats()
        assert stats["nodes_joined"] == 1 and not stats["nodes"][new_name]["dead"]
        print(json.dumps(stats))
    finally:
        if pool is not None:
            pool.close()
        if agents is not None:
            agents.stop()
        ray.shutdown()
        cluster.shutdown()


def test_an_agent_that_dies_on_a_live_node_is_started_again_then_given_up_on(tmp_path: Path, monkeypatch) -> None:
    """One Ray node carrying `sandbox_node` (no multi-node cluster: the agent dies, not its node).
    SIGKILL to the agent's group: the next polls start it again under a new name and port, the pool
    counts its sandbox lost and places on the restarted agent; past `MAX_RESTARTS` it is given up on
    and the nodes file empties (a pool reading it waits for a node instead of failing)."""
    import signal
    import subprocess

    import ray

    from burstrl.providers import ray_sandbox
    from burstrl.providers.ray_sandbox import SandboxAgents
    from burstrl.sandbox.backends import SandboxSpec
    from burstrl.sandbox.cluster import ClusterPool, load_nodes

    monkeypatch.setattr(ray_sandbox, "MAX_RESTARTS", 1)
    init_local_ray(num_cpus=2, resources={"sandbox_node": 1}, include_dashboard=False, object_store_memory=80 * 2**20,
             namespace="sandbox-restart-test", log_to_driver=False)
    agents = pool = None
    try:
        agents = SandboxAgents(tmp_path, tmp_path / "logs", {}, backend="namespace", timeout_s=300)
        path = agents.start()
        assert path is not None
        [first] = load_nodes(path)
        pool = ClusterPool([first], "ours", max_concurrent=4, refresh_s=0.5, dead_after_s=5, nodes_file=path)
        spec = SandboxSpec(cpu_limit=1, memory_limit_mb=1024, start_timeout_s=300)
        sb = pool.create(spec, timeout=600)

        def kill_agent(name: str) -> None:
            pid = subprocess.run(["pgrep", "-f", "--", f"--name {name} "], capture_output=True, text=True,
                                 check=True).stdout.split()[0]
            os.killpg(int(pid), signal.SIGKILL)

        def rows() -> list[str]:
            agents.poll()
            return [r.name for r in load_nodes(path, allow_empty=True)]

        kill_agent(first.name)
        restarted = f"{first.name}-r1"
        wait_for(lambda: rows() == [restarted], 300, "the agent started again under a new name", interval=0.5)
        assert agents.restarts == {next(iter(agents.agents)): 1}
        assert pool.confirm_lost(sb)  # it died with its agent: the attempt is infrastructure's loss
        sb.close()
        wait_for(lambda: any(n.name == restarted and n.state is not None for n in pool.nodes), 60,
                 "the pool adopts the restarted agent", interval=0.5)
        again = pool.create(spec, timeout=600)
        assert again.node == restarted and again.exec("echo again", timeout=120).stdout == "again\n"
        assert pool.stats()["nodes"][first.name]["dead"]

        kill_agent(restarted)  # past MAX_RESTARTS: given up on, the file empties
        wait_for(lambda: rows() == [] and agents.failed, 120, "the agent given up on", interval=0.5)
        with pytest.raises(TimeoutError):  # no node left: a create waits for one, it does not fail the run
            pool.create(spec, timeout=3)
    finally:
        if pool is not None:
            pool.close()
        if agents is not None:
            agents.stop()
        ray.shutdown()


def _emptiest() -> Any:
    from burstrl.sandbox.placement import NodeState, OursPolicy, SandboxRequest

    class Emptiest(OursPolicy):
        """`ours` admission, but the node with the fewest sandboxes wins."""

        def evaluate(self, node: NodeState, request: SandboxRequest) -> float | None:
            return None if super().evaluate(node, request) is None else -float(len(node.sandboxes))

    return Emptiest()


def test_toy_swe_run_on_ray_sandbox_nodes_survives_a_node_loss(tmp_path: Path, tiny_model_dir: Path) -> None:
    """`burstrl run examples/toy-swe.toml --provider ray` on a head (router, replica, trainer) and three
    `sandbox_node` nodes: the attempts' sandboxes go to the node agents; the first node seen holding
    two is removed mid-run and a fresh one added; the run finishes, the attempts there are requeued,
    nothing is lost, and the launcher dropped the removed node's agent and started one on the new node."""
    import sqlite3
    import subprocess

    from ray.cluster_utils import Cluster

    from burstrl.sandbox.node_client import NodeClient, NodeError

    from .conftest import REPO, audit, burstrl_cmd, finish, output, wait_until

    cluster = Cluster(initialize_head=True, connect=False,
                      head_node_args={"num_cpus": 8, "num_gpus": 0, "resources": {"reserved": 4},
                                      "include_dashboard": False, "object_store_memory": 100 * 2**20})
    run_dir = tmp_path / "swe"
    try:
        nodes = [cluster.add_node(num_cpus=4, memory=8 * 2**30, resources={"sandbox_node": 1},
                                  object_store_memory=80 * 2**20) for _ in range(3)]
        cluster.wait_for_nodes()
        out = open(tmp_path / "swe.out", "w")
        proc = subprocess.Popen(burstrl_cmd(
            "run", str(REPO / "examples" / "toy-swe.toml"), "--run_dir", str(run_dir), "--model.path",
            str(tiny_model_dir), "--provider", "ray", "--ray.address", cluster.address,
            "--ray.reserved_resources", '{"reserved": 1}', "--ray.placement_timeout_s", "120",
            "--trainer.steps", "4", "--trainer.batch_groups", "2", "--orchestrator.group_size", "4",
            "--orchestrator.swe.toy_tasks", "3", "--orchestrator.swe.max_turns", "2",
            "--orchestrator.swe.max_sandboxes", "16", "--orchestrator.swe.node_dead_after_s", "5",
            "--fleet.on_demand", "0", "--fleet.start_timeout_s", "300"),
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        nodes_file = run_dir / "sandbox-nodes.json"
        wait_until(nodes_file.exists, 600, "the sandbox node agents", proc, run_dir)
        refs = json.loads(nodes_file.read_text())
        assert len(refs) == 3

        def busy_node() -> str | None:
            """A node holding two sandboxes or more (attempts at work on it, likely mid-command)."""
            for r in refs:
                try:
                    if len(NodeClient(r["url"], r["token"], timeout=10).report()["sandboxes"]) >= 2:
                        return r["name"]
                except NodeError:
                    pass
            return None

        victim = wait_until(busy_node, 900, "a sandbox on a node agent", proc, run_dir)
        node = next(n for n in nodes if victim.endswith(n.node_id[:6]))
        cluster.remove_node(node)
        joined = cluster.add_node(num_cpus=4, memory=8 * 2**30, resources={"sandbox_node": 1},
                                  object_store_memory=80 * 2**20)  # the launcher's poll gives it an agent
        finish(proc, run_dir, timeout=1800)
    finally:
        cluster.shutdown()
    audit(run_dir, 4, batch_groups=2, group_size=4)
    with sqlite3.connect(run_dir / "store.sqlite") as db:
        rows = db.execute("SELECT status, detail FROM attempts").fetchall()
    events = [json.loads(line) for line in (run_dir / "fleet.jsonl").read_text().splitlines()]
    changes = [e["detail"] for e in events if e.get("event") == "sandbox_nodes"]
    print(f"sandbox node changes: {changes}")
    # the launcher saw both mid-run (the run went on for tens of seconds: the requeued attempts re-ran)
    assert f"agent on {victim} dropped (node gone)" in changes
    assert any(c.startswith("agent on ") and joined.node_id[:6] in c and " ready at " in c for c in changes)
    joined_name = next(c.split()[2] for c in changes if c.startswith("agent on ") and joined.node_id[:6] in c)
    assert f"node agents joined: {joined_name}" in (run_dir / "logs" / "orchestrator.log").read_text()  # its pool
    requeued = [d for s, d in rows if s == "requeued"]
    print(f"attempts: {Counter(s for s, _ in rows)}; requeued: {requeued}")
    assert requeued, output(run_dir)[-3000:]  # the attempts on the removed node ran again elsewhere
