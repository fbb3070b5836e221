"""A failing request fails alone: the engine keeps serving everyone else.

The adapters here are put straight into the registry, past its validation, to reach the engine's
own last line of defence: a NaN adapter (non-finite logits for its rows only) and a wrong-width
adapter (its forward raises). Before issue 14 either killed the engine thread for every client.
"""

from __future__ import annotations

import threading

import pytest
import torch

from burstrl.inference.engine import Request
from burstrl.inference.lora import AdapterError, LoraAdapter, LoraBatch
from burstrl.inference.replica import InferenceReplica
from burstrl.inference.sampling import SamplingParams


def poisoned(rep: InferenceReplica, name: str, value: float | None = None, width_off: int = 0) -> LoraAdapter:
    """An adapter on every q_proj: filled with `value`, or with A one column too wide/narrow."""
    hidden = rep.engine.runner.layers[0].self_attn.q_proj.in_features
    out = rep.engine.runner.layers[0].self_attn.q_proj.out_features
    weights = {}
    for layer in range(rep.engine.runner.num_layers):
        a = torch.full((4, hidden + width_off), value if value is not None else 0.01)
        b = torch.full((out, 4), value if value is not None else 0.01)
        weights[(layer, "q_proj")] = (a, b, 1.0)
    adapter = LoraAdapter(name=name, path="(test)", rank=4, weights=weights)
    rep.registry.active[name] = adapter  # past validation on purpose
    return adapter


def start(rep: InferenceReplica, prompt: list[int], version: str = "base", adapter=None,
          **kw) -> tuple[Request, threading.Event]:
    done = threading.Event()
    rid = f"r{id(done)}"
    params = SamplingParams(**{"max_tokens": 12, "temperature": 0, "ignore_eos": True, **kw})
    req = Request(id=rid, session=rep.sessions.begin(None, version, rid), prompt_ids=prompt, params=params,
                  version=version, adapter=adapter, on_done=lambda _: done.set())
    rep.engine.submit(req)
    return req, done


def finish(*pairs: tuple[Request, threading.Event]) -> None:
    for _, done in pairs:
        assert done.wait(120)


def test_a_nan_adapter_fails_its_own_rows_only(replica: InferenceReplica) -> None:
    bad = poisoned(replica, "nan-lora", value=float("nan"))
    before = replica.engine.counters.failed_requests
    good = [start(replica, [5, 6, 7, i]) for i in range(3)]
    poison = start(replica, [5, 6, 7, 8], "nan-lora", bad)
    finish(*good, poison)
    assert poison[0].error and "not finite" in poison[0].error and poison[0].finish_reason == "error"
    assert all(r.error is None and len(r.completion_ids) == 12 for r, _ in good)
    assert replica.engine.alive and replica.engine.counters.failed_requests == before + 1
    assert replica.engine.cache.reserved == 0  # the failed request's budget came back


def test_a_forward_that_raises_fails_that_step_and_the_engine_serves_on(replica: InferenceReplica) -> None:
    bad = poisoned(replica, "wide-lora", width_off=3)
    steps = replica.engine.counters.step_failures
    broken = start(replica, [9, 10, 11], "wide-lora", bad)
    finish(broken)
    assert broken[0].error and "prefill failed" in broken[0].error
    assert replica.engine.alive and replica.engine.counters.step_failures == steps + 1
    after = start(replica, [9, 10, 11])
    finish(after)
    assert after[0].error is None and len(after[0].completion_ids) == 12
    assert replica.engine.cache.reserved == 0 and replica.engine.cache.running_tokens == 0


def test_a_failing_callback_fails_its_request_only(replica: InferenceReplica) -> None:
    def explode(_: Request) -> None:
        raise RuntimeError("client callback broke")

    req, done = start(replica, [3, 4, 5])
    req.on_token = explode
    other = start(replica, [3, 4, 6])
    finish((req, done), other)
    assert "client callback broke" in req.error
    assert other[0].error is None and replica.engine.alive


def test_penalties_bias_and_min_tokens_change_the_output(replica: InferenceReplica) -> None:
    prompt = [20, 21, 22, 23]
    plain = start(replica, prompt, max_tokens=16)
    forced = start(replica, prompt, max_tokens=6, logit_bias={7: 100.0})
    penalised = start(replica, prompt, max_tokens=16, frequency_penalty=2.0, presence_penalty=2.0)
    finish(plain, forced, penalised)
    assert forced[0].completion_ids == [7] * 6
    ids = penalised[0].completion_ids
    assert ids != plain[0].completion_ids
    assert len(set(ids)) > len(set(plain[0].completion_ids)) or len(set(ids)) == len(ids)
    eos = sorted(replica.engine.eos_ids)[0]
    no_eos = start(replica, prompt, max_tokens=8, min_tokens=5, ignore_eos=False, logit_bias={eos: 100.0})
    finish(no_eos)
    ids = no_eos[0].completion_ids
    assert eos not in ids[:5] and ids[5] == eos and no_eos[0].finish_reason == "stop"


def test_raw_logprobs_mode_shows_raw_and_captures_processed(replica: InferenceReplica) -> None:
    replica.engine.raw_logprobs = True
    try:
        req, done = start(replica, [30, 31, 32], temperature=1.0, top_k=1, seed=3)
        finish((req, done))
    finally:
        replica.engine.raw_logprobs = False
    assert req.error is None
    # top_k=1 samples from a one-token distribution (processed logprob 0); the raw model is unsure
    assert all(p == 0.0 for p in req.logprobs) and all(s < 0.0 for s in req.shown_logprobs)


def test_a_version_the_engine_would_compute_wrongly_is_refused_at_load(replica: InferenceReplica,
                                                                       adapters: dict, monkeypatch) -> None:
    """The LoRA probe runs on the engine thread between steps while the replica serves; a mismatch
    (an engine bug simulated by dropping o_proj's delta) refuses the version, naming it."""
    add = LoraBatch.add_
    monkeypatch.setattr(LoraBatch, "add_", lambda self, layer, name, x, y: None if name == "o_proj"
                        else add(self, layer, name, x, y))
    busy = start(replica, [40, 41, 42], max_tokens=200)
    with pytest.raises(AdapterError, match="'policy-v1' refused: the fast path's log-probabilities differ"):
        replica.registry.load("policy-v1", adapters["policy-v1"])
    assert "policy-v1" not in replica.registry.names()
    monkeypatch.setattr(LoraBatch, "add_", add)
    replica.registry.load("policy-v1", adapters["policy-v1"])  # the real engine proves it and serves it
    finish(busy)
    served = start(replica, [40, 41, 42], "policy-v1", replica.registry.for_new_session("policy-v1"))
    finish(served)
    assert busy[0].error is None and served[0].error is None and replica.engine.alive
