"""A real router in front of stand-in replicas that drip or stall (issue 49, finding 5): every call the router
makes ends by a deadline, and one replica's slowness delays nobody else's scrape.

Regressions: a replica dripping its `/v1/loads` answer one byte per second held the scrape loop (another
replica answering 503 meanwhile stayed listed); a relayed call to a replica dripping its headers waited
as long as it dripped (httpx's timeout is per read); a stream that stalled between chunks was never cut.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from burstrl.protocol.process import RoleProcess
from burstrl.router.standin import Answer, StandInReplica
from tests.http_client import HTTP

from .test_router import start_router
from .test_router_hostile import replicas, scraped_again, wait_for

pytestmark = pytest.mark.slow  # real processes: `make test` runs it, `make test-fast` (<= 2 min) does not

SCRAPE_S, SCRAPE_DEADLINE_S = 0.2, 1.0
REQUEST_DEADLINE_S, STREAM_GAP_S = 6.0, 1.0  # the gap far below the deadline: a cut by the gap is the gap's
SLACK_S = 3.5  # what a busy shared machine may add; far below how long the drips below last
DRIP = Answer(body=json.dumps({"num_used_tokens": 0, "max_total_num_tokens": 100_000, "versions": ["base"],
                               "sessions": [], "pad": "x" * 200}).encode(), chunk_bytes=1, pause_s=1.0)
HEAD_DRIP = Answer(body=b'{"object": "list", "data": []}', head_pause_s=1.0)
SERVICE_GONE = Answer(status=503, body=b'{"error": {"message": "engine is not running", "code": 503}}')


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[tuple[RoleProcess, list[StandInReplica]]]:
    """A router with four stand-ins from `--replicas`, all in rotation."""
    standins = [StandInReplica() for _ in range(4)]
    router = start_router(tmp_path / "router", "--replicas", json.dumps([s.url for s in standins]),
                          "--scrape_s", str(SCRAPE_S), "--scrape_timeout_s", str(SCRAPE_DEADLINE_S),
                          "--request_timeout_s", str(REQUEST_DEADLINE_S), "--stream_gap_s", str(STREAM_GAP_S))
    try:
        wait_for("every replica in rotation", lambda: all(r["healthy"] for r in replicas(router).values()))
        yield router, standins
    finally:
        router.stop()
        for standin in standins:
            standin.close()


def test_regression_replicas_dripping_their_loads_delay_no_other_replicas_scrape(fleet) -> None:
    router, (body_drip, head_drip, gone, good) = fleet
    body_drip.loads, head_drip.loads = DRIP, HEAD_DRIP
    wait_for("both drippers scraped", lambda: body_drip.counts["loads"] > 1 and head_drip.counts["loads"] > 1)
    for _ in range(2):  # twice: the second time, the drippers' scrapes are timing out, not starting
        gone.scrape = SERVICE_GONE
        start = time.monotonic()
        wait_for("the replica answering 503 dropped", lambda: gone.url not in replicas(router))
        assert time.monotonic() - start < SCRAPE_S + SCRAPE_DEADLINE_S + SLACK_S
        gone.scrape = None
        wait_for("the replica back once it answers", lambda: replicas(router).get(gone.url, {}).get("healthy"))
    wait_for("both drippers out of rotation (each scrape ends by its deadline)",
             lambda: not any(replicas(router)[s.url]["healthy"] for s in (body_drip, head_drip)))
    wait_for("the good replica scraped 10 times meanwhile", scraped_again(good, 10))
    assert replicas(router)[good.url]["healthy"]


def _place_on(router: RoleProcess, standin: StandInReplica, others: list[StandInReplica]) -> str:
    """A session id placed on `standin` (the others out of rotation, answering 503, until it is)."""
    for other in others:
        other.scrape = SERVICE_GONE
    wait_for("only the chosen replica listed", lambda: set(replicas(router)) == {standin.url})
    r = HTTP.post(router.url + "/v1/assign", json={"session_id": "s", "version": "base"}, timeout=10)
    assert r.status_code == 200 and r.json()["url"] == standin.url, r.text
    return "s"


def test_regression_a_relayed_call_whose_headers_drip_ends_by_the_deadline(fleet) -> None:
    router, standins = fleet
    target = standins[0]
    sid = _place_on(router, target, standins[1:])
    target.call = Answer(body=b'{"choices": [{"index": 0, "text": "ok"}]}', head_pause_s=1.0)  # ~2 minutes of head
    start = time.monotonic()
    r = HTTP.post(router.url + "/v1/completions", json={"model": "base", "prompt": "x", "session_id": sid}, timeout=60)
    took = time.monotonic() - start
    assert r.status_code == 504 and "timed out" in r.json()["error"]["message"], r.text[:300]
    assert took < REQUEST_DEADLINE_S + SLACK_S
    target.call = None
    r = HTTP.post(router.url + "/v1/completions", json={"model": "base", "prompt": "x", "session_id": sid}, timeout=30)
    assert r.status_code == 200, r.text[:300]  # the replica was not dropped for being slow once


def test_regression_a_stream_stalled_between_chunks_is_cut_within_the_gap(fleet) -> None:
    router, standins = fleet
    target = standins[0]
    sid = _place_on(router, target, standins[1:])
    first = b'data: {"choices": [{"index": 0, "text": "a"}]}\n\n'
    target.call = Answer(body=lambda: _stalling(first, target), content_type="text/event-stream")
    body = {"model": "base", "prompt": "x", "session_id": sid, "stream": True}
    start = time.monotonic()
    with HTTP.stream("POST", router.url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        received = b"".join(r.iter_bytes())
    assert time.monotonic() - start < STREAM_GAP_S + SLACK_S
    assert received.startswith(first)
    error = json.loads(received[len(first):].decode().removeprefix("data: "))["error"]
    assert error["code"] == 504 and "stream" in error["message"], error


def _stalling(first: bytes, standin: StandInReplica) -> Iterator[bytes]:
    """One event, then nothing for a minute (or until the stand-in closes)."""
    yield first
    standin.stopped.wait(60)
