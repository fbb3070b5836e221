"""Starting a sandbox's entry process and waiting for its daemon's ready line, with what the
runtime and the daemon print kept in a bounded host log.

Why a module of its own: both backends start their runtime (bwrap, `runc run`, runsc) the same
way, and the two hazards of doing so are easy to get wrong: a process started from a thread that
ends is killed with it (PR_SET_PDEATHSIG; hence one long-lived spawner thread), and output from
inside a sandbox must never grow a host file without bound or block the daemon on a full pipe.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import selectors
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any


class _Spawner:
    """Starts every sandbox process from one thread that lives as long as the interpreter.

    Why: PR_SET_PDEATHSIG (bwrap's --die-with-parent) fires when the *thread* that forked the
    child exits, not the process; a sandbox started from a pool worker thread would be killed
    when that thread ends. Measured here: bwrap started from a thread that exits 0.3 s later dies.
    """

    def __init__(self) -> None:
        self._jobs: queue.Queue[tuple[Callable[[], Any], queue.Queue[Any]]] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def call(self, fn: Callable[[], Any]) -> Any:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="sandbox-spawner", daemon=True)
                self._thread.start()
        reply: queue.Queue[Any] = queue.Queue(maxsize=1)
        self._jobs.put((fn, reply))
        ok, value = reply.get()
        if not ok:
            raise value
        return value

    def _loop(self) -> None:
        while True:
            fn, reply = self._jobs.get()
            try:
                reply.put((True, fn()))
            except BaseException as exc:  # handed to the caller, who raises it
                reply.put((False, exc))


spawner = _Spawner()


def spawn(argv: list[str], env: dict[str, str], log: Path, pass_fds: Sequence[int] = (),
          stdin: int | None = None) -> subprocess.Popen[bytes]:
    """Popen from the long-lived spawner thread, in a new process group, stdout and stderr on one
    pipe that `wait_ready` reads: the harness copies what comes out into `log`, bounded
    (`DaemonLog`), and no host file is ever the sandbox's to write (`log` was its stderr before).
    `stdin`: an fd the entry process reads first (`subids.map_ids`' go line), else /dev/null."""
    log.touch()
    def start() -> subprocess.Popen[bytes]:
        return subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL if stdin is None else stdin,
                                stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, start_new_session=True, pass_fds=tuple(pass_fds))
    return spawner.call(start)


# What the harness keeps of one sandbox's output (the runtime's messages, the daemon's stderr).
DAEMON_LOG_MAX = 1 << 20


class DaemonLog:
    """A sandbox's log file that takes at most `limit` bytes; the rest is counted and dropped, so
    output from inside the sandbox never grows a host file without bound."""

    def __init__(self, path: Path, limit: int = DAEMON_LOG_MAX) -> None:
        self.path, self.left, self.dropped = path, limit, 0

    def write(self, data: bytes) -> None:
        kept = data[:max(self.left, 0)]
        if kept:
            with open(self.path, "ab") as f:
                f.write(kept)
        self.left -= len(kept)
        self.dropped += len(data) - len(kept)

    def close(self) -> None:
        if self.dropped:
            with open(self.path, "ab") as f:
                f.write(f"\n[burstrl: {self.dropped} more bytes of sandbox output dropped]\n".encode())
            self.dropped = 0


def wait_ready(proc: subprocess.Popen[bytes], timeout: float, log: Path) -> dict[str, Any]:
    """Read the runtime's output until the daemon's `{"event": "ready"}` line (other lines, a
    runtime's warnings, go to `log`), then drain the rest to `log` in a thread that ends when the
    sandbox does (so a chatty daemon never blocks on a full pipe)."""
    assert proc.stdout is not None
    out = DaemonLog(log)
    deadline = time.monotonic() + timeout
    buf = b""
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        while True:
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                if _is_ready(line):
                    threading.Thread(target=_drain, args=(proc, buf, out), name="sandbox-stdout",
                                     daemon=True).start()
                    return json.loads(line)
                out.write(line + b"\n")
            if not _readable(sel, deadline):
                out.write(buf)
                raise TimeoutError(f"sandbox daemon not ready after {timeout:.1f}s; {log_tail(log)}")
            buf = _read_more(proc, buf, out)


def _is_ready(line: bytes) -> bool:
    with contextlib.suppress(ValueError):
        event = json.loads(line)
        return isinstance(event, dict) and event.get("event") == "ready"
    return False


def _readable(sel: selectors.BaseSelector, deadline: float) -> bool:
    left = deadline - time.monotonic()
    return left > 0 and bool(sel.select(left))


def _read_more(proc: subprocess.Popen[bytes], buf: bytes, out: DaemonLog) -> bytes:
    """`buf` and what the runtime wrote next; raises if it ended (what it said is in the log, and
    its tail in the error)."""
    assert proc.stdout is not None
    chunk = os.read(proc.stdout.fileno(), 65536)
    if not chunk:
        out.write(buf)
        raise RuntimeError(f"sandbox exited before it was ready (rc={proc.wait()}); {log_tail(out.path)}")
    if len(buf) > DAEMON_LOG_MAX:  # a line that long is not the ready line: keep what the log takes
        out.write(buf)
        buf = b""
    return buf + chunk


def _drain(proc: subprocess.Popen[bytes], first: bytes, out: DaemonLog) -> None:
    assert proc.stdout is not None
    out.write(first)
    while chunk := proc.stdout.read1(65536):
        out.write(chunk)
    out.close()
    proc.stdout.close()


def log_tail(log: Path, n: int = 2000) -> str:
    try:
        text = log.read_bytes()[-n:].decode(errors="replace").strip()
    except OSError:
        return "no log"
    return f"log tail: {text}" if text else "empty log"


def kill_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL the runtime's process group and reap it; the pid namespace takes the rest."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, 9)
        except ProcessLookupError:
            pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
