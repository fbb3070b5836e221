"""Evictions, re-fills and thrash on vLLM (`inference/vllm/refills.py`), from calls' cached tokens."""

from __future__ import annotations

from burstrl.inference.request import Request
from burstrl.inference.sampling import SamplingParams
from burstrl.inference.sessions import ReplicaSession
from burstrl.inference.vllm.refills import RefillTracker

BLOCK = 16


def _call(session: ReplicaSession, prompt: list[int], cached: int) -> Request:
    req = Request(id="r", session=session, prompt_ids=prompt, params=SamplingParams(max_tokens=4), version="base",
                  adapter=None, on_done=lambda _: None)
    req.cached_tokens = cached
    return req


def _session(history: int) -> ReplicaSession:
    s = ReplicaSession(id="s", version="base")
    s.prompt_ids, s.completion_ids = list(range(history - 4)), list(range(history - 4, history))
    return s


def test_a_call_that_finds_its_history_cached_is_no_refill() -> None:
    t = RefillTracker(window_s=60)
    s = _session(100)  # vLLM computed 99 tokens: 6 full blocks (96) it may keep
    t.observe(_call(s, list(range(120)), cached=96), BLOCK)
    assert (t.evictions, t.refills, t.thrash) == (0, 0, 0)


def test_a_call_that_prefills_evicted_history_is_a_refill_and_a_second_soon_after_is_thrash() -> None:
    t = RefillTracker(window_s=60)
    s = _session(100)
    t.observe(_call(s, list(range(120)), cached=32), BLOCK, now=10.0)
    assert (t.evictions, t.refills, t.refilled_tokens, t.thrash) == (1, 1, 64, 0)
    t.observe(_call(s, list(range(120)), cached=0), BLOCK, now=30.0)  # evicted again 20 s after its re-fill
    assert (t.refills, t.thrash) == (2, 1)
    t.observe(_call(s, list(range(120)), cached=0), BLOCK, now=200.0)  # long after: a re-fill, not thrash
    assert (t.refills, t.thrash) == (3, 1)
    t.forget("s")
    t.observe(_call(s, list(range(120)), cached=0), BLOCK, now=201.0)  # a forgotten session starts afresh
    assert (t.refills, t.thrash) == (4, 1)


def test_first_calls_edited_histories_and_ephemeral_calls_owe_nothing() -> None:
    t = RefillTracker(window_s=60)
    t.observe(_call(ReplicaSession(id="new", version="base"), list(range(50)), cached=0), BLOCK)
    s = _session(100)
    t.observe(_call(s, [7] + list(range(1, 120)), cached=0), BLOCK)  # does not extend the history
    e = _session(100)
    e.ephemeral = True
    t.observe(_call(e, list(range(120)), cached=0), BLOCK)
    assert (t.evictions, t.refills, t.thrash) == (0, 0, 0)
