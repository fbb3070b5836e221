"""A real node agent (`burstrl sandbox node`) on loopback with the namespace backend: sandboxes made
through it answer directly on their own ports, the report shows them with usage and the layer
cache, bad bodies get 4xx, and a killed agent leaves no sandbox running.

Deadlines are generous and every wait is on a condition (a busy 2-core machine starts a sandbox
in seconds, not the usual ~0.3 s).
"""

from __future__ import annotations

import http.client
import json
import shutil
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from burstrl.protocol.process import RoleProcess, start_role
from burstrl.sandbox.client import SandboxError
from burstrl.sandbox.node_client import NodeClient, NodeError, node_state
from burstrl.sandbox.placement import Layer, OursPolicy, Resources, SandboxRequest
from tests.waiting import wait_for

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None,
                                reason="bubblewrap (bwrap) is not installed: `make system-deps` as root")
TOKEN = "node-test-token"


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def start_agent(workdir: Path, state_dir: Path, cache: Path) -> RoleProcess:
    return start_role(["sandbox", "node", "--backend", "namespace", "--state-dir", str(state_dir),
                       "--layer-cache", str(cache), "--sample-s", "0.2", "--cpus", "8", "--memory-mb", "16384",
                       "--name", "test-node"], workdir, "node.log", timeout=60,
                      env={"BURSTRL_NODE_TOKEN": TOKEN})


@pytest.fixture
def dirs(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """A short state dir under /tmp (socket paths <= 107 bytes) and a layer cache."""
    state = Path(tempfile.mkdtemp(prefix="sbn", dir="/tmp"))
    yield state, tmp_path / "cache"
    shutil.rmtree(state, ignore_errors=True)


def raw(url: str, method: str, path: str, body: bytes = b"", token: str | None = TOKEN) -> tuple[int, dict]:
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    headers = {"Content-Length": str(len(body))}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    conn.request(method, path, body=body, headers=headers)
    resp = conn.getresponse()
    data = json.loads(resp.read())
    conn.close()
    return resp.status, data


def test_node_agent_end_to_end(dirs: tuple[Path, Path], tmp_path: Path) -> None:
    from burstrl.sandbox.images import build_image, read_image

    state_dir, cache = dirs
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "README").write_text("task repo\n")
    build_image(repo, tmp_path / "image")
    image_layers = {d.digest for d in read_image(tmp_path / "image").layers}

    agent = start_agent(tmp_path / "a1", state_dir, cache)
    try:
        node = NodeClient(agent.url, TOKEN)
        assert node.health()["status"] == "ok"
        with ThreadPoolExecutor(4) as ex:
            addrs = list(ex.map(lambda i: node.create(image=str(tmp_path / "image"), cpu_limit=1,
                                                      memory_limit_mb=512, start_timeout_s=60), range(4)))
        assert len({a.id for a in addrs}) == 4

        for i, a in enumerate(addrs):  # straight to each daemon through its port on the node
            with a.client(timeout=60) as c:
                assert c.exec("cat /work/README").stdout == "task repo\n"
                c.write_file("/work/mine", f"sandbox {i}")
                assert c.read_file("/work/mine") == f"sandbox {i}".encode()
                c.exec("python3 -c 'sum(range(3_000_000))'", timeout=60)
        with addrs[0].client(local=True) as c:  # same host: the unix socket works too
            assert c.exec("cat /work/mine").stdout == "sandbox 0"

        def measured() -> dict | None:
            r = node.report()
            ok = len(r["sandboxes"]) == 4 and all(
                s["usage"]["mem"]["samples"] >= 2 and s["usage"]["cpu"]["samples"] >= 2 and s["usage"]["mem"]["mean"] > 0
                for s in r["sandboxes"])
            return r if ok else None
        report = wait_for(measured, 30, "4 sandboxes with usage samples in the report")
        assert image_layers <= set(report["layers"]) and report["layer_bytes"] > 0
        assert report["requested"]["cpu"] == pytest.approx(4 * 0.25)
        assert {s["usage"]["mem_source"] for s in report["sandboxes"]} <= {"cgroup-v1", "cgroup-v2", "proc"}
        assert all(s["token"] is None for s in report["sandboxes"])  # the report never hands out tokens
        state = node_state(report)
        assert len(state.sandboxes) == 4 and state.allocatable.cpu == 8
        request = SandboxRequest("next", tuple(Layer(d, 1000) for d in image_layers), Resources(1, 512 << 20, 256))
        assert OursPolicy().choose([state], request) is state

        gone = addrs.pop()
        node.delete(gone.id)
        assert not (state_dir / gone.id).exists()
        with pytest.raises(SandboxError), gone.client(timeout=5) as c:
            c.exec("true")
        with pytest.raises(NodeError) as err:
            node.delete(gone.id)
        assert err.value.status == 404
        assert len(node.report()["sandboxes"]) == 3

        bad: list[tuple[bytes, int]] = [
            (b"not json", 400), (b"[]", 400), (b'{"bogus": 1}', 400), (b'{"cpu_limit": -1}', 400),
            (b'{"cpu_limit": "2"}', 400), (b'{"cpu_limit": true}', 400), (b'{"memory_limit_mb": 1.5}', 400),
            (b'{"env": {"A": 1}}', 400), (b'{"image": "/nonexistent"}', 400), (b'{"image": ""}', 400),
            (b'{"cpu_limit": 1, "cpu_request": 2}', 400), (b'{"cpu_limit": 1e400}', 400),
            (b'{"cpu_limit": 64, "cpu_request": 64}', 409), (b"\xff\xfe", 400)]
        for body, status in bad:
            got, answer = raw(agent.url, "POST", "/v1/sandboxes", body)
            assert (got, body) == (status, body) and answer["error"]["message"]
        assert raw(agent.url, "POST", "/v1/sandboxes", b"{}", token=None)[0] == 401
        assert raw(agent.url, "GET", "/v1/node", token="wrong")[0] == 401
        assert raw(agent.url, "GET", "/v1/nope")[0] == 404
        assert raw(agent.url, "DELETE", "/v1/node")[0] == 405
        assert node.health()["sandboxes"] == 3 and agent.poll() is None  # nothing crashed

        pids = [a.pid for a in addrs]
        assert None not in pids and agent.proc.pid not in pids  # the sandboxes' own processes, not the agent
        assert all(alive(p) for p in pids)
        agent.kill()  # SIGKILL: no chance to clean up; its sandboxes die with it
        wait_for(lambda: not any(alive(p) for p in pids), 30, "sandbox daemons gone after the agent's death")
        for a in addrs:
            with pytest.raises(SandboxError), a.client(timeout=5) as c:
                c.exec("true")
    finally:
        agent.stop()

    again = start_agent(tmp_path / "a2", state_dir, cache)  # a successor sweeps what was left on disk
    try:
        node = NodeClient(again.url, TOKEN)
        assert sorted(node.report()["swept_at_start"]) == sorted(a.id for a in addrs)
        last = node.create(cpu_limit=1, memory_limit_mb=256, start_timeout_s=60)
        assert last.client(timeout=60).exec("echo ok").stdout == "ok\n"
    finally:
        again.stop()  # SIGTERM: the agent closes what it owns, and its state dir once empty
    assert not alive(last.pid) and not state_dir.exists()


def test_an_agent_sweeps_the_state_dirs_of_agents_that_died(tmp_path: Path) -> None:
    """Ray names each node's state dir by the node id, so a dead node's dir (and its sandboxes'
    mounts) was never swept by a successor with another id. An agent given `--sweep-glob` sweeps
    the dirs of agents that are gone, and leaves a live agent's dir and a fresh unclaimed one."""
    base = Path(tempfile.mkdtemp(prefix="sbw", dir="/tmp"))
    base.chmod(0o711)  # as /tmp: a sandbox's own uid must reach its bind sources under the state dirs
    try:
        first = start_role(["sandbox", "node", "--backend", "namespace", "--state-dir", str(base / "n1"),
                            "--layer-cache", str(tmp_path / "cache"), "--name", "n1"], tmp_path / "a1", "node.log",
                           timeout=60, env={"BURSTRL_NODE_TOKEN": TOKEN})
        try:
            sandbox = NodeClient(first.url, TOKEN).create(cpu_limit=1, memory_limit_mb=256, start_timeout_s=60)
            assert sandbox.client(timeout=60).exec("echo ok").stdout == "ok\n"
        finally:
            first.kill()  # SIGKILL: its dir, owner record and sandbox dir stay behind
        wait_for(lambda: not alive(sandbox.pid), 30, "the dead agent's sandbox gone")
        assert (base / "n1" / sandbox.id).is_dir()
        (base / "fresh").mkdir()  # no agent record yet, just made: another agent may be creating it
        live = start_role(["sandbox", "node", "--backend", "namespace", "--state-dir", str(base / "n2"),
                           "--layer-cache", str(tmp_path / "cache"), "--name", "n2"], tmp_path / "a2", "node.log",
                          timeout=60, env={"BURSTRL_NODE_TOKEN": TOKEN})
        third = start_role(["sandbox", "node", "--backend", "namespace", "--state-dir", str(base / "n3"),
                            "--layer-cache", str(tmp_path / "cache"), "--name", "n3", "--sweep-glob", str(base / "*")],
                           tmp_path / "a3", "node.log", timeout=60, env={"BURSTRL_NODE_TOKEN": TOKEN})
        try:
            report = NodeClient(third.url, TOKEN).report()
            assert report["swept_agent_dirs"] == [str(base / "n1")]
            assert not (base / "n1").exists() and (base / "n2").is_dir() and (base / "fresh").is_dir()
            assert NodeClient(live.url, TOKEN).create(cpu_limit=1, memory_limit_mb=256, start_timeout_s=60).id
        finally:
            third.stop()
            live.stop()
        assert not (base / "n2").exists() and not (base / "n3").exists()  # clean stops remove their dirs
    finally:
        shutil.rmtree(base, ignore_errors=True)
