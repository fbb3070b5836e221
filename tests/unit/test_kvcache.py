import time

import pytest
import torch

from burstrl.inference import kvcache
from burstrl.inference.kvcache import DecodeBatch, SessionCache, SessionKV

LAYERS, KVH, D = 2, 2, 4
CPU = torch.device("cpu")


def _kv(length: int, fill: float | None = None, capacity: int = 4) -> SessionKV:
    kv = SessionKV(LAYERS, KVH, D, torch.float32, CPU, capacity=capacity)
    kv.reserve(length)
    for i in range(LAYERS):
        if fill is None:
            kv.k[i][:, :length] = torch.randn(KVH, length, D)
            kv.v[i][:, :length] = torch.randn(KVH, length, D)
        else:
            kv.k[i][:, :length] = fill + i
            kv.v[i][:, :length] = -(fill + i)
    kv.length = length
    return kv


def _check(cache: SessionCache) -> None:
    assert cache.idle_tokens == sum(e.kv.length for e in cache.idle.values())
    assert cache.reserved >= 0
    assert cache.idle_tokens + cache.reserved <= cache.capacity


@pytest.fixture
def clock(fake_clock):
    return fake_clock(kvcache, now=1000.0)


# ---- SessionCache: budget ----

def test_reserve_and_unreserve_account_budget():
    cache = SessionCache(capacity=100, thrash_window_s=1.0)
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
    cache = SessionCache(capacity=100, thrash_window_s=1.0)
    assert cache.reserve(30)
    kv = _kv(20)
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
    cache = SessionCache(capacity=100, thrash_window_s=1.0)
    assert cache.take("nope", [1, 2, 3], 0) == (None, 0)


def test_request_cycle_keeps_invariant():
    cache = SessionCache(capacity=200, thrash_window_s=1.0)
    prompt = list(range(10))
    expected_reuse = 0
    for call in range(5):
        kv, reuse = cache.take("s", prompt, 0)
        assert reuse == expected_reuse
        need = len(prompt) + 8
        assert cache.reserve(need)
        _check(cache)
        kv = kv if kv is not None else _kv(0)
        fed = prompt + [100 + call] * 7
        kv.reserve(len(fed))
        kv.length = len(fed)
        cache.unreserve(need)
        cache.put("s", kv, fed, 0)
        _check(cache)
        expected_reuse = len(fed)
        prompt = fed + [200 + call] * 3


def test_lru_evicts_oldest_first_and_only_as_many_as_needed():
    cache = SessionCache(capacity=100, thrash_window_s=1.0)
    for name in ("a", "b", "c", "d"):
        cache.put(name, _kv(20), list(range(20)), 0)
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
    cache = SessionCache(capacity=100, thrash_window_s=1.0)
    cache.put("a", _kv(40), list(range(40)), 0)
    assert cache.reserve(60)
    assert "a" in cache.idle and cache.stats.evictions == 0
    _check(cache)


def test_reserve_false_when_it_cannot_fit_after_evicting_everything():
    cache = SessionCache(capacity=100, thrash_window_s=1.0)
    assert cache.reserve(50)
    cache.put("a", _kv(10), list(range(10)), 0)
    cache.put("b", _kv(10), list(range(10)), 0)
    assert not cache.reserve(60)
    assert cache.reserved == 50
    _check(cache)
    assert not cache.reserve(101)


def test_failed_reserve_evicts_nothing():
    cache = SessionCache(capacity=100, thrash_window_s=1.0)
    assert cache.reserve(50)
    cache.put("a", _kv(10), list(range(10)), 0)
    cache.put("b", _kv(10), list(range(10)), 0)
    assert not cache.reserve(60)
    assert list(cache.idle) == ["a", "b"] and cache.stats.evictions == 0


def test_used_tokens_counts_idle_and_running():
    cache = SessionCache(capacity=100, thrash_window_s=1.0)
    cache.put("a", _kv(12), list(range(12)), 0)
    cache.hold_running(9)
    cache.release_running(2)
    assert cache.used_tokens == 19


def test_drop_forgets_without_eviction():
    cache = SessionCache(capacity=100, thrash_window_s=1.0)
    cache.put("a", _kv(12), list(range(12)), 0)
    cache.drop("a")
    cache.drop("unknown")
    assert cache.idle_tokens == 0 and not cache.idle
    assert cache.stats.evictions == 0


# ---- SessionCache: prefix reuse ----

def test_take_returns_common_prefix_and_truncates():
    cache = SessionCache(capacity=100, thrash_window_s=1.0)
    cache.put("a", _kv(10), [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], 0)
    kv, reuse = cache.take("a", [1, 2, 3, 4, 99, 6, 7, 8, 9, 10, 11], 0)
    assert reuse == 4 and kv.length == 4


def test_take_leaves_at_least_one_prompt_token():
    cache = SessionCache(capacity=100, thrash_window_s=1.0)
    tokens = list(range(10))
    cache.put("a", _kv(10), tokens, 0)
    kv, reuse = cache.take("a", tokens, 0)  # identical prompt
    assert reuse == 9 and kv.length == 9
    cache.put("a", kv, tokens, 0)
    kv, reuse = cache.take("a", tokens[:4], 0)  # shorter prompt
    assert reuse == 3 and kv.length == 3
    cache.put("a", kv, tokens, 0)
    kv, reuse = cache.take("a", [0], 0)
    assert reuse == 0 and kv.length == 0


def test_take_no_common_prefix():
    cache = SessionCache(capacity=100, thrash_window_s=1.0)
    cache.put("a", _kv(5), [1, 2, 3, 4, 5], 0)
    kv, reuse = cache.take("a", [9, 2, 3, 4, 5, 6], 0)
    assert kv is not None and reuse == 0 and kv.length == 0


def test_take_keeps_cached_values_of_reused_prefix():
    cache = SessionCache(capacity=100, thrash_window_s=1.0)
    kv = _kv(6)
    k0 = kv.k[0][:, :6].clone()
    cache.put("a", kv, list(range(6)), 0)
    got, reuse = cache.take("a", list(range(6)) + [7], 0)
    assert reuse == 6
    assert torch.equal(got.k[0][:, :6], k0)


# ---- SessionCache: stats ----

def test_record_counts_tokens():
    cache = SessionCache(capacity=100, thrash_window_s=1.0)
    cache.record("a", 10, 0)
    cache.record("a", 20, 15)
    assert cache.stats.queries_tokens == 30 and cache.stats.hit_tokens == 15
    assert cache.stats.refills == 0


def test_refill_after_eviction_and_thrash_within_window(clock):
    cache = SessionCache(capacity=30, thrash_window_s=5.0)
    cache.put("a", _kv(20), list(range(20)), 0)
    assert cache.reserve(20)  # evicts a
    assert cache.stats.evictions == 1 and cache.stats.thrash == 0
    cache.unreserve(20)
    assert cache.take("a", list(range(25)), 0) == (None, 0)
    cache.record("a", 25, 0)
    assert cache.stats.refills == 1
    cache.put("a", _kv(20), list(range(20)), 0)
    clock.now += 1.0
    assert cache.reserve(20)  # evicted again 1 s after its refill
    assert cache.stats.evictions == 2 and cache.stats.thrash == 1
    cache.unreserve(20)


def test_no_thrash_outside_window(clock):
    cache = SessionCache(capacity=30, thrash_window_s=5.0)
    cache.put("a", _kv(20), list(range(20)), 0)
    assert cache.reserve(20)
    cache.unreserve(20)
    cache.record("a", 25, 0)
    assert cache.stats.refills == 1
    cache.put("a", _kv(20), list(range(20)), 0)
    clock.now += 6.0
    assert cache.reserve(20)
    assert cache.stats.evictions == 2 and cache.stats.thrash == 0


def test_first_eviction_is_not_thrash_and_hit_is_not_refill(clock):
    cache = SessionCache(capacity=30, thrash_window_s=5.0)
    cache.record("a", 20, 0)  # first call: never evicted, not a refill
    assert cache.stats.refills == 0
    cache.put("a", _kv(20), list(range(20)), 0)
    assert cache.reserve(20)
    assert cache.stats.thrash == 0
    cache.unreserve(20)
    cache.record("a", 25, 0)
    assert cache.stats.refills == 1
    cache.record("a", 25, 0)  # counted once per eviction
    assert cache.stats.refills == 1


def test_thrash_with_real_clock():
    cache = SessionCache(capacity=30, thrash_window_s=30.0)  # real time.monotonic
    cache.put("a", _kv(20), list(range(20)), 0)
    assert cache.reserve(20)
    cache.unreserve(20)
    cache.record("a", 25, 0)
    cache.put("a", _kv(20), list(range(20)), 0)
    assert cache.reserve(20)
    assert cache.stats.thrash == 1


def test_drop_clears_eviction_history(clock):
    cache = SessionCache(capacity=30, thrash_window_s=5.0)
    cache.put("a", _kv(20), list(range(20)), 0)
    assert cache.reserve(20)
    cache.unreserve(20)
    cache.drop("a")
    cache.record("a", 25, 0)
    assert cache.stats.refills == 0


# ---- SessionKV ----

def test_session_kv_reserve_grows_and_keeps_prefix():
    kv = _kv(3, capacity=4)
    k = [t[:, :3].clone() for t in kv.k]
    v = [t[:, :3].clone() for t in kv.v]
    kv.reserve(4)
    assert kv.capacity == 4  # fits: no growth
    kv.reserve(5)
    assert kv.capacity == 8  # doubles
    kv.reserve(100)
    assert kv.capacity == 100  # jumps straight to what is needed
    assert kv.length == 3
    for i in range(LAYERS):
        assert kv.k[i].shape == (KVH, 100, D)
        assert torch.equal(kv.k[i][:, :3], k[i]) and torch.equal(kv.v[i][:, :3], v[i])


def test_session_kv_truncate():
    kv = _kv(5)
    kv.truncate(8)
    assert kv.length == 5
    kv.truncate(2)
    assert kv.length == 2


# ---- DecodeBatch ----

def _batch() -> DecodeBatch:
    return DecodeBatch(LAYERS, KVH, D, torch.float32, CPU, scale=1.0)


def _assert_row(batch: DecodeBatch, row: int, kv: SessionKV) -> None:
    n = kv.length
    assert int(batch.lens[row]) == n
    for i in range(LAYERS):
        assert torch.equal(batch.k[i][row, :, :n], kv.k[i][:, :n])
        assert torch.equal(batch.v[i][row, :, :n], kv.v[i][:, :n])


def test_decode_batch_add_copies_rows():
    batch = _batch()
    kvs = [_kv(n) for n in (3, 7, 1)]
    for r, kv in enumerate(kvs):
        assert batch.add(kv) == r
    assert batch.size == 3 and batch.lens.tolist() == [3, 7, 1]
    for r, kv in enumerate(kvs):
        _assert_row(batch, r, kv)


def test_decode_batch_grows_rows_and_length():
    batch = _batch()
    kvs = [_kv(n) for n in range(1, 12)]  # more than 8 rows
    kvs.append(_kv(300))  # longer than the initial 256
    for kv in kvs:
        batch.add(kv)
    assert batch.size == len(kvs)
    for r, kv in enumerate(kvs):
        _assert_row(batch, r, kv)


def test_decode_batch_remove_moves_last_row_and_copies_out():
    batch = _batch()
    kvs = [_kv(n) for n in (3, 7, 5, 2)]
    for kv in kvs:
        batch.add(kv)
    out = SessionKV(LAYERS, KVH, D, torch.float32, CPU, capacity=1)
    batch.remove(1, out)
    assert out.length == 7
    for i in range(LAYERS):
        assert torch.equal(out.k[i][:, :7], kvs[1].k[i][:, :7])
        assert torch.equal(out.v[i][:, :7], kvs[1].v[i][:, :7])
    assert batch.size == 3 and batch.lens.tolist() == [3, 2, 5]
    _assert_row(batch, 0, kvs[0])
    _assert_row(batch, 1, kvs[3])
    _assert_row(batch, 2, kvs[2])
    # removing the last row moves nothing
    batch.remove(2, None)
    assert batch.lens.tolist() == [3, 2]
    _assert_row(batch, 0, kvs[0])
    _assert_row(batch, 1, kvs[3])
    batch.remove(0, None)
    batch.remove(0, None)
    assert batch.size == 0
    batch.add(kvs[2])
    _assert_row(batch, 0, kvs[2])


def test_decode_batch_remove_into_same_kv_after_steps():
    batch = _batch()
    a, b = _kv(4), _kv(6)
    a_k = a.k[0][:, :4].clone()
    batch.add(a)
    batch.add(b)
    q = torch.randn(2, 2 * KVH, 1, D)
    steps = []
    for _ in range(3):
        batch.prepare()
        k, v = torch.randn(2, KVH, 1, D), torch.randn(2, KVH, 1, D)
        for layer in range(LAYERS):
            batch.attend(layer, q, k, v)
        batch.advance()
        steps.append((k, v))
    assert batch.lens.tolist() == [7, 9]
    batch.remove(0, a)
    assert a.length == 7
    assert torch.equal(a.k[0][:, :4], a_k)
    for s, (k, v) in enumerate(steps):
        assert torch.equal(a.k[1][:, 4 + s], k[0, :, 0])
        assert torch.equal(a.v[1][:, 4 + s], v[0, :, 0])
    assert batch.lens.tolist() == [9]
    assert torch.equal(batch.k[0][0, :, 6 + 2], steps[2][0][1, :, 0])


def test_decode_batch_attend_matches_per_row_attention():
    batch = _batch()
    kvs = [_kv(n) for n in (2, 5, 9)]
    for kv in kvs:
        batch.add(kv)
    batch.prepare()
    H = 2 * KVH
    q = torch.randn(3, H, 1, D)
    k, v = torch.randn(3, KVH, 1, D), torch.randn(3, KVH, 1, D)
    out = batch.attend(0, q, k, v)
    for r, kv in enumerate(kvs):
        keys = torch.cat([kv.k[0][:, :kv.length], k[r]], dim=1).repeat_interleave(2, dim=0)
        values = torch.cat([kv.v[0][:, :kv.length], v[r]], dim=1).repeat_interleave(2, dim=0)
        w = torch.softmax(q[r] @ keys.transpose(-1, -2), dim=-1)
        assert torch.allclose(out[r], w @ values, atol=1e-5)


def test_no_thrash_after_window_with_real_clock():
    cache = SessionCache(capacity=30, thrash_window_s=0.02)
    cache.put("a", _kv(20), list(range(20)), 0)
    assert cache.reserve(20)
    cache.unreserve(20)
    cache.record("a", 25, 0)
    cache.put("a", _kv(20), list(range(20)), 0)
    time.sleep(0.05)
    assert cache.reserve(20)
    assert cache.stats.evictions == 2 and cache.stats.thrash == 0
