"""Real sandboxes (bubblewrap, and runc where it runs): isolation, limits, clean-up, the pool."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import pytest

from burstrl.sandbox.backends import SandboxSpec, make_backend
from burstrl.sandbox.backends.oci import runtime_works
from burstrl.sandbox.client import SandboxClient, SandboxError
from burstrl.sandbox.pool import SandboxPool, open_sandbox, sweep_stale

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None,
                                reason="bubblewrap (bwrap) is not installed: `make system-deps` as root")


@pytest.fixture
def state_dir():
    """Short, under /tmp: the daemon's unix socket path must fit in 107 bytes."""
    path = Path(tempfile.mkdtemp(prefix="sbx", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def pool(state_dir: Path):
    with SandboxPool(make_backend("namespace", state_dir=state_dir), max_concurrent=8) as p:
        yield p


def _alive(pid: int) -> bool:
    """Running, not merely an unreaped zombie (a dead harness's children go to an init that may
    not reap here)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _procs_mentioning(text: str) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if text.encode() in cmdline and _alive(int(entry.name)):
                out.append(int(entry.name))
    return out


def test_create_exec_close(pool: SandboxPool, state_dir: Path) -> None:
    sb = pool.create()
    res = sb.exec("echo hello; pwd")
    assert (res.exit_code, res.stdout) == (0, "hello\n/work\n")
    sb.write_file("/work/a.txt", b"data")
    assert sb.read_file("/work/a.txt") == b"data"
    cgroup_dirs = json.loads((sb.path / "owner.json").read_text())["cgroups"]
    sb.close()
    sb.close()  # idempotent
    assert not sb.path.exists()
    assert not any(Path(d).exists() for d in cgroup_dirs)
    assert _procs_mentioning(str(sb.path)) == []
    assert pool.live == []


def test_no_network(pool: SandboxPool) -> None:
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    try:
        sb = pool.create()
        probe = (f"import socket\ns = socket.socket()\ns.settimeout(3)\n"
                 f"try:\n    s.connect(('127.0.0.1', {port})); print('connected')\n"
                 f"except OSError as e:\n    print('refused', e)\n"
                 f"try:\n    socket.getaddrinfo('example.com', 80); print('resolved')\n"
                 f"except OSError as e:\n    print('nodns', e)\n")
        sb.write_file("/work/probe.py", probe)
        out = sb.exec("python3 /work/probe.py").stdout
        assert "refused" in out and "connected" not in out
        assert "nodns" in out and "resolved" not in out
    finally:
        server.close()


def test_host_files_and_base(pool: SandboxPool, tmp_path: Path) -> None:
    secret = Path(tempfile.mkdtemp(prefix="secret", dir="/tmp")) / "s.txt"
    secret.write_text("top secret")
    try:
        sb = pool.create()
        assert sb.exec(f"cat {secret}").exit_code != 0
        assert sb.exec("ls /work/main/src").exit_code != 0
        assert "burstrl" in sb.exec("ls /opt/burstrl").stdout
        for path in ("/usr/x", "/etc/x", "/x", "/opt/burstrl/x"):
            res = sb.exec(f"touch {path}")
            assert res.exit_code != 0 and "Read-only" in res.stderr, (path, res)
        assert sb.exec("touch /tmp/ok /work/ok").exit_code == 0
    finally:
        shutil.rmtree(secret.parent)


def test_sandboxes_cannot_see_each_other(pool: SandboxPool) -> None:
    a, b = pool.create_many([SandboxSpec(), SandboxSpec()])
    a.exec("echo mine > /work/a.txt; echo t > /tmp/t.txt; setsid -f sleep 30")
    assert "sleep" in a.exec("ps -eo comm").stdout
    assert "sleep" not in b.exec("ps -eo comm").stdout
    assert b.exec("cat /work/a.txt").exit_code != 0
    assert b.exec("cat /tmp/t.txt").exit_code != 0
    assert b.exec(f"ls {a.path}").exit_code != 0


def test_memory_limit_kills_the_allocator(pool: SandboxPool) -> None:
    sb = pool.create(SandboxSpec(memory_limit_mb=96))
    if sb.limits.memory == "none":
        pytest.skip("memory limit not enforceable here: " + "; ".join(sb.limits.reasons))
    res = sb.exec("python3 -c 'b = bytearray(400 << 20); print(len(b))'", timeout=30)
    assert res.exit_code in (-9, 137), res
    assert sb.client.health() is not None
    assert sb.exec("echo alive").stdout == "alive\n"


def test_fork_bomb_is_contained(pool: SandboxPool) -> None:
    sb = pool.create(SandboxSpec(pids_limit=40))
    if sb.limits.pids != "cgroup-v1" and sb.limits.pids != "cgroup-v2":
        pytest.skip("pids limit not enforceable here: " + "; ".join(sb.limits.reasons))
    res = sb.exec("for i in $(seq 200); do sleep 2 & done; wait", timeout=30)
    assert "fork" in res.stderr.lower() or "resource temporarily unavailable" in res.stderr.lower(), res
    assert sb.exec("echo alive").stdout == "alive\n"


def test_daemon_without_token_answers_401(pool: SandboxPool) -> None:
    sb = pool.create()
    for token in ("", "wrong"):
        client = SandboxClient(socket_path=str(sb.path / "run" / "sandboxd.sock"), token=token)
        with pytest.raises(SandboxError) as err:
            client.exec("echo no")
        assert err.value.status == 401


HARNESS = textwrap.dedent("""
    import json, sys, threading
    from burstrl.sandbox.backends import make_backend
    from burstrl.sandbox.pool import SandboxPool
    pool = SandboxPool(make_backend("namespace", state_dir=sys.argv[1]), max_concurrent=3)
    boxes = [pool.create() for _ in range(3)]
    for sb in boxes:
        threading.Thread(target=sb.exec, args=("sleep 600",), kwargs={"timeout": 900}, daemon=True).start()
    print(json.dumps([str(sb.path) for sb in boxes]), flush=True)
    threading.Event().wait()
""")


@pytest.mark.slow
def test_killed_harness_leaves_no_sandbox(state_dir: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-c", HARNESS, str(state_dir)], stdout=subprocess.PIPE, text=True)
    paths = json.loads(proc.stdout.readline())
    time.sleep(0.5)  # the commands are running
    owners = [json.loads((Path(p) / "owner.json").read_text()) for p in paths]
    assert all(_alive(o["pid"]) for o in owners)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(_procs_mentioning(p) for p in paths):
        time.sleep(0.05)
    assert [_procs_mentioning(p) for p in paths] == [[], [], []]
    assert not any(_alive(o["pid"]) for o in owners)
    assert sorted(sweep_stale(state_dir)) == sorted(Path(p).name for p in paths)
    assert list(state_dir.iterdir()) == []
    assert not any(Path(d).exists() for o in owners for d in o["cgroups"])


@pytest.mark.slow
def test_pool_of_8_created_concurrently(pool: SandboxPool, state_dir: Path) -> None:
    boxes = pool.create_many([SandboxSpec() for _ in range(8)])
    assert len({sb.id for sb in boxes}) == 8
    results = [None] * 8

    def run(i: int) -> None:
        results[i] = boxes[i].exec(f"echo {i}").stdout

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [f"{i}\n" for i in range(8)]
    with pytest.raises(TimeoutError):
        pool.create(timeout=0.1)  # the bound holds
    pool.close_all()
    assert list(state_dir.iterdir()) == []


def test_image_work_dir_is_seeded(state_dir: Path, tmp_path: Path) -> None:
    from burstrl.sandbox.images import build_image
    from burstrl.sandbox.layercache import LayerCache

    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "README").write_text("task repo\n")
    build_image(repo, tmp_path / "image")
    backend = make_backend("namespace", state_dir=state_dir,
                           layer_cache=LayerCache(tmp_path / "cache", max_bytes=1 << 30))
    with SandboxPool(backend, max_concurrent=2) as pool:
        sb = pool.create(SandboxSpec(image=tmp_path / "image"))
        assert sb.exec("cat /work/README").stdout == "task repo\n"
        assert sb.exec("echo x >> /work/README").exit_code == 0
        other = pool.create(SandboxSpec(image=tmp_path / "image"))  # writes stay in their sandbox
        assert other.exec("cat /work/README").stdout == "task repo\n"
    assert list(state_dir.iterdir()) == []  # overlay mounts (where allowed) unmounted, dirs gone


def test_open_sandbox_three_lines() -> None:
    sb = open_sandbox()
    assert sb.exec("echo 3").stdout == "3\n"
    assert sb.exec("cat /etc/shadow | wc -c").stdout.strip() == "0"  # host secrets masked
    sb.close()


def test_oci_backend(state_dir: Path) -> None:
    runtime = os.environ.get("BURSTRL_OCI_RUNTIME", "runc")
    ok, reason = runtime_works(runtime, state_dir)
    if not ok:
        pytest.skip(reason)
    with SandboxPool(make_backend("oci", state_dir=state_dir, runtime=runtime), max_concurrent=2) as pool:
        sb = pool.create(SandboxSpec(memory_limit_mb=96))
        assert sb.exec("echo oci").stdout == "oci\n"
        assert sb.exec("touch /usr/x").exit_code != 0
        assert sb.exec("python3 -c 'import socket; socket.getaddrinfo(\"example.com\", 80)'").exit_code != 0
        assert sb.exec("python3 -c 'b = bytearray(400 << 20)'", timeout=30).exit_code in (-9, 137)
        path = sb.path
        sb.close()
        assert not path.exists()
        assert _procs_mentioning(str(path)) == []
