"""The shared fleet's autoscaler on real processes (`burstrl fleet up --autoscale.enabled true`), issue 51.

One reserved replica with one session place (`router.max_sessions_per_replica 1`), on-demand 0..1:
a tenant opens a second session while the first holds the place, so it waits at the router; the
fleet sees it waiting for `autoscale.interval_s`, adds an on-demand replica, and the session is
admitted there. Both sessions released, the fleet is idle and drains the replica again.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
from pathlib import Path

import httpx
import pytest

from .conftest import events, start_fleet, wait_until
from .test_shared_fleet import token

pytestmark = pytest.mark.slow


def start_autoscaled_fleet(fleet_dir: Path, model: Path) -> subprocess.Popen:
    return start_fleet(fleet_dir, model, "--fleet.reserved", "1", "--fleet.on_demand", "0",
                       "--router.max_sessions_per_replica", "1", "--autoscale.enabled", "true",
                       "--autoscale.max_on_demand", "1", "--autoscale.interval_s", "2")


def chat(router: str, bearer: str, sid: str) -> httpx.Response:
    return httpx.post(f"{router}/v1/chat/completions", timeout=120, headers={"Authorization": f"Bearer {bearer}"},
                      json={"model": "latest", "messages": [{"role": "user", "content": "a"}], "max_tokens": 2,
                            "session_id": sid})


def autoscaled(fleet_dir: Path) -> list[dict]:
    return [e for e in events(fleet_dir, "scale") if "autoscale" in e["detail"]]


def test_the_fleet_adds_an_on_demand_replica_for_waiting_sessions_and_drains_it_when_idle(
        tmp_path: Path, tiny_model_dir: Path) -> None:
    fleet_dir = tmp_path / "fleet"
    fleet = start_autoscaled_fleet(fleet_dir, tiny_model_dir)
    try:
        wait_until(lambda: (fleet_dir / "fleet.json").exists(), 240, "the fleet's ready file", fleet, fleet_dir)
        router = json.loads((fleet_dir / "fleet.json").read_text())["router"]
        bearer = token(fleet_dir, "run-a")
        first = chat(router, bearer, "s1")
        assert first.status_code == 200, first.text
        admission = httpx.get(f"{router}/v1/stats", timeout=5).json()["admission"]
        assert admission["places"] == 1 and admission["live"] == 1, admission
        answers: dict[str, httpx.Response] = {}
        second = threading.Thread(target=lambda: answers.setdefault("s2", chat(router, bearer, "s2")), daemon=True)
        second.start()  # no place left: it waits at the router until the fleet grows
        up = wait_until(lambda: autoscaled(fleet_dir), 60, "an autoscale decision", fleet, fleet_dir)
        assert "0 -> 1" in up[0]["detail"] and "waiting" in up[0]["detail"], up
        second.join(timeout=150)
        assert "s2" in answers and answers["s2"].status_code == 200, {k: v.text for k, v in answers.items()}
        wait_until(lambda: [e for e in events(fleet_dir, "replica_started") if e["pool"] == "on_demand"], 30,
                   "the on-demand replica's start event", fleet, fleet_dir)  # written just after it registers
        for sid in ("s1", "s2"):  # both sessions end: every tenant is idle
            gone = httpx.delete(f"{router}/v1/traces/{sid}", timeout=30, headers={"Authorization": f"Bearer {bearer}"})
            assert gone.status_code == 200, gone.text
        down = wait_until(lambda: [e for e in autoscaled(fleet_dir) if "1 -> 0" in e["detail"]], 60,
                          "the idle fleet to scale down", fleet, fleet_dir)
        assert "fit in one replica fewer" in down[0]["detail"], down
        wait_until(lambda: [e for e in events(fleet_dir, "replica_stopped") if e["pool"] == "on_demand"], 60,
                   "the on-demand replica to drain and stop", fleet, fleet_dir)
    finally:
        if fleet.poll() is None:
            os.killpg(fleet.pid, signal.SIGTERM)
        code = fleet.wait(timeout=120)
    assert code == 130, (tmp_path / "fleet.out").read_text()[-3000:]
