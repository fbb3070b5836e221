"""How a role's process is started, says where it listens, and is stopped (its whole process group).

Both sides of one hand-off live here: the child binds its own socket (`bind_socket`, so `--port 0`
works) and prints one JSON ready line with its URL (`print_ready`); the parent (`start_role` for
tests, examples and the local provider; the Ray actors) reads it (`ready_url`) to learn where the
child listens. Providers and the trainer launcher also use `die_with_parent_signal`, so children
die with a launcher killed -9.
"""

from __future__ import annotations

import ctypes
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass
class RoleProcess:
    """A running burstrl role (a replica, the router, ...); `stop()`/`kill()` end its process group."""

    url: str
    proc: subprocess.Popen
    log: Path
    cause: str = ""
    restarts: int = 0

    def poll(self) -> int | None:
        return self.proc.poll()

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode

    def stop(self, timeout: float = 15.0) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()

    def kill(self) -> None:
        """SIGKILL the whole process group at once (a preemption, not a shutdown)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def start_replica(model_dir: str | Path, workdir: str | Path, *overrides: str,
                  timeout: float = 120.0) -> RoleProcess:
    """Run `burstrl serve --model DIR --port 0 ...overrides`; return once it is listening.

    stderr goes to `workdir/serve.log`; a child that dies or stays silent past `timeout` raises
    RuntimeError quoting the log's tail.
    """
    return start_role(["serve", "--model", str(model_dir), "--port", "0", *overrides], workdir, "serve.log",
                      timeout)


def start_router(workdir: str | Path, *overrides: str, timeout: float = 60.0) -> RoleProcess:
    """Run `burstrl route serve --port 0 ...overrides` (stderr to `workdir/router.log`)."""
    return start_role(["route", "serve", "--port", "0", *overrides], workdir, "router.log", timeout)


def start_role(args: list[str], workdir: str | Path, log_name: str, timeout: float,
               env: dict[str, str] | None = None, wait_ready: bool = True, append: bool = False,
               die_with_parent: bool = False) -> RoleProcess:
    """Run `burstrl ARGS` in its own process group.

    With `wait_ready`, return once it prints its JSON ready line (stdout is a pipe, stderr the log);
    without, return at once with stdout and stderr both in the log. `append` keeps an earlier log
    (a resumed run, a replacement under the same name). `die_with_parent`: the child gets SIGKILL
    when the thread that started it dies (Linux), so a launcher killed with -9 leaves no orphans.
    """
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    log = workdir / log_name
    cmd = [sys.executable, "-c", "from burstrl.cli import main; main()", *args]
    with open(log, "a" if append else "w") as err:
        out = subprocess.PIPE if wait_ready else err
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, text=True, start_new_session=True,
                                env={**os.environ, **(env or {})},
                                preexec_fn=die_with_parent_signal if die_with_parent else None)
    child = RoleProcess(url="", proc=proc, log=log)
    if not wait_ready:
        return child
    try:
        child.url = _wait_ready(proc, log, timeout)
    except BaseException:
        child.stop()
        raise
    return child


def _wait_ready(proc: subprocess.Popen, log: Path, timeout: float) -> str:
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[3:5]} exited with {proc.returncode}; log {log}:\n{log.read_text()[-3000:]}")
        if sel.select(timeout=0.5):
            url = ready_url(proc.stdout.readline())
            if url is not None:
                return url
    raise RuntimeError(f"{proc.args[3:5]} not ready after {timeout:.0f}s; log {log}:\n{log.read_text()[-3000:]}")


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on (host, port), inheritable, for uvicorn's `sockets=`; port 0 picks one."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP, not 0: asyncio disables Nagle only on sockets whose protocol says TCP; with 0, every
    # request after the first on a kept-alive connection waited ~40 ms for a delayed ACK.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def socket_url(sock: socket.socket, tls: bool = False) -> str:
    """The URL clients reach a bound socket at (IPv6 hosts in brackets)."""
    host, port = sock.getsockname()[:2]
    return f"{'https' if tls else 'http'}://{host if ':' not in host else f'[{host}]'}:{port}"


def print_ready(url: str) -> None:
    """The ready line `start_role` waits for: one JSON object on stdout, once the server listens."""
    print(json.dumps({"event": "ready", "url": url, "pid": os.getpid()}), flush=True)


def ready_url(line: str) -> str | None:
    """The URL a ready line announces; None for any other line of a child's stdout."""
    if not line.startswith("{"):
        return None
    event = json.loads(line)
    return event["url"] if event.get("event") == "ready" else None


def die_with_parent_signal() -> None:
    """In a forked child before exec: ask the kernel for SIGKILL when the parent thread dies."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:  # not Linux: the supervisor still stops its children on every normal exit
        pass


def process_start_time(pid: int) -> int | None:
    """Start time in clock ticks: with the pid, it names a process even after pid reuse."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


def pid_alive(pid: int, start_time: int | None) -> bool:
    """Whether the process that had `pid` (and, if given, that start time) still runs."""
    now = process_start_time(pid)
    return now is not None and (start_time is None or now == start_time)


OWNER_FILE = "owner.json"


def write_owner(path: Path, **fields: Any) -> None:
    """Record who owns a dir (a sandbox's, a replica's temp state), so a sweep can tell a dead owner's leftovers."""
    pid = os.getpid()
    data = {"owner_pid": pid, "owner_start": process_start_time(pid), **fields}
    tmp = path / (OWNER_FILE + ".tmp")
    tmp.write_text(json.dumps(data))
    tmp.replace(path / OWNER_FILE)


def read_owner(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads((path / OWNER_FILE).read_text())
    except (OSError, ValueError):
        return None
