"""Start a role (replica, router) as a child process and stop it (its whole process group).

Used by tests, examples and the local provider: the child binds its own port (`--port 0` works)
and prints one JSON ready line with its URL, which is how the parent learns where it listens.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass
class ReplicaProcess:
    """A running `burstrl serve` child; `stop()` kills its process group."""

    url: str
    proc: subprocess.Popen
    log: Path

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


def start_replica(model_dir: str | Path, workdir: str | Path, *overrides: str,
                  timeout: float = 120.0) -> ReplicaProcess:
    """Run `burstrl serve --model DIR --port 0 ...overrides`; return once it is listening.

    stderr goes to `workdir/serve.log`; a child that dies or stays silent past `timeout` raises
    RuntimeError quoting the log's tail.
    """
    return start_role(["serve", "--model", str(model_dir), "--port", "0", *overrides], workdir, "serve.log",
                      timeout)


def start_router(workdir: str | Path, *overrides: str, timeout: float = 60.0) -> ReplicaProcess:
    """Run `burstrl route serve --port 0 ...overrides` (stderr to `workdir/router.log`)."""
    return start_role(["route", "serve", "--port", "0", *overrides], workdir, "router.log", timeout)


def start_role(args: list[str], workdir: str | Path, log_name: str, timeout: float) -> ReplicaProcess:
    """Run `burstrl ARGS` in its own process group; return once it prints its JSON ready line."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    log = workdir / log_name
    cmd = [sys.executable, "-c", "from burstrl.cli import main; main()", *args]
    with open(log, "w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, start_new_session=True)
    child = ReplicaProcess(url="", proc=proc, log=log)
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
            line = proc.stdout.readline()
            if line.startswith("{"):
                event = json.loads(line)
                if event.get("event") == "ready":
                    return event["url"]
    raise RuntimeError(f"{proc.args[3:5]} not ready after {timeout:.0f}s; log {log}:\n{log.read_text()[-3000:]}")
