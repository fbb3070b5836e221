"""The engine's KV budget (inference/kvcache.py): idle sessions' block tables, reservations, LRU eviction.

The pool here has one-token blocks, so budgets read in tokens; tests/unit/test_paged.py covers blocks.
"""

import time

import pytest
import torch

from burstrl.inference import kvcache
from burstrl.inference.kvcache import SessionCache
from burstrl.inference.paged import KVPool, SequenceKV

LAYERS, KVH, D = 2, 2, 4
CPU = torch.device("cpu")


def _cache(capacity: int, thrash_window_s: float) -> SessionCache:
    return SessionCache(KVPool(LAYERS, KVH, D, torch.float32, CPU, num_blocks=capacity, block_size=1),
                        thrash_window_s)


def _kv(cache: SessionCache, length: int) -> SequenceKV:
    """A table of `length` tokens whose key at position p in layer i is p + 100 * i."""
    table = SequenceKV.new(cache.pool)
    table.reserve(cache.pool, length)
    slots = table.tables[0].slots(cache.pool, length, CPU)
    for i in range(LAYERS):
        cache.pool.k[i][:, slots] = (torch.arange(length, dtype=torch.float32) + 100 * i)[None, :, None]
    table.length = length
    return table


def _check(cache: SessionCache) -> None:
    assert cache.idle_tokens == sum(e.table.length for e in cache.idle.values())
    assert cache.idle_blocks == sum(e.table.num_blocks for e in cache.idle.values())
    assert cache.reserved >= 0
    assert cache.idle_tokens + cache.reserved <= cache.capacity


@pytest.fixture
def clock(fake_clock):
    return fake_clock(kvcache, now=1000.0)


# ---- SessionCache: budget ----

def test_reserve_and_unreserve_account_budget():
    cache = _cache(100, 1.0)
    assert cache.reserve(60)
    assert cache.reserved == 60
    assert cache.reserve(40)
    assert not cache.reserve(1)
    assert cache.reserved == 100
    _check(cache)
    cache.unreserve(60)
    assert cache.reserved == 40
    assert cache.reserve(60)
    _check(cache)


def test_put_take_keep_idle_tokens():
    cache = _cache(100, 1.0)
    assert cache.reserve(30)
    kv = _kv(cache, 20)
    cache.unreserve(30)
    cache.put("a", kv, list(range(25)), 0)  # tokens longer than kv: only kv.length kept
    assert cache.idle_tokens == 20 and cache.cached_length("a") == 20
    assert cache.idle["a"].tokens == list(range(20))
    _check(cache)
    got, reuse = cache.take("a", list(range(30)), 0)
    assert got is kv and reuse == 20
    assert cache.idle_tokens == 0 and cache.cached_length("a") == 0
    _check(cache)


def test_take_unknown_session():
    cache = _cache(100, 1.0)
    assert cache.take("nope", [1, 2, 3], 0) == (None, 0)


def test_request_cycle_keeps_invariant():
    cache = _cache(200, 1.0)
    prompt = list(range(10))
    expected_reuse = 0
    for call in range(5):
        kv, reuse = cache.take("s", prompt, 0)
        assert reuse == expected_reuse
        need = len(prompt) + 8
        assert cache.reserve(need)
        _check(cache)
        kv = kv if kv is not None else _kv(cache, 0)
        fed = prompt + [100 + call] * 7
        kv.reserve(cache.pool, len(fed))
        kv.length = len(fed)
        cache.unreserve(need)
        cache.put("s", kv, fed, 0)
        _check(cache)
        expected_reuse = len(fed)
        prompt = fed + [200 + call] * 3


def test_lru_evicts_oldest_first_and_only_as_many_as_needed():
    cache = _cache(100, 1.0)
    for name in ("a", "b", "c", "d"):
        cache.put(name, _kv(cache, 20), list(range(20)), 0)
    _check(cache)
    # touching b makes it most recent: order a, c, d, b
    kv, _ = cache.take("b", list(range(21)), 0)
    cache.put("b", kv, list(range(20)), 0)
    assert cache.reserve(35)  # needs 15 more than free: a (20) is enough
    assert list(cache.idle) == ["c", "d", "b"]
    assert cache.stats.evictions == 1 and cache.stats.evicted_tokens == 20
    _check(cache)
    assert cache.reserve(30)  # 5 free, needs 25: c and d go
    assert list(cache.idle) == ["b"]
    assert cache.stats.evictions == 3
    _check(cache)


def test_reserve_exactly_fills_without_eviction():
    cache = _cache(100, 1.0)
    cache.put("a", _kv(cache, 40), list(range(40)), 0)
    assert cache.reserve(60)
    assert "a" in cache.idle and cache.stats.evictions == 0
    _check(cache)


def test_reserve_false_when_it_cannot_fit_after_evicting_everything():
    cache = _cache(100, 1.0)
    assert cache.reserve(50)
    cache.put("a", _kv(cache, 10), list(range(10)), 0)
    cache.put("b", _kv(cache, 10), list(range(10)), 0)
    assert not cache.reserve(60)
    assert cache.reserved == 50
    _check(cache)
    assert not cache.reserve(101)


def test_failed_reserve_evicts_nothing():
    cache = _cache(100, 1.0)
    assert cache.reserve(50)
    cache.put("a", _kv(cache, 10), list(range(10)), 0)
    cache.put("b", _kv(cache, 10), list(range(10)), 0)
    assert not cache.reserve(60)
    assert list(cache.idle) == ["a", "b"] and cache.stats.evictions == 0


def test_used_tokens_counts_idle_and_running():
    cache = _cache(100, 1.0)
    cache.put("a", _kv(cache, 12), list(range(12)), 0)
    cache.hold_running(9)
    cache.release_running(2)
    assert cache.used_tokens == 19


def test_drop_forgets_without_eviction():
    cache = _cache(100, 1.0)
    cache.put("a", _kv(cache, 12), list(range(12)), 0)
    cache.drop("a")
    cache.drop("unknown")
    assert cache.idle_tokens == 0 and not cache.idle
    assert cache.stats.evictions == 0


# ---- SessionCache: prefix reuse ----

def test_take_returns_common_prefix_and_truncates():
    cache = _cache(100, 1.0)
    cache.put("a", _kv(cache, 10), [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], 0)
    kv, reuse = cache.take("a", [1, 2, 3, 4, 99, 6, 7, 8, 9, 10, 11], 0)
    assert reuse == 4 and kv.length == 4


def test_take_leaves_at_least_one_prompt_token():
    cache = _cache(100, 1.0)
    tokens = list(range(10))
    cache.put("a", _kv(cache, 10), tokens, 0)
    kv, reuse = cache.take("a", tokens, 0)  # identical prompt
    assert reuse == 9 and kv.length == 9
    cache.put("a", kv, tokens, 0)
    kv, reuse = cache.take("a", tokens[:4], 0)  # shorter prompt
    assert reuse == 3 and kv.length == 3
    cache.put("a", kv, tokens, 0)
    kv, reuse = cache.take("a", [0], 0)  # nothing left to reuse: the cache goes
    assert reuse == 0 and kv is None and cache.pool.free_blocks == 100


def test_take_no_common_prefix():
    """Nothing to resume: the session's blocks go back (not an empty table kept), so the engine
    may still share another cache's prefix for the call; not a window miss."""
    cache = _cache(100, 1.0)
    cache.put("a", _kv(cache, 5), [1, 2, 3, 4, 5], 0)
    kv, reuse = cache.take("a", [9, 2, 3, 4, 5, 6], 0)
    assert kv is None and reuse == 0 and cache.pool.free_blocks == 100 and not cache.idle
    assert cache.stats.window_misses == 0


def test_take_keeps_cached_values_of_reused_prefix():
    cache = _cache(100, 1.0)
    kv = _kv(cache, 6)
    cache.put("a", kv, list(range(6)), 0)
    got, reuse = cache.take("a", list(range(6)) + [7], 0)
    assert reuse == 6
    assert cache.pool.k[1][0, got.tables[0].slots(cache.pool, 6, CPU), 0].tolist() == [100.0 + p for p in range(6)]


def test_blocks_of_dropped_evicted_and_truncated_caches_go_back_to_the_pool():
    cache = _cache(30, 1.0)
    cache.put("a", _kv(cache, 10), list(range(10)), 0)
    cache.put("b", _kv(cache, 10), list(range(10)), 0)
    assert cache.pool.free_blocks == 10
    kv, reuse = cache.take("a", [0, 1, 2, 9], 0)
    assert reuse == 3 and cache.pool.free_blocks == 17  # truncated to what it reuses
    cache.put("a", kv, [0, 1, 2], 0)
    cache.drop("b")
    assert cache.pool.free_blocks == 27
    assert cache.reserve(30)  # evicts a
    assert cache.pool.free_blocks == 30 and not cache.idle
    _check(cache)


def test_a_table_put_with_a_spare_block_gives_it_back():
    cache = _cache(10, 1.0)
    table = _kv(cache, 4)
    table.reserve(cache.pool, 5)  # a decode step reserved a slot its token never filled
    cache.put("a", table, list(range(4)), 0)
    assert table.num_blocks == 4 and cache.idle_blocks == 4 and cache.pool.free_blocks == 6


# ---- SessionCache: stats ----

def test_record_counts_tokens():
    cache = _cache(100, 1.0)
    cache.record("a", 10, 0)
    cache.record("a", 20, 15)
    assert cache.stats.queries_tokens == 30 and cache.stats.hit_tokens == 15
    assert cache.stats.refills == 0


def test_refill_after_eviction_and_thrash_within_window(clock):
    cache = _cache(30, 5.0)
    cache.put("a", _kv(cache, 20), list(range(20)), 0)
    assert cache.reserve(20)  # evicts a
    assert cache.stats.evictions == 1 and cache.stats.thrash == 0
    cache.unreserve(20)
    assert cache.take("a", list(range(25)), 0) == (None, 0)
    cache.record("a", 25, 0)
    assert cache.stats.refills == 1
    cache.put("a", _kv(cache, 20), list(range(20)), 0)
    clock.now += 1.0
    assert cache.reserve(20)  # evicted again 1 s after its refill
    assert cache.stats.evictions == 2 and cache.stats.thrash == 1
    cache.unreserve(20)


def test_no_thrash_outside_window(clock):
    cache = _cache(30, 5.0)
    cache.put("a", _kv(cache, 20), list(range(20)), 0)
    assert cache.reserve(20)
    cache.unreserve(20)
    cache.record("a", 25, 0)
    assert cache.stats.refills == 1
    cache.put("a", _kv(cache, 20), list(range(20)), 0)
    clock.now += 6.0
    assert cache.reserve(20)
    assert cache.stats.evictions == 2 and cache.stats.thrash == 0


def test_first_eviction_is_not_thrash_and_hit_is_not_refill(clock):
    cache = _cache(30, 5.0)
    cache.record("a", 20, 0)  # first call: never evicted, not a refill
    assert cache.stats.refills == 0
    cache.put("a", _kv(cache, 20), list(range(20)), 0)
    assert cache.reserve(20)
    assert cache.stats.thrash == 0
    cache.unreserve(20)
    cache.record("a", 25, 0)
    assert cache.stats.refills == 1
    cache.record("a", 25, 0)  # counted once per eviction
    assert cache.stats.refills == 1


def test_thrash_with_real_clock():
    cache = _cache(30, 30.0)  # real time.monotonic
    cache.put("a", _kv(cache, 20), list(range(20)), 0)
    assert cache.reserve(20)
    cache.unreserve(20)
    cache.record("a", 25, 0)
    cache.put("a", _kv(cache, 20), list(range(20)), 0)
    assert cache.reserve(20)
    assert cache.stats.thrash == 1


def test_drop_clears_eviction_history(clock):
    cache = _cache(30, 5.0)
    cache.put("a", _kv(cache, 20), list(range(20)), 0)
    assert cache.reserve(20)
    cache.unreserve(20)
    cache.drop("a")
    cache.record("a", 25, 0)
    assert cache.stats.refills == 0


def test_no_thrash_after_window_with_real_clock():
    cache = _cache(30, 0.02)
    cache.put("a", _kv(cache, 20), list(range(20)), 0)
    assert cache.reserve(20)
    cache.unreserve(20)
    cache.record("a", 25, 0)
    cache.put("a", _kv(cache, 20), list(range(20)), 0)
    time.sleep(0.05)
    assert cache.reserve(20)
    assert cache.stats.evictions == 2 and cache.stats.thrash == 0
