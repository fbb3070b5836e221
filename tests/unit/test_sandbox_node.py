"""The node agent's pure parts: spec validation, usage readings from cgroup files, the report's NodeState."""

from __future__ import annotations

import os
from collections import deque
from pathlib import Path

import pytest

from burstrl.sandbox.node import BadRequest, parse_spec, usage_of
from burstrl.sandbox.node_client import node_state
from burstrl.sandbox.nodeusage import ProcTable, node_allocatable, read_sandbox


@pytest.mark.parametrize("body", [None, [], "x", {"bogus": 1}, {"cpu_limit": 0}, {"cpu_limit": "1"},
                                  {"pids_limit": True}, {"memory_limit_mb": 2.5}, {"env": {"A": 1}},
                                  {"env": ["A"]}, {"image": ""}, {"image": "/no/such/layout"},
                                  {"cpu_limit": 1, "cpu_request": 1.5}, {"cpu_limit": float("inf")}])
def test_bad_specs_are_400(body: object) -> None:
    with pytest.raises(BadRequest) as err:
        parse_spec(body)
    assert err.value.status == 400 and str(err.value)


def test_spec_defaults_and_fields() -> None:
    spec = parse_spec({"cpu_limit": 2, "memory_limit_mb": 1024, "env": {"A": "b"}, "cpu_request": None})
    assert (spec.cpu_limit, spec.cpu_request, spec.memory_request_mb, spec.env) == (2.0, 0.5, 409, {"A": "b"})


def test_cgroup_v2_counters_and_proc_fallback(tmp_path: Path) -> None:
    (tmp_path / "cpu.stat").write_text("usage_usec 2500000\nuser_usec 2000000\n")
    (tmp_path / "memory.current").write_text("1048576\n")
    (tmp_path / "memory.events").write_text("low 0\noom 1\noom_kill 2\n")
    r = read_sandbox([str(tmp_path)], None, ProcTable())
    assert (r.cpu_seconds, r.mem_bytes, r.oom_kills, r.cpu_source, r.mem_source) == (2.5, 1048576, 2, "cgroup-v2",
                                                                                      "cgroup-v2")
    own = read_sandbox([], os.getpid(), ProcTable())  # no cgroup: this process's tree from /proc
    assert own.cpu_source == own.mem_source == "proc" and own.mem_bytes > 0


def test_report_to_node_state() -> None:
    alloc = node_allocatable(cpu=16, mem_bytes=64 << 30)
    usage = usage_of(deque([0.1, 0.3]))
    report = {"name": "n1", "allocatable": {"cpu": alloc.cpu, "mem": alloc.mem, "pids": alloc.pids},
              "layers": {"sha256:aa": 123},
              "sandboxes": [{"id": "s1", "requests": {"cpu": 0.25, "mem": 1 << 20, "pids": 256},
                             "limits_requested": {"cpu": 1.0, "mem": 4 << 20, "pids": 256},
                             "usage": {"cpu": usage, "mem": usage_of(deque())}}]}
    state = node_state(report)
    assert state.allocatable.cpu == 16 and state.layers == {"sha256:aa": 123}
    assert state.sandboxes[0].cpu.mean == pytest.approx(0.2) and state.sandboxes[0].mem.mean == 0
    assert state.requested().cpu == 0.25


@pytest.mark.parametrize("answer", [
    b"HTTP/1.1 200 OK\r\nContent-Length: 1592\r\n\r\n{\"partial\":",  # dies mid-answer (IncompleteRead)
    b"HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\nnot json!",
    b"garbage status line\r\n\r\n",
])
def test_an_agent_that_dies_mid_answer_or_answers_garbage_is_a_node_error(answer: bytes) -> None:
    """The pool's monitor tolerates `NodeError` only; anything else from a broken agent ended the
    monitor thread (CI: IncompleteRead), and no node was ever adopted or declared dead again."""
    import socket
    import threading

    from burstrl.sandbox.node_client import NodeClient, NodeError

    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]

    def serve() -> None:
        conn, _ = srv.accept()
        with conn:
            conn.recv(65536)
            conn.sendall(answer)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        with pytest.raises(NodeError):
            NodeClient(f"http://127.0.0.1:{port}", "tok", timeout=30).report()
    finally:
        t.join(timeout=30)
        srv.close()


def _dead_agent_dir(root: Path, name: str, pid: int, sandboxes: int) -> Path:
    """A state dir as a killed agent leaves it: its record and sandbox dirs owned by a dead pid."""
    import json

    path = root / name
    path.mkdir()
    record = json.dumps({"owner_pid": pid, "owner_start": None})
    (path / "owner.json").write_text(record)
    for i in range(sandboxes):
        (path / f"sb{i}" / "work" / "deep").mkdir(parents=True)
        (path / f"sb{i}" / "owner.json").write_text(record)
        (path / f"sb{i}" / "work" / "deep" / "file").write_text("x")
    return path


def test_agents_starting_together_sweep_dead_dirs_once_each_and_never_fail() -> None:
    """Regression (clean-clone run at 55daca4): three Ray nodes' agents started on one host at once
    and swept the same dead dir together; one's rmtree met files the other had removed
    (FileNotFoundError) and the agent failed to start. Sweeps now lock each dir and report, never
    raise, their errors."""
    import shutil
    import subprocess
    import tempfile
    from concurrent.futures import ThreadPoolExecutor

    from burstrl.sandbox.node import sweep_dead_agents

    proc = subprocess.Popen(["true"])
    proc.wait()
    root = Path(tempfile.mkdtemp(prefix="sbw", dir="/tmp"))
    try:
        dead = [_dead_agent_dir(root, f"n{i}", proc.pid, sandboxes=6) for i in range(8)]
        own = [root / f"own{i}" for i in range(4)]
        with ThreadPoolExecutor(4) as pool:
            results = list(pool.map(lambda d: sweep_dead_agents(str(root / "n*"), d), own))
        assert all(errors == [] for _, errors in results), results
        assert sorted(p for removed, _ in results for p in removed) == sorted(str(d) for d in dead)  # each once
        assert list(root.iterdir()) == []
        if os.getuid() == 0:  # another user's dir under a matching name (planted records) is never read
            planted = _dead_agent_dir(root, "planted", proc.pid, sandboxes=1)
            os.chown(planted, 65534, 65534)
            writable = _dead_agent_dir(root, "writable", proc.pid, sandboxes=1)
            writable.chmod(0o777)
            assert sweep_dead_agents(str(root / "*"), root / "own") == ([], [])
            assert planted.is_dir() and writable.is_dir()
            shutil.rmtree(planted)
            shutil.rmtree(writable)
        (root / "broken").mkdir()
        (root / "broken" / "owner.json").write_text("{\"owner_pid\": \"not a pid\"}")
        removed, errors = sweep_dead_agents(str(root / "*"), root / "own")
        assert removed == [] and len(errors) == 1 and "broken" in errors[0]  # reported, not raised
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_an_agent_refuses_a_state_dir_another_user_could_have_planted(tmp_path: Path) -> None:
    """The agent acts on the records in its state dir at start (kills, cgroup and mount removal);
    the default name is predictable in /tmp, so a dir not this uid's alone is refused, naming why."""
    from burstrl.sandbox.node import check_private_dir

    check_private_dir(tmp_path / "absent")  # made by the agent itself: fine
    mine = tmp_path / "mine"
    mine.mkdir(mode=0o711)
    check_private_dir(mine)
    open_to_all = tmp_path / "open"
    open_to_all.mkdir()
    open_to_all.chmod(0o777)
    with pytest.raises(ValueError, match="another user can write or own"):
        check_private_dir(open_to_all)
    link = tmp_path / "link"
    link.symlink_to(mine)
    with pytest.raises(ValueError, match="not a directory"):
        check_private_dir(link)
    if os.getuid() == 0:
        theirs = tmp_path / "theirs"
        theirs.mkdir()
        os.chown(theirs, 65534, 65534)
        with pytest.raises(ValueError, match="uid 65534"):
            check_private_dir(theirs)
