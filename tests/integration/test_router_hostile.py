"""A real router (`burstrl route serve`) in front of stand-in replicas that answer as broken or hostile
replicas would (issue 36): its scrapes and relays keep working for the healthy replicas.

Regressions, each against what the finding did: a session of 10**400 tokens failed every placement;
`1e999` or JSON nested 100k deep ended the scrape loop; a replica dripping its load answer a byte at a
time held every scrape forever; a `--replicas` replica once dropped never came back; a 200 MB answer
was read whole; a stream event with no blank line was buffered whole.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from burstrl.protocol.process import RoleProcess
from burstrl.router.standin import Answer, StandInReplica
from tests.http_client import HTTP

from .test_router import AUTH, start_router

pytestmark = pytest.mark.slow  # real processes: `make test` runs it, `make test-fast` (<= 2 min) does not

DEADLINE_S = 30.0  # generous: the machine is shared and busy


def wait_for(what: str, ok: Callable[[], bool], timeout: float = DEADLINE_S) -> None:
    deadline = time.monotonic() + timeout
    while not ok():
        assert time.monotonic() < deadline, f"timed out waiting for: {what}"
        time.sleep(0.02)


def scraped_again(replica: StandInReplica, times: int = 2) -> Callable[[], bool]:
    """True once `times` more scrapes reached the replica: the one before the last was fully handled
    (each replica's scrapes run one after the other)."""
    start = replica.counts["loads"]
    return lambda: replica.counts["loads"] >= start + times


def replicas(router: RoleProcess) -> dict[str, dict]:
    return {r["url"]: r for r in HTTP.get(router.url + "/v1/replicas", timeout=10).json()["replicas"]}


def assign(router: RoleProcess, sid: str) -> str:
    r = HTTP.post(router.url + "/v1/assign", json={"session_id": sid, "version": "base"}, timeout=10)
    assert r.status_code == 200, r.text
    return r.json()["url"]


def totals(router: RoleProcess) -> dict:
    return HTTP.get(router.url + "/v1/stats", timeout=10).json()["totals"]


@pytest.fixture
def pair(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[tuple[RoleProcess, StandInReplica, StandInReplica]]:
    """A router with two stand-ins given with `--replicas` (good, odd); more overrides as the indirect parameter."""
    good, odd = StandInReplica(), StandInReplica()
    router = start_router(tmp_path / "router", "--replicas", json.dumps([good.url, odd.url]), "--scrape_s", "0.1",
                          "--scrape_timeout_s", "1", "--request_timeout_s", "30", *getattr(request, "param", ()))
    try:
        wait_for("both replicas in rotation", lambda: all(r["healthy"] for r in replicas(router).values()))
        yield router, good, odd
    finally:
        router.stop()
        good.close()
        odd.close()


def loads_with(**fields: object) -> Answer:
    body = {"num_used_tokens": 0, "max_total_num_tokens": 100_000, "versions": ["base"], "sessions": [], **fields}
    return Answer(body=json.dumps(body).encode())


def test_regression_a_session_of_10_400_tokens_does_not_fail_placements(pair) -> None:
    router, good, odd = pair
    odd.loads = loads_with(sessions=[{"session_id": "huge", "tokens": 10**400}])
    wait_for("two scrapes of the odd replica", scraped_again(odd))
    assert {assign(router, f"new-{i}") for i in range(20)} == {good.url}  # was: 500 for every one
    entry = replicas(router)[odd.url]
    assert not entry["healthy"] and "sessions[0].tokens" in entry["bad_reason"]
    assert totals(router)["scrapes_rejected"] >= 1
    odd.loads = None
    wait_for("the odd replica back once it answers sanely", lambda: replicas(router)[odd.url]["healthy"])
    assert replicas(router)[odd.url]["bad_reason"] == ""


@pytest.mark.parametrize("hostile", [b'{"num_used_tokens": 1e999, "versions": ["base"]}', b"[" * 100_000],
                         ids=["infinite", "nested"])
def test_regression_an_answer_that_raised_no_longer_ends_the_scrape_loop(pair, hostile: bytes) -> None:
    router, good, odd = pair
    odd.loads = Answer(body=hostile)
    wait_for("the odd replica scraped on after its answer", scraped_again(odd, 3))  # was: the loop ended
    assert "num_used_tokens" in replicas(router)[odd.url]["bad_reason"] or b"[" in hostile
    good.close()  # a dead replica must still leave rotation: the loop goes on for every replica
    wait_for("the dead replica out of rotation", lambda: not replicas(router)[good.url]["healthy"])
    odd.loads = None
    wait_for("the odd replica back", lambda: replicas(router)[odd.url]["healthy"])
    assert assign(router, "after") == odd.url


def test_regression_a_dripping_replica_holds_neither_the_others_nor_itself(pair) -> None:
    router, good, odd = pair
    sane = json.dumps({"num_used_tokens": 0, "max_total_num_tokens": 100_000, "versions": ["base"],
                       "sessions": [], "pad": "x" * 200}).encode()
    odd.loads = Answer(body=sane, chunk_bytes=1, pause_s=0.5)  # ~2 minutes for the whole answer
    wait_for("the dripping replica out of rotation (total deadline 1 s)", lambda: not replicas(router)[odd.url]["healthy"])
    wait_for("the good replica scraped 10 times meanwhile", scraped_again(good, 10))  # was: the round never ended
    assert {assign(router, f"d-{i}") for i in range(10)} == {good.url}


def test_regression_a_dropped_replica_from_the_command_line_comes_back(pair) -> None:
    router, good, odd = pair
    odd.scrape = Answer(status=503, body=b'{"error": {"message": "engine is not running", "code": 503}}')
    wait_for("the replica whose engine died dropped", lambda: odd.url not in replicas(router))
    odd.scrape = None
    wait_for("the replica registered again once it answers",  # was: never scraped again
             lambda: replicas(router).get(odd.url, {}).get("healthy", False))
    assert totals(router)["replicas_readded"] >= 1
    assert HTTP.delete(router.url + "/v1/replicas", params={"url": odd.url}, headers=AUTH, timeout=10).status_code == 200
    before = odd.counts["loads"]
    wait_for("the good replica scraped 5 times", scraped_again(good, 5))
    assert odd.url not in replicas(router) and odd.counts["loads"] <= before + 1  # deregistered: left alone


def peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM")


@pytest.mark.parametrize("pair", [("--max_answer_bytes", str(1 << 20))], indirect=True, ids=["cap"])
def test_regression_a_200_mb_answer_is_a_502_naming_the_cap(pair) -> None:
    router, good, odd = pair
    for standin in (good, odd):  # chunked (length unknown) and with a content-length over the cap
        standin.call = Answer(body=lambda: (b"x" * (1 << 20) for _ in range(200)))
    odd.call = Answer(body=b"x" * (2 << 20))
    peak = peak_rss_mb(router.proc.pid)
    for i in range(4):
        r = HTTP.post(router.url + "/v1/completions", json={"model": "base", "prompt": "x", "session_id": f"b{i}"},
                      timeout=60)
        assert r.status_code == 502, r.text[:200]  # was: 200 and the whole body, the router ~600 MB larger
        assert "max_answer_bytes" in r.json()["error"]["message"]
    assert peak_rss_mb(router.proc.pid) - peak < 64
    assert totals(router)["answers_refused"] == 4
    good.call = odd.call = None
    r = HTTP.post(router.url + "/v1/completions", json={"model": "base", "prompt": "x", "session_id": "b0"}, timeout=30)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "ok"


@pytest.mark.parametrize("pair", [("--max_event_bytes", str(64 << 10))], indirect=True, ids=["cap"])
def test_regression_a_stream_event_without_a_blank_line_is_cut_at_the_cap(pair) -> None:
    router, good, odd = pair
    first = b'data: {"choices": [{"index": 0, "text": "a"}]}\n\n'
    endless = Answer(body=lambda: iter([first, b"data: ", *(b"x" * (1 << 20) for _ in range(32))]),
                     content_type="text/event-stream")
    good.call = odd.call = endless
    body = {"model": "base", "prompt": "x", "session_id": "ev", "stream": True}
    with HTTP.stream("POST", router.url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        received = b"".join(r.iter_bytes())
    assert received.startswith(first) and len(received) < (1 << 20)  # was: 32 MB relayed as one event
    error = json.loads(received[len(first):].decode().removeprefix("data: "))["error"]
    assert error["code"] == 502 and "max_event_bytes" in error["message"]
    good.call = odd.call = None
    with HTTP.stream("POST", router.url + "/v1/completions", json=body, timeout=30) as r:
        assert [line for line in r.iter_lines() if line][-1] == "data: [DONE]"
