"""SWE-ReX's server, started and driven for benchmarks/sandbox.py by the same client as burstrl's daemon.

SWE-ReX (swe-rex 1.4.0) is installed into its own venv (`.cache/swerex-venv`, made on first use
with `pip install swe-rex==1.4.0`), never into burstrl's. It runs unsandboxed on the host: it is a
daemon (its FastAPI app under uvicorn, `LocalRuntime` behind it), not a sandbox, so its "start"
is daemon process spawn -> first command answered.

Transport: `swerex-remote` only binds TCP, so for the unix-socket figures the same app is run the
way `swerex-remote` runs it (`swerex.server.AUTH_TOKEN = token; uvicorn.run(swerex.server.app,
...)`) but with uvicorn's `uds=PATH` instead of host/port; for the TCP figures the real
`swerex-remote --host 127.0.0.1 --port P` is run. Both are driven by `sandbox_client.BenchClient`
(stdlib `http.client`, keep-alive), exactly as burstrl's daemon is.
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from sandbox_client import BenchClient

REPO = Path(__file__).resolve().parents[1]
VENV = REPO / ".cache" / "swerex-venv"
VERSION = "1.4.0"

# swerex.server.main() minus argparse, on a unix socket (uvicorn's `uds`).
_UDS_LAUNCH = ("import sys, uvicorn, swerex.server as s\n"
               "s.AUTH_TOKEN = sys.argv[1]\n"
               "uvicorn.run(s.app, uds=sys.argv[2])\n")


def ensure_swerex() -> Path:
    """The venv's python, installing swe-rex into its own venv if needed."""
    exe = VENV / "bin" / "swerex-remote"
    if not exe.exists():
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
        subprocess.run([str(VENV / "bin" / "pip"), "install", "-q", f"swe-rex=={VERSION}"], check=True)
    return VENV / "bin" / "python"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SwerexServer:
    """One SWE-ReX server process and a `BenchClient` to it (`uds=PATH`, or TCP on a free port)."""

    def __init__(self, uds: str | None = None):
        python = ensure_swerex()
        self.token = secrets.token_hex(8)
        if uds is not None:
            if os.path.exists(uds):
                os.unlink(uds)
            self.argv = [str(python), "-c", _UDS_LAUNCH, self.token, uds]
            self.client = BenchClient(unix=uds, headers={"X-API-Key": self.token})
        else:
            port = _free_port()
            self.argv = [str(VENV / "bin" / "swerex-remote"), "--host", "127.0.0.1", "--port", str(port),
                         "--auth-token", self.token]
            self.client = BenchClient(tcp=("127.0.0.1", port), headers={"X-API-Key": self.token})
        self.proc: subprocess.Popen | None = None

    def start(self) -> float:
        """Spawn, connect as soon as it listens, run `true` once: seconds from spawn to that answer."""
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(self.argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     start_new_session=True)
        self.client.connect_waiting(lambda: self.proc.poll() is None)
        execute_true(self.client)
        return time.perf_counter() - t0

    def open_session(self) -> None:
        self.client.post("/create_session", {"session_type": "bash", "session": "bench"})

    def stop(self) -> None:
        self.client.close()
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def execute_true(c: BenchClient) -> None:
    """SWE-ReX's one-shot command: `POST /execute` (a subprocess per call), argv, no shell."""
    out = c.post("/execute", {"command": ["true"], "shell": False})
    assert out["exit_code"] == 0, out


def session_true(c: BenchClient) -> None:
    """A command in SWE-ReX's bash session (`POST /run_in_session`: written to a pexpect'd bash)."""
    out = c.post("/run_in_session", {"action_type": "bash", "session": "bench", "command": "true"})
    assert out.get("exit_code") in (0, None), out


if __name__ == "__main__":
    s = SwerexServer(uds="/tmp/swerex-try.sock")
    print("start s", s.start())
    s.open_session()
    session_true(s.client)
    s.stop()
