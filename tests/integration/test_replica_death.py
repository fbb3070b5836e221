"""A replica whose engine died leaves the router's rotation at the next scrape, then exits.

Before issue 14 a dead engine kept answering `/v1/loads` and `/v1/models` with 200, so the router
kept placing sessions there (10 of 20 new sessions went to the dead replica). No request can kill
the engine any more, so the test reaches that path with `BURSTRL_CRASH=engine@N`.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from burstrl.protocol import process
from tests.http_client import HTTP
from tests.waiting import wait_for

from .conftest import ADMIN_TOKEN, start_server, stop_server

TOKEN = "death-cluster-token"
pytestmark = pytest.mark.slow


def test_a_dead_engine_leaves_rotation_and_the_process_exits(tiny_model_dir: Path, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    good = start_server(tiny_model_dir, tmp_path / "good", "--server.cluster_token", TOKEN)
    monkeypatch.setenv("BURSTRL_CRASH", "engine@1")
    doomed = start_server(tiny_model_dir, tmp_path / "doomed", "--server.cluster_token", TOKEN,
                          "--server.dead_engine_exit_s", "10")
    monkeypatch.delenv("BURSTRL_CRASH")
    urls = f'["{good.url}", "{doomed.url}"]'
    # health_failures is huge: only the replica's own 503 (not missed scrapes) can drop it in time
    router = process.start_router(tmp_path / "router", "--cluster_token", TOKEN, "--replicas", urls,
                                  "--scrape_s", "0.5", "--health_failures", "1000")
    try:
        listed = lambda: {r["url"] for r in HTTP.get(router.url + "/v1/replicas", timeout=10).json()["replicas"]}
        assert listed() == {good.url, doomed.url}
        r = HTTP.post(doomed.url + "/v1/completions", json={"model": "base", "prompt": [5, 6], "max_tokens": 2},
                      timeout=60)
        assert r.status_code == 200  # the one request before the injected crash
        wait_for(lambda: HTTP.get(doomed.url + "/health", timeout=10).status_code == 503, 60, "health 503")
        for path in ("/v1/loads", "/v1/models"):
            r = HTTP.get(doomed.url + path, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=10)
            assert r.status_code == 503 and "engine is not running" in r.json()["error"]["message"]
        wait_for(lambda: listed() == {good.url}, 20, "the router to drop the dead replica")
        for i in range(20):
            r = HTTP.post(router.url + "/v1/completions", timeout=60,
                          json={"model": "base", "prompt": [5, 6, i], "max_tokens": 2, "session_id": f"after-{i}"})
            assert r.status_code == 200, r.text
        wait_for(lambda: doomed.replica.proc.poll() is not None, 90, "the replica process to exit")
        assert doomed.replica.proc.returncode != 0
        assert "engine died" in doomed.replica.log.read_text()
    finally:
        router.stop()
        stop_server(doomed)
        stop_server(good)


def test_a_frozen_replica_leaves_rotation_and_comes_back_when_it_answers(tiny_model_dir: Path,
                                                                         tmp_path: Path) -> None:
    """A replica that answers no scrape (SIGSTOP: busy, or a router starved on a loaded machine)
    stops getting sessions, and is back when it answers. Before, two missed scrapes dropped it for
    good: a loaded CI machine lost all three replicas of a run at once and the run stalled on 503s."""
    good = start_server(tiny_model_dir, tmp_path / "good", "--server.cluster_token", TOKEN)
    frozen = start_server(tiny_model_dir, tmp_path / "frozen", "--server.cluster_token", TOKEN)
    urls = f'["{good.url}", "{frozen.url}"]'
    router = process.start_router(tmp_path / "router", "--cluster_token", TOKEN, "--replicas", urls,
                                  "--scrape_s", "0.5", "--health_failures", "2")
    healthy = lambda: {r["url"]: r["healthy"] for r in
                       HTTP.get(router.url + "/v1/replicas", timeout=30).json()["replicas"]}

    def homed_on_frozen(prefix: str, n: int) -> int:
        before = {r["url"]: r["sessions"] for r in HTTP.get(router.url + "/v1/stats", timeout=30).json()["replicas"]}
        for i in range(n):
            r = HTTP.post(router.url + "/v1/completions", timeout=120,
                          json={"model": "base", "prompt": [5, 6, i], "max_tokens": 2, "session_id": f"{prefix}-{i}"})
            assert r.status_code == 200, r.text
        after = {r["url"]: r["sessions"] for r in HTTP.get(router.url + "/v1/stats", timeout=30).json()["replicas"]}
        return after.get(frozen.url, 0) - before.get(frozen.url, 0)

    try:
        wait_for(lambda: healthy() == {good.url: True, frozen.url: True}, 60, "both replicas in rotation")
        os.kill(frozen.replica.proc.pid, signal.SIGSTOP)
        try:
            wait_for(lambda: healthy() == {good.url: True, frozen.url: False}, 60, "the frozen one out of rotation")
            assert homed_on_frozen("frozen", 10) == 0  # every call answered (none waits on the frozen one)
        finally:
            os.kill(frozen.replica.proc.pid, signal.SIGCONT)
        wait_for(lambda: healthy() == {good.url: True, frozen.url: True}, 60, "the frozen one back in rotation")
        assert homed_on_frozen("thawed", 20) > 0
        stats = HTTP.get(router.url + "/v1/stats", timeout=30).json()["totals"]
        assert stats["replicas_unanswered"] >= 1 and stats["replicas_dropped"] == 0
        assert "back in rotation" in router.log.read_text()
    finally:
        router.stop()
        stop_server(frozen)
        stop_server(good)
