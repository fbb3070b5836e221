"""Attacks on sandboxd itself (issue 15, items 3, 6 and 9): memory, connections, fifos, the
oversized body, a hijacked socket, and commands that kill everything or eat memory. Each asserts
that the attack fails alone and the daemon keeps serving.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from burstrl.sandbox import client as client_mod
from burstrl.sandbox.client import (
    AsyncSandboxClient,
    SandboxClient,
    SandboxError,
    socket_peer,
)

SRC = Path(__file__).resolve().parents[2] / "src"
TOKEN = "s3cret-token"
needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap (bwrap) is not installed")


@dataclass
class Daemon:
    proc: subprocess.Popen
    root: Path
    socket_path: str
    pid: int

    def client(self, **kwargs: object) -> SandboxClient:
        return SandboxClient(socket_path=self.socket_path, token=TOKEN, timeout=10, **kwargs)  # type: ignore[arg-type]

    def rss_mb(self) -> float:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        raise AssertionError("no VmRSS")


def _start(tmp: Path, name: str = "sd.sock", extra_env: dict[str, str] | None = None,
           args: tuple[str, ...] = ()) -> Daemon:
    root = tmp / "root"
    root.mkdir(exist_ok=True)
    env = {"PATH": os.environ["PATH"], "PYTHONPATH": str(SRC), "SANDBOX_TOKEN": TOKEN, **(extra_env or {})}
    proc = subprocess.Popen([sys.executable, "-S", "-m", "burstrl.sandbox.daemon", "--socket", str(tmp / name),
                             "--root", str(root), "--work-dir", str(root), *args],
                            env=env, stdout=subprocess.PIPE, start_new_session=True)
    ready = json.loads(proc.stdout.readline())
    return Daemon(proc, root, ready["socket"], ready["pid"])


def _stop(d: Daemon) -> None:
    if d.proc.poll() is None:
        os.killpg(d.proc.pid, signal.SIGKILL)
    d.proc.wait()


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[Daemon]:
    d = _start(tmp_path)
    yield d
    _stop(d)


def test_kept_results_are_bounded_by_bytes(daemon: Daemon) -> None:
    """300 execs of 1 MB output each: the daemon keeps at most RESULT_BYTES of them (it used to
    keep 1024 whole results and be OOM-killed near the 250th); a dropped id answers 410."""
    c = daemon.client()
    base = daemon.rss_mb()
    for i in range(300):
        res = c.exec("head -c 1000000 /dev/zero | tr '\\0' a", request_id=f"big-{i}")
        assert res.exit_code == 0 and len(res.stdout) == 1_000_000
    assert daemon.rss_mb() - base < 150, daemon.rss_mb()
    assert len(c.exec("echo x", request_id="big-299").stdout) == 1_000_000  # recent: the recorded result
    with pytest.raises(SandboxError) as err:
        c.exec("echo ran-again", request_id="big-0")
    assert err.value.status == 410


def test_idle_connections_do_not_lock_out_the_harness(daemon: Daemon) -> None:
    idle = []
    try:
        for i in range(200):
            s = socket.socket(socket.AF_UNIX)
            s.connect(daemon.socket_path)
            if i % 2:
                s.sendall(b"POST /exec HTTP/1.1\r\nContent-Length: 100\r\n")  # half-sent, no token yet
            idle.append(s)
        start = time.monotonic()
        assert daemon.client().exec("echo ok").stdout == "ok\n"
        assert time.monotonic() - start < 10
        assert int(Path(f"/proc/{daemon.pid}/status").read_text().split("Threads:")[1].split()[0]) < 80
    finally:
        for s in idle:
            s.close()
    assert daemon.client().health().status == "ok"


def test_fifo_is_refused_quickly(daemon: Daemon) -> None:
    os.mkfifo(daemon.root / "fifo")
    c = daemon.client()
    start = time.monotonic()
    for call in (lambda: c.read_file("fifo"), lambda: c.write_file("fifo", "x")):
        with pytest.raises(SandboxError) as err:
            call()
        assert err.value.status == 400 and "regular file" in err.value.message
    assert time.monotonic() - start < 2
    assert c.health().status == "ok"


@pytest.mark.parametrize("how", ["env", "file", "inherit"])
def test_base_env_reaches_commands(tmp_path: Path, how: str) -> None:
    base = {"FOO": "from-spec", "PATH": "/opt/img/bin:/usr/bin:/bin"}
    if how == "env":
        d = _start(tmp_path, extra_env={"SANDBOXD_ENV": json.dumps(base)})
    elif how == "inherit":  # the token reaches the daemon by env here: it must not reach commands
        d = _start(tmp_path, extra_env=base, args=("--inherit-env",))
        assert d.client().exec('echo "${SANDBOX_TOKEN:-gone}"').stdout == "gone\n"
    else:
        (tmp_path / "env.json").write_text(json.dumps(base))
        d = _start(tmp_path, args=("--env-file", str(tmp_path / "env.json")))
    try:
        c = d.client()
        assert c.exec('echo "$FOO|$PATH|${SANDBOXD_ENV:-unset}"').stdout == "from-spec|/opt/img/bin:/usr/bin:/bin|unset\n"
        assert c.exec('echo "$FOO"', env={"FOO": "request"}).stdout == "request\n"  # the request's env wins
    finally:
        _stop(d)


def test_oversized_body_is_413_and_never_resent(daemon: Daemon, monkeypatch: pytest.MonkeyPatch) -> None:
    c = daemon.client()
    big = b"x" * (13 * 1024 * 1024)  # 17 MiB once base64-encoded: over the daemon's 16 MiB
    with pytest.raises(SandboxError) as err:  # checked before sending
        c.write_file("big", big)
    assert err.value.status == 413
    calls = []
    real = SandboxClient._exchange
    monkeypatch.setattr(SandboxClient, "_exchange", lambda self, *a: calls.append(1) or real(self, *a))
    monkeypatch.setattr(client_mod, "MAX_BODY", 1 << 30)  # the client no longer knows the limit
    with pytest.raises(SandboxError) as err:
        c.write_file("big", big)
    assert err.value.status == 413 and len(calls) == 1, (err.value, calls)
    aclient = AsyncSandboxClient(socket_path=daemon.socket_path, token=TOKEN, timeout=10)
    with pytest.raises(SandboxError) as err:  # the async client reads the daemon's early answer too
        asyncio.run(aclient.write_file("big", big))
    assert err.value.status == 413, err.value
    assert not (daemon.root / "big").exists()
    assert c.health().status == "ok"


def test_client_refuses_a_symlinked_socket(daemon: Daemon, tmp_path: Path) -> None:
    link = tmp_path / "link.sock"
    link.symlink_to(daemon.socket_path)
    with pytest.raises(SandboxError) as err:
        SandboxClient(socket_path=str(link), token=TOKEN, timeout=5).health()
    assert err.value.status == 502 and "not a unix socket" in err.value.message


def test_client_refuses_another_process_socket(daemon: Daemon, tmp_path: Path) -> None:
    other_dir = tmp_path / "other"
    other_dir.mkdir()
    impostor = _start(other_dir)
    try:
        assert socket_peer(daemon.socket_path)[:2] == (daemon.pid, os.geteuid())
        good = SandboxClient(socket_path=daemon.socket_path, token=TOKEN, expected_pid=daemon.pid,
                             expected_uid=os.geteuid())
        assert good.health().pid == daemon.pid
        for kwargs in ({"expected_pid": daemon.pid}, {"expected_uid": os.geteuid() + 1}):
            with pytest.raises(SandboxError) as err:
                SandboxClient(socket_path=impostor.socket_path, token=TOKEN, **kwargs).health()
            assert err.value.status == 502, err.value
        aclient = AsyncSandboxClient(socket_path=impostor.socket_path, token=TOKEN, expected_pid=daemon.pid)
        with pytest.raises(SandboxError) as err:
            asyncio.run(aclient.health())
        assert err.value.status == 502
    finally:
        _stop(impostor)


def test_commands_get_a_high_oom_score(daemon: Daemon) -> None:
    c = daemon.client()
    assert c.exec("cat /proc/self/oom_score_adj").stdout == "1000\n"
    assert c.exec(["cat", "/proc/self/oom_score_adj"]).stdout == "1000\n"


@needs_bwrap
def test_pid1_daemon_survives_kill_all_and_reaps(tmp_path: Path) -> None:
    """The daemon as pid 1 of a bwrap pid namespace (`--as-pid-1`): `kill -9 -1` from a command
    cannot reach it, and the orphans its commands leave are reaped."""
    run = Path(tempfile.mkdtemp(prefix="sd-", dir="/tmp"))
    (run / "token").write_text(TOKEN)
    argv = ["bwrap", "--unshare-all", "--as-pid-1", "--die-with-parent", "--new-session", "--cap-drop", "ALL",
            "--ro-bind", "/", "/", "--proc", "/proc", "--dev", "/dev", "--bind", str(run), str(run),
            sys.executable, "-I", "-c", (f"import sys, runpy; sys.path.insert(0, {str(SRC)!r}); "
                                         "runpy.run_module('burstrl.sandbox.daemon', run_name='__main__', alter_sys=True)"),
            "--socket", str(run / "sd.sock"), "--token-file", str(run / "token"), "--root", "/", "--work-dir", str(run)]
    # no tmpfs over /tmp: the interpreter may live there (a CI clone under /tmp)
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, start_new_session=True)
    try:
        ready = json.loads(proc.stdout.readline())
        assert ready["pid"] == 1
        c = SandboxClient(socket_path=ready["socket"], token=TOKEN, timeout=10)
        for _ in range(20):
            c.exec("sleep 0.01 & sleep 0.01 & true")
        c.exec("kill -9 -1; sleep 0.2")
        assert c.health().status == "ok"
        time.sleep(1.0)
        zombies = c.exec("grep -l '^State:.*Z' /proc/[0-9]*/status 2>/dev/null | wc -l").stdout.strip()
        assert zombies == "0"
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        shutil.rmtree(run, ignore_errors=True)


@needs_bwrap
@pytest.mark.filterwarnings("ignore:sandbox limits not fully enforced")
def test_namespace_sandbox_survives_memory_hog_and_kill_all() -> None:
    """Through the real backend: a memory hog is OOM-killed (the command, not the daemon), and
    `kill -9 -1` leaves the daemon serving where the backend makes it pid 1 of its namespace."""
    from burstrl.sandbox import open_sandbox

    sb = open_sandbox(memory_limit_mb=256, backend="namespace")
    try:
        if sb.limits.memory != "none":
            hog = sb.exec("python3 -c \"a = []\nwhile True: a.append(b'x' * (1 << 24))\"", timeout=30)
            assert hog.exit_code != 0
            assert sb.client.health().status == "ok"
        sb.exec("kill -9 -1; sleep 0.2", timeout=10)  # the daemon is pid 1 (bwrap --as-pid-1)
        assert sb.client.health().status == "ok"
        assert sb.exec("echo still here").stdout == "still here\n"
    finally:
        sb.close()
