"""Cross-session prefix reuse: the block index and SessionCache.share."""

from __future__ import annotations

import torch

from burstrl.inference.kvcache import SessionCache
from burstrl.inference.paged import KVPool, SequenceKV
from burstrl.inference.prefix import BLOCK, PrefixIndex, block_hashes

LAYERS, KVH, D = 2, 2, 4
CPU = torch.device("cpu")


def new_cache(capacity: int, block_size: int = 8) -> SessionCache:
    pool = KVPool(LAYERS, KVH, D, torch.float32, CPU, num_blocks=-(-capacity // block_size), block_size=block_size)
    return SessionCache(pool, thrash_window_s=60)


def filled(cache: SessionCache, tokens: list[int]) -> SequenceKV:
    """A table whose key/value at position p is p + 1000 * token (so shares are checkable)."""
    table = SequenceKV.new(cache.pool)
    table.reserve(cache.pool, len(tokens))
    slots = table.tables[0].slots(cache.pool, len(tokens), CPU)
    value = (torch.arange(len(tokens)) + 1000 * torch.tensor(tokens)).float()[None, :, None]
    for store in (cache.pool.k, cache.pool.v):
        for t in store:
            t[:, slots] = value
    table.length = len(tokens)
    return table


def keys(cache: SessionCache, table: SequenceKV, layer: int = 0) -> torch.Tensor:
    return cache.pool.k[layer][:, table.tables[0].slots(cache.pool, table.length, CPU)]


def test_block_hashes_are_chained_and_only_full_blocks() -> None:
    a = list(range(2 * BLOCK + 5))
    assert len(block_hashes(a)) == 2
    b = [99] + a[1:]  # same second block, different first block
    assert block_hashes(a)[1] != block_hashes(b)[1]
    assert block_hashes(a, limit=BLOCK + 3) == block_hashes(a)[:1]


def test_index_finds_the_longest_and_forgets_removed() -> None:
    idx = PrefixIndex()
    base = list(range(3 * BLOCK))
    idx.add("short", base[: BLOCK + 1])
    idx.add("long", base)
    assert idx.longest(base + [7]) == ("long", 3)
    idx.remove("long")
    assert idx.longest(base) == ("short", 1)
    idx.remove("short")
    assert idx.longest(base) == (None, 0)


def test_share_holds_the_common_prefix_by_reference_and_keeps_the_donor() -> None:
    cache = new_cache(10_000)
    system = list(range(100, 100 + 2 * BLOCK + 6))
    donor_tokens = system + [1, 2, 3]
    donor = filled(cache, donor_tokens)
    cache.put("donor", donor, donor_tokens, 0)
    cache.put("other", filled(cache, [5] * 40), [5] * 40, 0)
    prompt = system + [9, 9]
    used = cache.pool.used_blocks
    kv, reuse = cache.share(prompt, 0)
    assert reuse == len(system)  # exact common prefix, past the last full block
    assert kv.length == reuse and kv.tables[0].blocks == donor.tables[0].blocks[: kv.num_blocks]
    assert cache.pool.used_blocks == used  # no copy: the donor's blocks are shared
    assert torch.equal(keys(cache, kv), keys(cache, donor)[:, :reuse])
    assert list(cache.idle) == ["other", "donor"]  # donor stays, now most recently used
    assert cache.idle_tokens == len(donor_tokens) + 40


def test_share_leaves_one_token_and_needs_a_full_block() -> None:
    cache = new_cache(10_000)
    tokens = list(range(2 * BLOCK))
    cache.put("d", filled(cache, tokens), tokens, 0)
    kv, reuse = cache.share(tokens, 0)  # the whole prompt is cached: one token left to feed
    assert reuse == len(tokens) - 1
    assert cache.share(list(range(BLOCK - 1)), 0) == (None, 0)
    assert cache.share([7] + tokens[1:], 0) == (None, 0)


def test_evicted_or_taken_sessions_are_no_donors() -> None:
    cache = new_cache(3 * BLOCK)
    tokens = list(range(2 * BLOCK))
    cache.put("d", filled(cache, tokens), tokens, 0)
    assert cache.reserve(cache.blocks_for(2 * BLOCK))  # evicts d
    assert cache.share(tokens + [1], 0) == (None, 0)
    cache.unreserve(cache.blocks_for(2 * BLOCK))
    cache.put("e", filled(cache, tokens), tokens, 0)
    cache.take("e", tokens + [1], 0)
    assert cache.share(tokens + [1], 0) == (None, 0)


def test_shared_hits_are_counted() -> None:
    cache = new_cache(10_000)
    cache.record("s", 100, 64, shared=True)
    cache.record("t", 50, 49)
    assert (cache.stats.queries_tokens, cache.stats.hit_tokens, cache.stats.shared_hit_tokens) == (150, 113, 64)


def test_blocks_are_keyed_by_version_namespace() -> None:
    """KV computed under one adapter version is never offered to a prompt on another."""
    tokens = list(range(3 * BLOCK))
    assert block_hashes(tokens, namespace=1) != block_hashes(tokens, namespace=2)
    idx = PrefixIndex()
    idx.add("v1", tokens, namespace=1)
    assert idx.longest(tokens, namespace=2) == (None, 0)
    assert idx.longest(tokens, namespace=1) == ("v1", 3)


def test_share_and_take_refuse_another_namespace() -> None:
    cache = new_cache(10_000)
    tokens = list(range(2 * BLOCK + 3))
    cache.put("d", filled(cache, tokens), tokens, 1)
    assert cache.share(tokens + [5], 2) == (None, 0)
    kv, reuse = cache.share(tokens + [5], 1)
    assert reuse == len(tokens)
    cache.add_running("r", filled(cache, tokens), tokens, 3)
    assert cache.share(tokens + [5], 4) == (None, 0)
    assert cache.share(tokens + [5], 3)[1] == len(tokens)
    # a session id reused on another version (released, then begun again) starts cold
    assert cache.take("d", tokens + [5], 2) == (None, 0)
    assert cache.cached_length("d") == 0 and cache.idle_tokens == 0


def test_a_hash_collision_across_namespaces_is_not_copied(monkeypatch) -> None:
    """Even when the index hands back a donor of another namespace, share refuses to copy it."""
    cache = new_cache(10_000)
    tokens = list(range(2 * BLOCK + 3))
    cache.put("d", filled(cache, tokens), tokens, 1)
    monkeypatch.setattr(cache.prefixes, "longest", lambda prompt, ns=0: ("d", 2))
    assert cache.share(tokens + [5], 2) == (None, 0)
