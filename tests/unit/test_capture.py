"""Capture as deltas under caps (issue 36, finding 4): linear memory, divergence marked, drops reported."""

import tracemalloc

import pytest

from burstrl.inference import sessions as sessions_mod
from burstrl.inference.capture import CaptureLimits, common_prefix, new_record
from burstrl.inference.sessions import SessionTable
from burstrl.protocol.capture import REPLICA_CAP, SESSION_CAP, expand_calls


def _call(table, sid, prompt, completion, rid="r"):
    session = table.begin(sid, "base", rid)
    record = new_record(rid, "base", prompt, completion, [-0.5] * len(completion), finish_reason="stop",
                        cached_tokens=0, timings={}, created=0.0)
    table.capture(session, record)
    session.prompt_ids, session.completion_ids = list(prompt), list(completion)
    table.end(session)
    return session


def _trace(session, full=False):
    return {"calls": session.capture.calls_json(full), **session.capture.summary()}


def test_extending_calls_store_only_their_new_tokens():
    table = SessionTable(ttl_s=60)
    _call(table, "s", [1, 2, 3], [4])
    s = _call(table, "s", [1, 2, 3, 4, 5, 6], [7, 8])
    _call(table, "s", [1, 2, 3, 4, 5, 6, 7, 8, 9], [10])
    calls = _trace(s)["calls"]
    assert [(c["prefix_tokens"], c["prompt_ids"]) for c in calls] == [(0, [1, 2, 3]), (4, [5, 6]), (8, [9])]
    assert not any(c["diverged"] for c in calls)
    assert s.capture.tokens == 3 + 1 + 2 + 2 + 1 + 1 == table.captured_tokens
    whole = expand_calls(calls)
    assert [c["prompt_ids"] for c in whole] == [[1, 2, 3], [1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6, 7, 8, 9]]
    assert whole == _trace(s, full=True)["calls"]


def test_a_call_that_does_not_extend_is_marked_diverged_and_shares_its_common_prefix():
    table = SessionTable(ttl_s=60)
    _call(table, "s", [1, 2, 3], [4])
    s = _call(table, "s", [1, 2, 9, 9], [5])  # another history on the same session id
    c = _trace(s)["calls"][1]
    assert c["diverged"] and c["prefix_tokens"] == 2 and c["prompt_ids"] == [9, 9]
    assert s.capture.diverged_calls == table.diverged_calls == 1
    assert expand_calls(_trace(s)["calls"])[1]["prompt_ids"] == [1, 2, 9, 9]


def test_past_the_session_cap_calls_are_dropped_and_reported():
    table = SessionTable(ttl_s=60, capture=CaptureLimits(session_tokens=10, total_tokens=1000))
    _call(table, "s", [1, 2, 3], [4])  # 4 stored
    _call(table, "s", [1, 2, 3, 4, 5, 6], [7, 8])  # 4 more: 8
    _call(table, "s", [1] * 20, [1])  # over: dropped
    s = _call(table, "s", [1, 2], [3])  # fits, but a later call never follows a gap
    trace = _trace(s)
    assert len(trace["calls"]) == 2 and trace["dropped_calls"] == 2 and trace["dropped_reason"] == SESSION_CAP
    assert trace["dropped_tokens"] == 21 + 3 and table.dropped_calls == 2 and table.captured_tokens == 8


def test_the_replica_cap_bounds_all_sessions_together_and_release_frees_it():
    table = SessionTable(ttl_s=60, capture=CaptureLimits(session_tokens=100, total_tokens=10))
    _call(table, "a", [1] * 6, [2])
    b = _call(table, "b", [1] * 6, [2])
    assert _trace(b)["dropped_reason"] == REPLICA_CAP and table.captured_tokens == 7
    table.release("a")
    assert table.captured_tokens == 0
    c = _call(table, "c", [1] * 6, [2])
    assert len(c.calls) == 1 and table.captured_tokens == 7


def test_four_hundred_turns_cost_linear_memory():
    """The issue's case: 400 one-token calls in one session stored 1.6M ids whole; as deltas, ~1.2k."""
    table = SessionTable(ttl_s=60)
    history = list(range(100, 4100))  # a 4k-token first prompt
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    for turn in range(400):
        s = _call(table, "s", history, [7], rid=f"r{turn}")
        history = [*history, 7, 8]
    grown = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    assert s.capture.tokens == 4000 + 400 + 399  # the first prompt, each completion, each new id
    assert grown < 2_000_000  # whole prompts: 400 x ~4.4k ids = 1.7M ids (~7 MB as arrays, ~60 MB as lists)


def test_the_lifetime_bounds_a_session_that_keeps_calling(fake_clock):
    clock = fake_clock(sessions_mod, now=100.0)
    table = SessionTable(ttl_s=10, max_life_s=30)
    for _ in range(5):  # a call every 8 s: never idle for the TTL
        _call(table, "s", [1], [2])
        clock.now += 8
    assert [s.id for s in table.expire()] == ["s"] and table.captured_tokens == 0


@pytest.mark.parametrize(("a", "b", "n"), [([], [], 0), ([1, 2], [1, 2, 3], 2), ([1, 2, 3], [1, 5], 1),
                                           ([4], [5], 0), (list(range(1000)), [*range(700), -1], 700)])
def test_common_prefix(a, b, n):
    from array import array
    assert common_prefix(array("i", a), array("i", b)) == n == common_prefix(array("i", b), array("i", a))


@pytest.mark.parametrize("bad", [[{"prefix_tokens": 1, "prompt_ids": [1], "completion_ids": []}],
                                 [{"prefix_tokens": -1, "prompt_ids": [1], "completion_ids": []}],
                                 [{"prefix_tokens": 0, "prompt_ids": "x", "completion_ids": []}]])
def test_expand_refuses_records_that_do_not_fit(bad):
    with pytest.raises(ValueError, match="trace call 0"):
        expand_calls(bad)
