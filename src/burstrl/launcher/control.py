"""How `burstrl scale` talks to a live `burstrl run`: files in the run directory.

Why files and not a socket: the launcher already owns the run directory, a file survives either
side restarting, and it needs no port or token. The launcher writes `launcher.json` (its pid and
the router URL) while it runs; `burstrl scale` writes `control/scale.json` atomically; the
launcher applies it and answers in `control/scale.ack.json`.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from burstrl.atomic import write_text


class ControlError(RuntimeError):
    """No live run to control, or it did not answer; the message says which."""


def _write(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text(path, json.dumps(data))


def write_launcher_info(run_dir: Path, router: str) -> None:
    _write(run_dir / "launcher.json", {"pid": os.getpid(), "router": router, "started": time.time()})


def clear_launcher_info(run_dir: Path) -> None:
    (run_dir / "launcher.json").unlink(missing_ok=True)


def live_launcher(run_dir: Path) -> dict[str, Any]:
    """The running launcher's info, or ControlError if no launcher runs this directory."""
    path = run_dir / "launcher.json"
    if not path.exists():
        raise ControlError(f"{run_dir}: no run is in progress there (no launcher.json)")
    info = json.loads(path.read_text())
    try:
        os.kill(int(info["pid"]), 0)
    except ProcessLookupError:
        raise ControlError(f"{run_dir}: the launcher (pid {info['pid']}) is gone") from None
    except PermissionError:
        pass  # alive, owned by another user
    return info


def request_scale(run_dir: Path, replicas: int, timeout_s: float = 15.0) -> dict[str, Any]:
    """Ask the run for `replicas` replicas in all; returns the launcher's answer."""
    live_launcher(run_dir)
    request = {"id": f"{os.getpid()}-{time.time_ns()}", "replicas": replicas}
    ack = run_dir / "control" / "scale.ack.json"
    _write(run_dir / "control" / "scale.json", request)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if ack.exists():
            answer = json.loads(ack.read_text())
            if answer.get("id") == request["id"]:
                return answer
        time.sleep(0.1)
    raise ControlError(f"{run_dir}: the launcher did not answer the scale request in {timeout_s:.0f} s")


def take_scale_request(run_dir: Path) -> dict[str, Any] | None:
    """The pending scale request, removed from the queue (the launcher's side)."""
    path = run_dir / "control" / "scale.json"
    try:
        request = json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    path.unlink(missing_ok=True)
    return request


def answer_scale(run_dir: Path, request: dict[str, Any], answer: dict[str, Any]) -> None:
    _write(run_dir / "control" / "scale.ack.json", {"id": request.get("id"), **answer})


def write_secret(path: Path, value: str) -> None:
    """A secret file only its owner may read (created with mode 600, never world-readable for a moment)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(value + "\n")
    os.chmod(path, 0o600)
