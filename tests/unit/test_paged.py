"""Paged KV (inference/paged.py): exact attention over block tables, and memory bounded by the pool.

Not yet the engine's storage (issue 33's next step wires it in); these tests pin its contract.
"""

from __future__ import annotations

import random

import pytest
import torch

from burstrl.inference.generic import GenericRunner
from burstrl.inference.paged import BlockTable, KVPool, OutOfBlocks, PagedDecode, PagedPrefill, RowsOutOfBlocks
from burstrl.inference.probe import probe_ids, reference_logprobs
from burstrl.inference.runner import ModelRunner

SHAPE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=256)


@pytest.fixture(scope="module")
def qwen3():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    return Qwen3ForCausalLM(Qwen3Config(**SHAPE)).eval()


def pool_for(runner, blocks: int, block_size: int = 4) -> KVPool:
    return KVPool(runner.num_layers, runner.num_kv_heads, runner.head_dim, runner.dtype, runner.device,
                  blocks, block_size)


def paged_logprobs(runner, pool: KVPool, seqs: list[torch.Tensor], prefill: int) -> list[torch.Tensor]:
    """Prefill each sequence's first `prefill` tokens (packed), then decode the rest together
    (rows leave when their sequence ends). -> per sequence [len, V] log-probabilities."""
    tables = [BlockTable() for _ in seqs]
    att = PagedPrefill(pool, tables, [prefill] * len(seqs), runner.scaling)
    ids = torch.cat([s[:prefill] for s in seqs])[None]
    positions = torch.cat([torch.arange(prefill)] * len(seqs))[None]
    logits = runner.forward(ids, positions, att, all_logits=True)[0]
    att.commit()
    out = [[logits[i * prefill:(i + 1) * prefill]] for i in range(len(seqs))]
    live = list(range(len(seqs)))
    while live:
        step = PagedDecode(pool, [tables[i] for i in live], runner.scaling)
        step.prepare()
        tokens = torch.stack([seqs[i][tables[i].length] for i in live])[:, None]
        rows = runner.forward(tokens, step.positions, step)
        step.advance()
        for j, i in enumerate(live):
            out[i].append(rows[j:j + 1])
        live = [i for i in live if tables[i].length < len(seqs[i])]
    for t in tables:
        t.release(pool)
    return [torch.log_softmax(torch.cat(o).float(), dim=-1) for o in out]


def test_prefill_then_ragged_decode_of_rows_of_different_lengths_is_exact(qwen3) -> None:
    runner = ModelRunner(qwen3)
    seqs = [probe_ids(256, n)[0] for n in (9, 14, 23)]
    seqs = [torch.roll(s, i) for i, s in enumerate(seqs)]  # different tokens per row
    pool = pool_for(runner, blocks=32)
    for seq, got in zip(seqs, paged_logprobs(runner, pool, seqs, prefill=5), strict=True):
        want = reference_logprobs(qwen3, seq[None])
        assert (got - want).abs().max().item() < 1e-4
    assert pool.free_blocks == 32  # every block back


def test_sliding_windows_across_block_boundaries_are_exact_on_gemma3() -> None:
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    cfg = Gemma3TextConfig(**SHAPE, sliding_window=5, query_pre_attn_scalar=16,
                           layer_types=["sliding_attention", "full_attention"])
    model = Gemma3ForCausalLM(cfg).eval()
    want = [reference_logprobs(model, probe_ids(256, n)) for n in (11, 20)]
    runner = GenericRunner(model)
    got = paged_logprobs(runner, pool_for(runner, blocks=16, block_size=3), [probe_ids(256, n)[0] for n in (11, 20)],
                         prefill=4)
    for g, w in zip(got, want, strict=True):
        assert (g - w).abs().max().item() < 1e-4


def test_a_shared_prefix_is_reused_without_a_copy_and_stays_exact(qwen3) -> None:
    runner = ModelRunner(qwen3)
    pool = pool_for(runner, blocks=16)
    seq = probe_ids(256, 20)[0]
    donor = BlockTable()
    att = PagedPrefill(pool, [donor], [12], runner.scaling)
    runner.forward(seq[None, :12], torch.arange(12)[None], att)
    att.commit()
    child = donor.fork_prefix(pool, 12)  # 3 full blocks of 4, shared
    assert child.blocks == donor.blocks[:3] and child.length == 12 and pool.refs[donor.blocks[0]] == 2
    used = pool.num_blocks - pool.free_blocks
    att = PagedPrefill(pool, [child], [8], runner.scaling)
    logits = runner.forward(seq[None, 12:], torch.arange(12, 20)[None], att, all_logits=True)[0]
    att.commit()
    assert pool.num_blocks - pool.free_blocks == used + 2  # only the suffix took blocks
    want = reference_logprobs(qwen3, seq[None])[12:]
    assert (torch.log_softmax(logits.float(), -1) - want).abs().max().item() < 1e-4
    donor.release(pool)
    child.release(pool)
    assert pool.free_blocks == 16


def test_the_decode_batch_attack_cannot_grow_memory_past_the_pool(qwen3) -> None:
    """64 short rows decoding and one long call (the attack that killed the padded decode batch):
    the pool is all the KV memory there is; the call that does not fit fails alone, nothing grows."""
    runner = ModelRunner(qwen3)
    pool = KVPool.for_tokens(1024, runner.num_layers, runner.num_kv_heads, runner.head_dim, runner.dtype,
                             runner.device, block_size=16)
    nbytes = pool.nbytes
    short = [BlockTable() for _ in range(64)]
    att = PagedPrefill(pool, short, [3] * 64, runner.scaling)
    runner.forward(torch.randint(0, 256, (1, 192)), torch.arange(3).repeat(64)[None], att)
    att.commit()
    free = pool.free_blocks
    long = BlockTable()
    with pytest.raises(OutOfBlocks):
        PagedPrefill(pool, [long], [3000], runner.scaling)
    assert long.blocks == [] and pool.free_blocks == free and pool.nbytes == nbytes
    step = PagedDecode(pool, short, runner.scaling)
    step.prepare()
    assert len(step.slots) == sum(t.length + 1 for t in short)  # what the step reads: tokens held, no padding
    runner.forward(torch.randint(0, 256, (64, 1)), step.positions, step)
    step.advance()
    assert pool.nbytes == nbytes


def test_rows_that_cannot_get_a_slot_are_named_and_take_nothing(qwen3) -> None:
    runner = ModelRunner(qwen3)
    pool = pool_for(runner, blocks=2, block_size=4)
    a, b = BlockTable(), BlockTable()
    att = PagedPrefill(pool, [a, b], [4, 3], runner.scaling)
    runner.forward(torch.randint(0, 256, (1, 7)), torch.tensor([[0, 1, 2, 3, 0, 1, 2]]), att)
    att.commit()
    step = PagedDecode(pool, [a, b], runner.scaling)
    with pytest.raises(RowsOutOfBlocks) as err:
        step.prepare()
    assert err.value.rows == [0] and len(a.blocks) == 1 and len(b.blocks) == 1  # b's next slot is in its block


def test_random_joins_forks_and_leaves_keep_every_block_accounted_for() -> None:
    pool = KVPool(1, 1, 2, torch.float32, torch.device("cpu"), num_blocks=40, block_size=4)
    rng = random.Random(0)
    tables: list[BlockTable] = []
    for _ in range(2000):
        op = rng.random()
        if op < 0.4 or not tables:
            t = BlockTable()
            try:
                t.reserve(pool, rng.randint(1, 30))
                t.length = rng.randint(0, t.capacity(4))
                tables.append(t)
            except OutOfBlocks:
                assert t.blocks == []
        elif op < 0.6:
            tables.append(rng.choice(tables).fork_prefix(pool, rng.randint(0, 30)))
        else:
            tables.pop(rng.randrange(len(tables))).release(pool)
        held: dict[int, int] = {}
        for t in tables:
            for blk in t.blocks:
                held[blk] = held.get(blk, 0) + 1
        assert all(pool.refs[blk] == n for blk, n in held.items())
        assert pool.free_blocks + len(held) == pool.num_blocks
