"""The engine's KV is paged (issue 33): memory held stays within the token budget at every step.

Before, the decode batch was one [rows, KVH, longest, D] tensor per layer that doubled for all
rows: 64 short calls decoding and one 3,000-token call asked for 64 x its length and killed the
engine ("can't allocate"). Now every sequence is a block table into one pool allocated at the
budget. These tests run the real engine thread on the tiny model and audit, after every engine
iteration, that every block is held exactly as often as tables list it and that the budget
(idle blocks + running reservations) never exceeds the pool.
"""

from __future__ import annotations

import json
import random
import threading
from pathlib import Path

import pytest

from burstrl.inference.engine import Engine, Request
from burstrl.inference.replica import InferenceReplica
from burstrl.inference.sampling import SamplingParams

BUDGET = 4096
BLOCK = 16


@pytest.fixture(scope="module")
def small(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """An in-process replica whose KV budget is 4,096 tokens in 16-token blocks."""
    from burstrl.config import ServeConfig
    from burstrl.inference.replica import build_replica

    cfg = ServeConfig.model_validate({
        "model": {"path": str(tiny_model_dir)},
        "engine": {"num_threads": 1, "max_total_num_tokens": BUDGET, "kv_block_size": BLOCK},
        "server": {"admin_token": "t", "state_dir": str(tmp_path_factory.mktemp("state"))},
    })
    rep = build_replica(cfg)
    yield rep
    rep.close()


def audit(engine: Engine) -> str | None:
    """What is wrong with the pool's bookkeeping now, or None (runs on the engine thread)."""
    pool, cache = engine.pool, engine.cache
    holders = [e.table for e in cache.idle.values()] + [r.kv for r in engine.rows]
    held: dict[int, int] = {}
    for seq in holders:
        for table in seq.tables:
            if (table.first + len(table.blocks)) * pool.block_size < table.length:
                return f"a table of {table.length} tokens lists only {len(table.blocks)} blocks from {table.first}"
            for b in table.blocks:
                held[b] = held.get(b, 0) + 1
    wrong = [b for b in range(pool.num_blocks) if pool.refs[b] != held.get(b, 0)]
    if wrong:
        return f"blocks {wrong[:5]} are counted {[pool.refs[b] for b in wrong[:5]]} times, held {[held.get(b, 0) for b in wrong[:5]]}"
    if cache.idle_blocks + cache.reserved_blocks > pool.num_blocks:
        return f"budget over the pool: {cache.idle_blocks} idle + {cache.reserved_blocks} reserved blocks"
    over = [r.id for r in engine.rows if r.kv.num_blocks > r.reserved]
    if over:
        return f"rows {over} hold more blocks than they reserved"
    return None


@pytest.fixture(scope="module")
def windowed(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """The same budget on a tiny Gemma 3 whose sliding layers (window 6) keep only their window."""
    from burstrl.config import ServeConfig
    from burstrl.inference.replica import build_replica

    from .test_generic_path import make_model

    model = make_model("gemma3", tiny_model_dir, tmp_path_factory.mktemp("gemma3"), max_position_embeddings=8192)
    cfg = ServeConfig.model_validate({
        "model": {"path": str(model)},
        "engine": {"num_threads": 1, "max_total_num_tokens": BUDGET, "kv_block_size": BLOCK},
        "server": {"admin_token": "t", "state_dir": str(tmp_path_factory.mktemp("state"))},
    })
    rep = build_replica(cfg)
    assert rep.engine.pool.sequence_blocks == 2  # a sliding group and a global group
    yield rep
    rep.close()


@pytest.fixture(params=["small", "windowed"])
def replica(request: pytest.FixtureRequest) -> InferenceReplica:
    return request.getfixturevalue(request.param)


@pytest.fixture
def audited(replica: InferenceReplica):
    """The replica, with its engine auditing the pool after every iteration; yields the problems seen."""
    engine = replica.engine
    problems: list[str] = []
    iterate = engine._iterate

    def checked() -> bool:
        going = iterate()
        problem = audit(engine)
        if problem is not None and len(problems) < 20:
            problems.append(problem)
        return going

    engine._iterate = checked
    yield problems
    engine._iterate = iterate


def call(rep: InferenceReplica, prompt: list[int], session: str | None = None, max_tokens: int = 12,
         **kw) -> tuple[Request, threading.Event]:
    done = threading.Event()
    rid = f"r{id(done)}"
    params = SamplingParams(**{"max_tokens": max_tokens, "temperature": 0.8, "seed": len(prompt), "ignore_eos": True,
                               **kw})
    req = Request(id=rid, session=rep.sessions.begin(session, "base", rid), prompt_ids=prompt, params=params,
                  version="base", adapter=None, on_done=lambda _: done.set())
    rep.engine.submit(req)
    return req, done


def wait(*pairs: tuple[Request, threading.Event]) -> None:
    for req, done in pairs:
        assert done.wait(300), f"request {req.id} did not finish"


def test_64_short_calls_and_one_3000_token_call_stay_in_the_pool(replica: InferenceReplica,
                                                                 audited: list[str]) -> None:
    small, engine = replica, replica.engine
    nbytes = engine.pool.nbytes
    assert nbytes == 2 * engine.runner.num_layers * BUDGET * engine.runner.num_kv_heads * engine.runner.head_dim * 4
    short = [call(small, [5 + i % 7, 6, 7], max_tokens=40) for i in range(64)]
    long = call(small, [(11 * i) % 500 + 3 for i in range(3000)], max_tokens=8)
    wait(*short, long)
    assert all(r.error is None and len(r.completion_ids) == 40 for r, _ in short)
    assert long[0].error is None and len(long[0].completion_ids) == 8
    too_long = call(small, [9] * 4000, max_tokens=200)  # past the whole pool: refused alone, nothing taken
    wait(too_long)
    assert f"the whole budget is {256 * engine.pool.sequence_blocks}" in too_long[0].error
    after = call(small, [1, 2, 3])
    wait(after)
    assert after[0].error is None and engine.alive
    assert audited == [] and engine.pool.nbytes == nbytes
    assert engine.cache.reserved_blocks == 0 and engine.cache.running_tokens == 0


def test_random_joins_turns_aborts_and_leaves_keep_every_block_accounted_for(
        replica: InferenceReplica, audited: list[str]) -> None:
    """Multi-turn sessions (their caches reused and truncated), shared prompts (blocks shared
    with running donors), aborts and releases, over a budget far smaller than the load. On the
    windowed model the sliding group's blocks also leave with the window, and a cut history
    further back than the window's margin is a window miss, never a wrong reuse."""
    rng = random.Random(7)
    small, engine = replica, replica.engine
    system = [rng.randrange(3, 500) for _ in range(300)]
    convo: dict[str, list[int]] = {}
    live: list[tuple[Request, threading.Event]] = []
    harvested = 0  # requests of released sessions are not continued
    for _ in range(70):
        sid = f"s{rng.randrange(12)}"
        wait(*[(r, d) for r, d in live if r.session.id == sid])  # one call at a time per session
        prompt = convo.get(sid) or system + [rng.randrange(3, 500) for _ in range(rng.randrange(1, 40))]
        if sid in convo and rng.random() < 0.3:
            prompt = prompt[: rng.randrange(1, len(prompt))]  # an edited history: the cache is cut
        prompt = prompt + [rng.randrange(3, 500) for _ in range(rng.randrange(1, 80))]
        req, done = call(small, prompt[-3000:], session=sid, max_tokens=rng.randrange(1, 50))
        live.append((req, done))
        if rng.random() < 0.1:
            engine.abort(req.id)
        if rng.random() < 0.3:
            wait(live[rng.randrange(len(live))])
        for r, d in live[harvested:]:
            if d.is_set() and r.error is None:
                convo[r.session.id] = r.prompt_ids + r.completion_ids
        if rng.random() < 0.1:  # the owner releases a session between calls
            wait(*live)
            harvested = len(live)
            gone = rng.choice(small.sessions.snapshot()).id
            small.sessions.release(gone)
            engine.drop_session(gone)
            convo.pop(gone, None)
    wait(*live)
    assert all(r.error is None for r, _ in live), [r.error for r, _ in live if r.error][:3]
    assert audited == [] and engine.alive
    assert engine.cache.stats.shared_hit_tokens > 0
    if engine.pool.sequence_blocks > 1:  # the same load fits the budget once the sliding layers keep only the window
        assert engine.cache.stats.window_misses > 0
    else:
        assert engine.cache.stats.evictions > 0
    for s in small.sessions.snapshot():
        small.sessions.release(s.id)
        engine.drop_session(s.id)
    final = call(small, [1, 2, 3])  # no session: nothing kept; the drops above are done by now
    wait(final)
    assert engine.pool.used_blocks == 0 and not engine.cache.idle


def test_a_session_past_its_window_is_not_advertised_to_the_routers_prefix_index(windowed: InferenceReplica) -> None:
    """A windowed session longer than window + margin let go of the sliding keys a prompt sharing
    its first blocks would need: the replica's prefix summary leaves it out (advertising it drew new
    sessions here only to prefill them anyway); a shorter session is still advertised."""
    from burstrl.protocol.blocks import BLOCK_TOKENS, cache_scope, prefix_block_hashes
    from burstrl.router.answers import check_loads

    short = call(windowed, [7 + i % 90 for i in range(70)], session="short-w", max_tokens=4)
    long = call(windowed, [9 + i % 80 for i in range(300)], session="long-w", max_tokens=4)
    wait(short, long)
    advertised = set(windowed.engine.prefix_summary()["hashes"])

    def first_block(req: Request) -> int:
        return prefix_block_hashes(req.prompt_ids[:BLOCK_TOKENS], cache_scope("base", None))[0]

    assert first_block(short[0]) in advertised and first_block(long[0]) not in advertised
    # and the router is told how this replica's KV grows (half the groups hold at most 6 + 128 tokens)
    loads = windowed.engine.loads()
    assert loads["kv_window"] == {"tokens": 6 + 128, "fraction": 0.5}
    assert check_loads(json.loads(json.dumps(loads)))["kv_window"] == (134, 0.5)
    for sid in ("short-w", "long-w"):
        windowed.sessions.release(sid)
        windowed.engine.drop_session(sid)
