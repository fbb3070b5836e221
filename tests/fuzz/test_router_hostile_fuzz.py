"""Property-based hostile replicas in front of a real router (`burstrl route serve`) on loopback (issue 36).

One router, four stand-in replicas (`burstrl.router.standin`), all given with `--replicas`:
`good1`, `good2` answer sanely and serve `base`; `odd` answers the router's scrapes with arbitrary
shapes, sizes, statuses and speeds (and never advertises `base`); `caller` scrapes sanely but is the
only one serving `policy-v1`, so every call on that version goes to it, and it answers those calls
arbitrarily (any status, body, content type, size or pace, streamed or not, or by hanging up).

Invariant after every example: the router keeps placing new `base` sessions on the healthy replicas
(every `/v1/assign` a 200 naming good1 or good2), relays a normal call, keeps scraping the healthy
replicas, and answers the hostile call itself with something (any status: a replica's own error is
relayed as it is), never a hang or a dead router.

Bounded: derandomized, few examples (`BURSTRL_ROUTER_FUZZ_EXAMPLES` for more); the router's caps and
scrape deadline are set small so that big and slow answers cost little.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from burstrl.protocol.process import RoleProcess
from burstrl.router.standin import Answer, StandInReplica
from tests.http_client import HTTP

from ..integration.test_router import start_router

EXAMPLES = int(os.environ.get("BURSTRL_ROUTER_FUZZ_EXAMPLES", "15"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck))
CAP = 1 << 16  # max_scrape_bytes and max_answer_bytes of the router under test
EVENT_CAP = 4096  # its max_event_bytes
EVENT_END = re.compile(rb"\r\n\r\n|\n\n")


class Fleet:
    def __init__(self, workdir: Path) -> None:
        self.good = [StandInReplica(), StandInReplica()]
        self.odd = StandInReplica(versions=["policy-v9"])
        self.caller = StandInReplica(versions=["policy-v1"])
        urls = [r.url for r in (*self.good, self.odd, self.caller)]
        self.router: RoleProcess = start_router(
            workdir, "--replicas", json.dumps(urls), "--scrape_s", "0.05", "--scrape_timeout_s", "0.5",
            "--request_timeout_s", "5", "--health_failures", "2", "--max_scrape_bytes", str(CAP),
            "--max_answer_bytes", str(CAP), "--max_event_bytes", str(EVENT_CAP))

    def close(self) -> None:
        self.router.stop()
        for r in (*self.good, self.odd, self.caller):
            r.close()

    def replicas(self) -> dict[str, dict]:
        return {r["url"]: r for r in HTTP.get(self.router.url + "/v1/replicas", timeout=30).json()["replicas"]}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    fleet = Fleet(tmp_path_factory.mktemp("router-hostile"))
    try:
        yield fleet
    finally:
        fleet.close()


def wait_for(what: str, ok: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not ok():
        assert time.monotonic() < deadline, f"timed out waiting for: {what}"
        time.sleep(0.01)


def scraped_again(replicas: list[StandInReplica], times: int = 2) -> Callable[[], bool]:
    start = [r.counts["loads"] for r in replicas]
    return lambda: all(r.counts["loads"] >= n + times for r, n in zip(replicas, start, strict=True))


def check_router_serves(fleet: Fleet, tag: str) -> None:
    """The invariant: new `base` sessions go to the healthy replicas, and a normal call is relayed."""
    good = {r.url for r in fleet.good}
    for i in range(5):
        r = HTTP.post(fleet.router.url + "/v1/assign", json={"session_id": f"{tag}-{i}", "version": "base"}, timeout=30)
        assert r.status_code == 200 and r.json()["url"] in good, r.text[:300]
    r = HTTP.post(fleet.router.url + "/v1/completions", json={"model": "base", "prompt": "x", "session_id": f"{tag}-c"},
                  timeout=30)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "ok", r.text[:300]
    assert HTTP.get(fleet.router.url + "/health", timeout=30).status_code == 200
    assert HTTP.get(fleet.router.url + "/v1/stats", timeout=30).json()["totals"]["scrape_errors"] == 0  # no bug hit


# --- what a hostile replica may send ---------------------------------------------------------

names = st.one_of(st.text(max_size=8), st.sampled_from(["policy-v9", "", "x" * 300, "a\nb", 'q"'])).filter(
    lambda s: s != "base")
numbers = st.one_of(st.integers(-3, 3), st.sampled_from([2**53, 2**53 + 1, 2**63, 10**400, -(10**30)]),
                    st.floats(allow_nan=True, allow_infinity=True), st.booleans(), st.none())
json_values = st.recursive(st.one_of(numbers, names), lambda kids: st.one_of(
    st.lists(kids, max_size=4), st.dictionaries(names, kids, max_size=4)), max_leaves=12)
sessions = st.lists(st.fixed_dictionaries({"session_id": st.one_of(st.sampled_from(["s1", "s2"]), json_values)},
                                          optional={"tokens": numbers, "context_tokens": numbers, "busy": json_values,
                                                    "version": names}), max_size=4)
loads_like = st.fixed_dictionaries({}, optional={
    "num_used_tokens": numbers, "max_total_num_tokens": numbers, "num_running_reqs": numbers,
    "cache_hit_rate": numbers, "versions": st.one_of(st.lists(names, max_size=3), json_values),
    "sessions": st.one_of(sessions, json_values), "evictions": numbers,
    "prefix_blocks": st.one_of(st.fixed_dictionaries({"hashes": st.lists(numbers, max_size=4)}), json_values),
    "data": st.lists(st.fixed_dictionaries({"id": st.one_of(names, json_values)}), max_size=3)})


def dumps(value: object) -> bytes:
    return json.dumps(value, allow_nan=True).encode()


bodies = st.one_of(
    loads_like.map(dumps), json_values.map(dumps), st.binary(max_size=64),
    st.sampled_from([b"", b"[" * 100_000, b'{"x": ' * 50_000, b'{"num_used_tokens": 1e999}', b"null",
                     b'{"sessions": [' + b'{"session_id": "s"},' * 20_000 + b'{"session_id": "s"}]}',
                     b'{"pad": "' + b"x" * (2 * CAP) + b'"}']))
paces = st.one_of(st.just((0, 0.0)), st.tuples(st.sampled_from([1, 16, 4096]), st.sampled_from([0.0, 0.02, 0.3])))


@st.composite
def answers(draw: st.DrawFn, body: st.SearchStrategy[bytes], content_types: list[str]) -> Answer:
    chunk, pause = draw(paces)
    data = draw(body)
    if pause:
        data = data[:6 * chunk]  # a slow answer ends in under 2 s (a scrape's deadline cuts it sooner)
    return Answer(status=draw(st.sampled_from([200, 200, 200, 200, 201, 204, 302, 400, 404, 500, 503])),
                  body=data, content_type=draw(st.sampled_from(content_types)), chunk_bytes=chunk, pause_s=pause,
                  close=draw(st.sampled_from([False, False, False, True])))


events = st.lists(st.one_of(st.binary(max_size=32), st.just(b"\n\n"), st.just(b"\r\n\r\n"),
                            st.sampled_from([b'data: {"choices": [{"index": 0, "text": "t"}]}\n\n', b"data: [DONE]\n\n",
                                             b"data: " + b"x" * (2 * EVENT_CAP), b": comment\n", b"event: x\n"])),
                  max_size=8).map(b"".join)
call_bodies = st.one_of(bodies, events, st.sampled_from([b"x" * (2 * CAP)]))


# --- the properties ------------------------------------------------------------------------


@FUZZ
@given(loads=answers(bodies, ["application/json", "text/plain"]),
       models=st.one_of(st.none(), answers(bodies, ["application/json"])))
def test_fuzz_hostile_scrape_answers(fleet: Fleet, loads: Answer, models: Answer | None) -> None:
    fleet.odd.loads, fleet.odd.models = loads, models
    wait_for("two scrapes of every replica", scraped_again([fleet.odd, *fleet.good]))
    check_router_serves(fleet, f"scrape-{fleet.odd.counts['loads']}")
    assert all(fleet.replicas()[r.url]["healthy"] for r in fleet.good)


@FUZZ
@given(answer=answers(call_bodies, ["application/json", "text/event-stream", "text/plain"]), stream=st.booleans())
def test_fuzz_hostile_call_answers(fleet: Fleet, answer: Answer, stream: bool) -> None:
    fleet.odd.loads = fleet.odd.models = None
    wait_for("the calls' replica in rotation", lambda: fleet.replicas().get(fleet.caller.url, {}).get("healthy", False))
    fleet.caller.call = answer
    sid = f"call-{fleet.caller.counts['calls']}"
    body = {"model": "policy-v1", "prompt": "x", "session_id": sid, "stream": stream}
    with HTTP.stream("POST", fleet.router.url + "/v1/completions", json=body, timeout=30) as r:
        received = b"".join(r.iter_raw())  # whatever it is, it ends (the read timeout would fail the test)
    assert 100 <= r.status_code < 600
    if not stream:
        assert len(received) <= CAP, (r.status_code, len(received))
    else:
        assert all(len(event) <= EVENT_CAP for event in EVENT_END.split(received)), r.status_code
    fleet.caller.call = None
    check_router_serves(fleet, sid)
