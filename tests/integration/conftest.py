"""Real replica processes on loopback for the integration tests."""

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

import httpx
import pytest

ADMIN_TOKEN = "test-admin-token"


@dataclass
class Server:
    url: str
    proc: subprocess.Popen
    log: Path

    def admin(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {ADMIN_TOKEN}"}

    def get(self, path: str) -> dict:
        r = httpx.get(self.url + path, timeout=30)
        r.raise_for_status()
        return r.json()

    def metric(self, name: str) -> float:
        text = httpx.get(self.url + "/metrics", timeout=30).text
        for line in text.splitlines():
            if line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
        raise KeyError(name)


def start_server(model_dir: Path, workdir: Path, *overrides: str) -> Server:
    """Start `burstrl serve` on a free port in its own process group; wait for its ready line."""
    workdir.mkdir(parents=True, exist_ok=True)
    log = workdir / "serve.log"
    cmd = [sys.executable, "-c", "from burstrl.cli import main; main()", "serve",
           "--model", str(model_dir), "--port", "0", "--server.admin_token", ADMIN_TOKEN,
           "--server.state_dir", str(workdir / "state"), "--engine.num_threads", "1", *overrides]
    with open(log, "w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, start_new_session=True)
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"replica exited {proc.returncode}: {log.read_text()[-3000:]}")
        if sel.select(timeout=0.5):
            line = proc.stdout.readline()
            if line.startswith("{"):
                event = json.loads(line)
                if event.get("event") == "ready":
                    return Server(url=event["url"], proc=proc, log=log)
    stop_server(proc)
    raise RuntimeError(f"replica not ready in time: {log.read_text()[-3000:]}")


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.fixture(scope="session")
def adapters(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two random LoRA versions of the tiny model, in PEFT format."""
    from burstrl.model.lora import make_random_adapter

    root = tmp_path_factory.mktemp("adapters")
    return {name: make_random_adapter(tiny_model_dir, root / name, seed=seed)
            for name, seed in (("policy-v1", 1), ("policy-v2", 2))}


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    srv = start_server(tiny_model_dir, tmp_path_factory.mktemp("replica"))
    yield srv
    stop_server(srv.proc)
