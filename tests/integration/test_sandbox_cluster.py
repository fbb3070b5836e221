"""`ClusterPool` against real node agents on loopback (several `burstrl sandbox node` processes, each
with its own state dir and layer cache, as on separate nodes): placement spreads a burst by the
agents' admission, commands go straight to each sandbox's port, and a node agent killed with
SIGKILL mid-run turns the attempts on it into infra errors that re-run on the other nodes.

Deadlines are generous and every wait is on a condition (a busy 2-core machine).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from burstrl.config import SweEnvConfig
from burstrl.envs.base import InfraError
from burstrl.envs.swe.agent import SUBMIT_COMMAND
from burstrl.envs.swe.env import SweEnv
from burstrl.protocol.process import RoleProcess, start_role
from burstrl.sandbox.backends import SandboxSpec
from burstrl.sandbox.client import SandboxError
from burstrl.sandbox.cluster import ClusterPool, NodeRef, load_nodes
from burstrl.sandbox.node_client import NodeClient
from tests.waiting import wait_for

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None,
                                reason="bubblewrap (bwrap) is not installed: `make system-deps` as root")
TOKEN = "cluster-test-token"


def entry_pids(sid: str) -> list[int]:
    """The bwrap processes of sandbox `sid` (their command line names its dir)."""
    out = []
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if proc.name.isdigit() and argv and argv[0].endswith(b"bwrap") and any(f"/{sid}".encode() in a for a in argv):
            out.append(int(proc.name))
    return out


class Agents:
    """`n` node agents on loopback, each a node of its own (state dir, layer cache, name)."""

    def __init__(self, root: Path, n: int, cpus: float, memory_mb: int, max_sandboxes: int) -> None:
        self.states = [Path(tempfile.mkdtemp(prefix=f"sbc{i}", dir="/tmp")) for i in range(n)]
        self.procs: list[RoleProcess] = []
        try:
            for i, state in enumerate(self.states):
                self.procs.append(start_role(
                    ["sandbox", "node", "--backend", "namespace", "--state-dir", str(state),
                     "--layer-cache", str(root / f"cache{i}"), "--sample-s", "0.5", "--cpus", str(cpus),
                     "--memory-mb", str(memory_mb), "--max-sandboxes", str(max_sandboxes), "--name", f"node{i}"], root / f"agent{i}", "node.log",
                    timeout=120, env={"BURSTRL_NODE_TOKEN": TOKEN}))
        except BaseException:
            self.stop()
            raise
        self.refs = [NodeRef(p.url, TOKEN, f"node{i}") for i, p in enumerate(self.procs)]

    def stop(self) -> None:
        for p in self.procs:
            p.stop()
        for s in self.states:
            shutil.rmtree(s, ignore_errors=True)


@pytest.fixture
def agents(tmp_path: Path) -> Iterator[Agents]:
    a = Agents(tmp_path, 3, cpus=2, memory_mb=4096, max_sandboxes=2)
    yield a
    a.stop()


def per_node(pool: ClusterPool) -> dict[str, int]:
    return {name: n["sandboxes"] for name, n in pool.stats()["nodes"].items()}


@pytest.mark.slow
def test_burst_spreads_by_admission_and_commands_reach_each_sandbox(agents: Agents) -> None:
    # each agent runs at most 2 (`--max-sandboxes`): a burst of 6 fills all three through refusals and retries
    pool = ClusterPool(agents.refs, "ours", max_concurrent=12)
    try:
        spec = SandboxSpec(cpu_limit=1, memory_limit_mb=2048, start_timeout_s=120)
        with ThreadPoolExecutor(6) as ex:
            boxes = list(ex.map(lambda _: pool.create(spec, timeout=300), range(6)))
        assert per_node(pool) == {"node0": 2, "node1": 2, "node2": 2}
        for i, sb in enumerate(boxes):  # straight to the daemon on its node's forwarded port
            assert sb.client.socket_path is None and sb.client.host == "127.0.0.1"
            sb.write_file("/work/who", f"box {i}")
            assert sb.exec("cat /work/who").stdout == f"box {i}"
        for ref in agents.refs:  # each agent holds exactly what the pool says it placed there
            held = {s["id"] for s in NodeClient(ref.url, TOKEN).report()["sandboxes"]}
            assert held == {sb.id for sb in boxes if sb.node == ref.name}
            assert NodeClient(ref.url, TOKEN).report()["requested"]["cpu"] == pytest.approx(2 * 0.2)
        assert all(not pool.confirm_lost(sb) for sb in boxes)  # alive nodes: never "lost"
        # one sandbox dies alone (its daemon killed, as an OOM kill would): its node answers, so the
        # loss stays the model's doing, never an infra re-run
        victim = boxes[0]
        entry = entry_pids(victim.id)  # bwrap, the sandbox's entry process (the daemon dies with it)
        assert entry
        for pid in entry:
            os.kill(pid, signal.SIGKILL)
        with pytest.raises(SandboxError):
            victim.exec("true", timeout=30)
        assert not pool.confirm_lost(victim) and pool.stats()["nodes_lost"] == 0
        assert pool.decision_s and max(pool.decision_s) < 0.5
        pool.close_all()
        assert per_node(pool) == {"node0": 0, "node1": 0, "node2": 0}
        assert all(NodeClient(r.url, TOKEN).report()["sandboxes"] == [] for r in agents.refs)
    finally:
        pool.close()


@pytest.mark.slow
def test_killed_node_marks_its_sandboxes_lost_and_new_ones_go_elsewhere(agents: Agents) -> None:
    pool = ClusterPool(agents.refs, "ours", max_concurrent=12, refresh_s=0.5, dead_after_s=3)
    try:
        spec = SandboxSpec(cpu_limit=1, memory_limit_mb=2048, start_timeout_s=120)
        with ThreadPoolExecutor(6) as ex:
            boxes = list(ex.map(lambda _: pool.create(spec, timeout=300), range(6)))
        on0 = [sb for sb in boxes if sb.node == "node0"]
        rest = [sb for sb in boxes if sb.node != "node0"]
        assert len(on0) == 2
        agents.procs[0].kill()  # SIGKILL the agent's process group: its sandboxes die with it
        for sb in on0:
            with pytest.raises(SandboxError):
                sb.exec("true", timeout=30)
            assert pool.confirm_lost(sb)
        assert all(sb.exec("echo ok").stdout == "ok\n" and not pool.confirm_lost(sb) for sb in rest)
        wait_for(lambda: pool.stats()["nodes"]["node0"]["dead"], 60, "the monitor marks node0 dead")
        for sb in on0:
            sb.close()  # nothing to ask a dead agent: the slot is freed, no error
        for sb in rest:
            sb.close()
        more = [pool.create(spec, timeout=300) for _ in range(3)]
        assert {sb.node for sb in more} <= {"node1", "node2"}
        stats = pool.stats()
        assert stats["nodes_lost"] == 1 and stats["sandboxes_lost"] == 2 and stats["close_errors"] == 0
    finally:
        pool.close()


def write_nodes(path: Path, refs: list[NodeRef]) -> None:
    """As the Ray launcher does: a temp file renamed over the old one."""
    path.with_suffix(".tmp").write_text(json.dumps([{"url": r.url, "token": r.token, "name": r.name} for r in refs]))
    os.replace(path.with_suffix(".tmp"), path)


@pytest.mark.slow
def test_nodes_added_to_the_file_mid_run_take_sandboxes_and_a_dead_one_never_returns(agents: Agents,
                                                                                     tmp_path: Path) -> None:
    nodes = tmp_path / "nodes.json"
    nodes.write_text("[]")  # no sandbox node has joined yet (or, for a restarted orchestrator, none is left)
    pool = ClusterPool(load_nodes(nodes, allow_empty=True), "ours", max_concurrent=12, refresh_s=0.5,
                       dead_after_s=3, nodes_file=nodes)
    try:
        spec = SandboxSpec(cpu_limit=1, memory_limit_mb=2048, start_timeout_s=120)
        with pytest.raises(TimeoutError):  # waits for a node up to its timeout: never fails the run
            pool.create(spec, timeout=1)
        with ThreadPoolExecutor(1) as ex:
            waiting = ex.submit(pool.create, spec, 300)
            write_nodes(nodes, agents.refs[:1])
            first = [waiting.result(timeout=300), pool.create(spec, timeout=300)]  # node0 now full (max 2)
        assert {sb.node for sb in first} == {"node0"}
        nodes.write_text("[{not json")  # a bad edit is counted and changes nothing
        wait_for(lambda: pool.stats()["nodes_file_errors"] == 1, 60, "the pool reads the broken file")
        write_nodes(nodes, agents.refs[:2])
        wait_for(lambda: "node1" in pool.stats()["nodes"], 60, "node1 joins the pool")
        on1 = pool.create(spec, timeout=300)
        assert on1.node == "node1" and on1.exec("echo joined").stdout == "joined\n"
        agents.procs[1].kill()
        wait_for(lambda: pool.stats()["nodes"]["node1"]["dead"], 60, "the monitor marks node1 dead")
        on1.close()
        write_nodes(nodes, agents.refs)  # still lists node1: a node marked dead is never added again
        wait_for(lambda: "node2" in pool.stats()["nodes"], 60, "node2 joins the pool")
        on2 = pool.create(spec, timeout=300)
        assert on2.node == "node2" and on2.exec("echo ok").stdout == "ok\n"
        stats = pool.stats()
        assert len(pool.nodes) == 3 and stats["nodes"]["node1"]["dead"] and not stats["nodes"]["node2"]["dead"]
        assert stats["nodes_joined"] == 3 and stats["nodes_lost"] == 1
    finally:
        pool.close()


def test_nodes_file_is_validated(tmp_path: Path) -> None:
    good = tmp_path / "nodes.json"
    good.write_text(json.dumps([{"url": "http://127.0.0.1:1", "token": "t", "name": "a"}]))
    assert load_nodes(good) == [NodeRef("http://127.0.0.1:1", "t", "a")]
    for bad in ("[]", "{}", '[{"url": "x"}]'):
        good.write_text(bad)
        with pytest.raises((ValueError, KeyError)):
            load_nodes(good)
    good.write_text("[]")
    assert load_nodes(good, allow_empty=True) == []
    with pytest.raises(ValueError, match="at least one node agent"):  # no node, and none can join
        ClusterPool([])


class Gated:
    """A model that, on its first call, waits for the test's go (so every attempt holds its sandbox
    when a node is killed), then runs one command and submits."""

    def __init__(self, started: list[int], go: asyncio.Event) -> None:
        self.started, self.go, self.calls = started, go, 0

    async def chat(self, messages, max_tokens=None) -> str:
        self.calls += 1
        if self.calls == 1:
            self.started.append(1)
            await self.go.wait()
            return "```bash\necho working\n```"
        return f"```bash\n{SUBMIT_COMMAND}\n```"


@pytest.mark.slow
def test_swe_attempts_on_a_killed_node_are_infra_errors_and_rerun_elsewhere(agents: Agents, tmp_path: Path) -> None:
    nodes = tmp_path / "nodes.json"
    nodes.write_text(json.dumps([{"url": r.url, "token": r.token, "name": r.name} for r in agents.refs]))
    env = SweEnv(SweEnvConfig(toy_tasks=2, max_sandboxes=12, max_turns=3, nodes_file=str(nodes),
                              node_dead_after_s=3), tmp_path / "run")
    tasks = env.make_tasks(1, seed=0, difficulty=1) * 6

    async def first_round() -> list[Any]:
        started: list[int] = []
        go = asyncio.Event()
        runs = [asyncio.ensure_future(env.rollout(Gated(started, go), t)) for t in tasks]
        deadline = time.monotonic() + 300
        while len(started) < len(tasks):
            assert time.monotonic() < deadline, f"only {len(started)} attempts started"
            await asyncio.sleep(0.2)
        assert per_node(env.pool())["node0"] == 2, json.dumps(env.pool().stats())
        await asyncio.to_thread(agents.procs[0].kill)
        go.set()
        return await asyncio.wait_for(asyncio.gather(*runs, return_exceptions=True), timeout=600)

    async def both_rounds() -> tuple[list[Any], list[Any]]:
        first = await first_round()
        go = asyncio.Event()
        go.set()
        # the orchestrator re-runs an InfraError (loop.run_slot): here, two attempts again, on the nodes left
        again = await asyncio.wait_for(asyncio.gather(*(env.rollout(Gated([], go), t) for t in tasks[:2])), 600)
        return first, again

    try:
        results, again = asyncio.run(both_rounds())
        infra = [r for r in results if isinstance(r, InfraError)]
        graded = [r for r in results if not isinstance(r, BaseException)]
        assert len(infra) == 2 and len(graded) == 4, results
        assert all("node died" in str(e) for e in infra)
        for o in graded + list(again):  # on live nodes: graded as usual, nothing "lost" to score 0
            assert o.parts["submitted"] == 1.0 and o.parts["sandbox_lost"] == 0.0
        stats = env.pool().stats()
        assert stats["nodes"]["node0"]["dead"] and stats["nodes_lost"] == 1
    finally:
        env.close()
    assert all(n["sandboxes"] == 0 for n in env.pool().stats()["nodes"].values())
