"""The engine in-process with the tiny model: seeds, stop strings, joining mid-decode, shutdown."""

from __future__ import annotations

import threading
from pathlib import Path

from burstrl.config import ServeConfig
from burstrl.inference.engine import Request
from burstrl.inference.replica import InferenceReplica, build_replica
from burstrl.inference.sampling import SamplingParams


def submit(rep: InferenceReplica, prompt: list[int], params: SamplingParams, session: str | None = None,
           on_token=None) -> tuple[Request, threading.Event]:
    done = threading.Event()
    rid = f"r{id(done)}"
    req = Request(id=rid, session=rep.sessions.begin(session, "base", rid), prompt_ids=prompt,
                  params=params, version="base", adapter=None, on_done=lambda _: done.set(),
                  on_token=on_token)
    rep.engine.submit(req)
    return req, done


def run(rep: InferenceReplica, prompt: list[int], **kw) -> Request:
    req, done = submit(rep, prompt, SamplingParams(**kw))
    assert done.wait(60)
    return req


def test_seeds_are_honoured(replica: InferenceReplica) -> None:
    a = run(replica, [5, 6, 7], max_tokens=20, temperature=1.0, seed=11)
    b = run(replica, [5, 6, 7], max_tokens=20, temperature=1.0, seed=11)
    c = run(replica, [5, 6, 7], max_tokens=20, temperature=1.0, seed=12)
    assert a.completion_ids == b.completion_ids != c.completion_ids


def test_stop_string_cuts_the_text_and_keeps_the_sampled_ids(replica: InferenceReplica) -> None:
    free = run(replica, [9, 8, 7], max_tokens=30, temperature=0, ignore_eos=True)
    assert len(free.text) > 10
    stop = free.text[6:9]
    cut = run(replica, [9, 8, 7], max_tokens=30, temperature=0, ignore_eos=True, stop=[stop])
    assert cut.finish_reason == "stop"
    assert cut.text == free.text[: free.text.find(stop)]
    assert cut.completion_ids == free.completion_ids[: len(cut.completion_ids)]
    assert len(cut.completion_ids) < len(free.completion_ids)


def test_a_request_joins_a_running_batch_and_both_stay_exact(replica: InferenceReplica) -> None:
    solo_long = run(replica, [1, 2, 3, 4], max_tokens=60, temperature=0, ignore_eos=True)
    solo_short = run(replica, [10, 11], max_tokens=10, temperature=0, ignore_eos=True)
    joined = threading.Event()
    holder: dict[str, tuple] = {}

    def on_token(req: Request) -> None:
        if len(req.completion_ids) == 20 and not joined.is_set():
            joined.set()  # the second request arrives mid-decode of the first
            holder["short"] = submit(replica, [10, 11], SamplingParams(max_tokens=10, temperature=0,
                                                                       ignore_eos=True))

    long_req, long_done = submit(replica, [1, 2, 3, 4], SamplingParams(max_tokens=60, temperature=0,
                                                                       ignore_eos=True), on_token=on_token)
    assert long_done.wait(60)
    short_req, short_done = holder["short"]
    assert short_done.wait(60)
    assert long_req.completion_ids == solo_long.completion_ids
    assert short_req.completion_ids == solo_short.completion_ids
    # the short one finished while the long one was still decoding
    assert short_req.t_end < long_req.t_end


def test_stopping_the_engine_finishes_every_request(tiny_model_dir: Path, tmp_path: Path) -> None:
    cfg = ServeConfig.model_validate({"model": {"path": str(tiny_model_dir)},
                                      "engine": {"num_threads": 1, "max_running_requests": 1},
                                      "server": {"admin_token": "t", "state_dir": str(tmp_path)}})
    rep = build_replica(cfg)
    params = SamplingParams(max_tokens=3000, temperature=0, ignore_eos=True)
    running, running_done = submit(rep, [1, 2], params, session="a")
    waiting, waiting_done = submit(rep, [3, 4], params, session="b")
    rep.close()
    assert running_done.wait(10) and waiting_done.wait(10)
    assert running.finish_reason == waiting.finish_reason == "abort"
    assert rep.sessions.get("a").busy is False


def test_a_group_arriving_together_prefills_its_prompt_once(replica: InferenceReplica) -> None:
    """Four rollouts of one task (same 80-token prompt) arrive at once: one prefill, three copies."""
    prompt = list(range(300, 380))
    before = replica.engine.counters.prompt_tokens
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    reqs = [submit(replica, prompt, params, session=f"group-{i}") for i in range(4)]
    for _, done in reqs:
        assert done.wait(60)
    outs = [r.completion_ids for r, _ in reqs]
    assert all(o == outs[0] for o in outs)
    assert sorted(r.cached_tokens for r, _ in reqs) == [0, 79, 79, 79]
    assert replica.engine.counters.prompt_tokens - before == 80 + 3
