"""SWE-ReX's daemon (`swerex-remote`), measured the same way as burstrl's sandboxd, for benchmarks/sandbox.py.

SWE-ReX is installed into its own venv (`.cache/swerex-venv`, made on first use with
`pip install swe-rex`), never into burstrl's, and driven over plain HTTP so both daemons are timed
by the same client code: ready time after start, one-shot command latency (`POST /execute`), and a
command in a bash session (`POST /run_in_session`).
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
VENV = REPO / ".cache" / "swerex-venv"
VERSION = "1.4.0"


def ensure_swerex() -> Path:
    """The `swerex-remote` executable, installing swe-rex into its own venv if needed."""
    exe = VENV / "bin" / "swerex-remote"
    if not exe.exists():
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
        subprocess.run([str(VENV / "bin" / "pip"), "install", "-q", f"swe-rex=={VERSION}"], check=True)
    return exe


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(exe: Path) -> tuple[subprocess.Popen, str, str, float]:
    """Start swerex-remote; (process, url, token, seconds from spawn to the first answered /is_alive)."""
    token, port = secrets.token_hex(8), _free_port()
    t0 = time.perf_counter()
    proc = subprocess.Popen([str(exe), "--host", "127.0.0.1", "--port", str(port), "--auth-token", token],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    while True:
        try:
            if httpx.get(url + "/is_alive", headers={"X-API-Key": token}, timeout=1).status_code == 200:
                return proc, url, token, time.perf_counter() - t0
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.perf_counter() - t0 > 60:
            raise RuntimeError("swerex-remote did not start")
        time.sleep(0.005)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def measure(n: int) -> dict:
    """Ready time (median of 5 starts), one-shot and in-session command latency (p50/p99 of n)."""
    exe = ensure_swerex()
    readies = []
    for _ in range(5):
        proc, url, token, ready = start(exe)
        readies.append(ready)
        stop(proc)
    proc, url, token, _ = start(exe)
    headers = {"X-API-Key": token}
    try:
        with httpx.Client(base_url=url, headers=headers, timeout=30) as c:
            one_shot = _times(n, lambda: c.post("/execute", json={"command": "true", "shell": True}))
            c.post("/create_session", json={"session_type": "bash", "session": "bench"}).raise_for_status()
            in_session = _times(n, lambda: c.post("/run_in_session", json={
                "action_type": "bash", "session": "bench", "command": "true"}))
    finally:
        stop(proc)
    return {"version": VERSION, "ready_s_median": round(statistics.median(readies), 4),
            "one_shot_ms": one_shot, "in_session_ms": in_session}


def _times(n: int, call) -> dict:
    call().raise_for_status()  # warm
    out = []
    for _ in range(n):
        t = time.perf_counter()
        call().raise_for_status()
        out.append((time.perf_counter() - t) * 1000)
    out.sort()
    return {"p50": round(out[len(out) // 2], 3), "p99": round(out[min(len(out) - 1, int(len(out) * 0.99))], 3)}


if __name__ == "__main__":
    print(measure(int(sys.argv[1]) if len(sys.argv) > 1 else 200))
