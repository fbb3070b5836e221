"""Paged KV (inference/paged.py): exact attention over block tables, and memory bounded by the pool."""

from __future__ import annotations

import random

import pytest
import torch

from burstrl.inference.generic import GenericRunner
from burstrl.inference.paged import BlockTable, KVPool, OutOfBlocks, SequenceKV
from burstrl.inference.paged_attention import PagedDecode, PagedPrefill, RowsOutOfBlocks, _length_groups
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
                  blocks, block_size, runner.layer_windows)


def paged_logprobs(runner, pool: KVPool, seqs: list[torch.Tensor], prefill: int) -> list[torch.Tensor]:
    """Prefill each sequence's first `prefill` tokens (packed), then decode the rest together
    (rows leave when their sequence ends). -> per sequence [len, V] log-probabilities."""
    tables = [SequenceKV.new(pool) for _ in seqs]
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
    got = paged_logprobs(runner, pool_for(runner, blocks=32, block_size=3), [probe_ids(256, n)[0] for n in (11, 20)],
                         prefill=4)
    for g, w in zip(got, want, strict=True):
        assert (g - w).abs().max().item() < 1e-4


def test_a_shared_prefix_is_reused_without_a_copy_and_stays_exact(qwen3) -> None:
    runner = ModelRunner(qwen3)
    pool = pool_for(runner, blocks=16)
    seq = probe_ids(256, 20)[0]
    donor = SequenceKV.new(pool)
    att = PagedPrefill(pool, [donor], [12], runner.scaling)
    runner.forward(seq[None, :12], torch.arange(12)[None], att)
    att.commit()
    child = donor.fork_prefix(pool, 12)  # 3 full blocks of 4, shared
    assert child.tables[0].blocks == donor.tables[0].blocks[:3] and child.length == 12
    assert pool.refs[donor.tables[0].blocks[0]] == 2
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
    short = [SequenceKV.new(pool) for _ in range(64)]
    att = PagedPrefill(pool, short, [3] * 64, runner.scaling)
    runner.forward(torch.randint(0, 256, (1, 192)), torch.arange(3).repeat(64)[None], att)
    att.commit()
    free = pool.free_blocks
    long = SequenceKV.new(pool)
    with pytest.raises(OutOfBlocks):
        PagedPrefill(pool, [long], [3000], runner.scaling)
    assert long.num_blocks == 0 and pool.free_blocks == free and pool.nbytes == nbytes
    step = PagedDecode(pool, short, runner.scaling)
    step.prepare()
    held = sum(t.length + 1 for t in short)
    padded = sum(part.shape[0] * part.shape[1] for row_group in step.groups for part in row_group)
    assert padded <= 2 * held + PagedDecode.SLACK + 16 * len(short)  # padding bounded by what is held (+ block rounding)
    runner.forward(torch.randint(0, 256, (64, 1)), step.positions, step)
    step.advance()
    assert pool.nbytes == nbytes


def test_rows_that_cannot_get_a_slot_are_named_and_take_nothing(qwen3) -> None:
    runner = ModelRunner(qwen3)
    pool = pool_for(runner, blocks=2, block_size=4)
    a, b = SequenceKV.new(pool), SequenceKV.new(pool)
    att = PagedPrefill(pool, [a, b], [4, 3], runner.scaling)
    runner.forward(torch.randint(0, 256, (1, 7)), torch.tensor([[0, 1, 2, 3, 0, 1, 2]]), att)
    att.commit()
    step = PagedDecode(pool, [a, b], runner.scaling)
    with pytest.raises(RowsOutOfBlocks) as err:
        step.prepare()
    assert err.value.rows == [0] and a.num_blocks == 1 and b.num_blocks == 1  # b's next slot is in its block


def _write(pool: KVPool, table: BlockTable, value: float) -> None:
    """Append one token whose key is `value` (through reserve, as the engine writes)."""
    table.reserve(pool, table.length + 1)
    pool.k[0][:, table.slots(pool, table.length + 1, torch.device("cpu"))[-1]] = value
    table.length += 1


def test_random_joins_forks_writes_truncations_and_leaves_keep_every_table_exact() -> None:
    """Each table's keys stay what it wrote (copy-on-write of shared, partly used blocks), and every
    block is held exactly as often as tables list it."""
    pool = KVPool(1, 1, 1, torch.float32, torch.device("cpu"), num_blocks=40, block_size=4)
    rng = random.Random(0)
    tables: list[tuple[BlockTable, list[float]]] = []
    for step in range(3000):
        op = rng.random()
        try:
            if op < 0.15 or not tables:
                tables.append((BlockTable(), []))
            elif op < 0.55:
                table, want = rng.choice(tables)
                for _ in range(rng.randint(1, 6)):
                    _write(pool, table, float(step))
                    want.append(float(step))
            elif op < 0.7:
                table, want = rng.choice(tables)
                n = rng.randint(0, table.length)
                tables.append((table.fork_prefix(pool, n), want[:n]))
            elif op < 0.85:
                table, want = rng.choice(tables)
                n = rng.randint(0, table.length)
                table.truncate(pool, n)
                del want[n:]
            else:
                table, _ = tables.pop(rng.randrange(len(tables)))
                table.release(pool)
        except OutOfBlocks:
            pass
        held: dict[int, int] = {}
        for table, want in tables:
            assert table.length == len(want) and len(table.blocks) >= -(-table.length // 4)
            got = pool.k[0][:, table.slots(pool, table.length, torch.device("cpu"))].flatten().tolist()
            assert got == want
            for blk in table.blocks:
                held[blk] = held.get(blk, 0) + 1
        assert all(pool.refs[blk] == n for blk, n in held.items())
        assert pool.free_blocks + len(held) == pool.num_blocks


def test_a_prefix_forked_mid_block_from_a_decoding_donor_stays_exact(qwen3) -> None:
    """The donor keeps decoding into the block it shares; the child reads what it was given."""
    runner = ModelRunner(qwen3)
    pool = pool_for(runner, blocks=32)
    seq = probe_ids(256, 24)[0]
    want = reference_logprobs(qwen3, seq[None])
    donor = SequenceKV.new(pool)
    att = PagedPrefill(pool, [donor], [10], runner.scaling)
    runner.forward(seq[None, :10], torch.arange(10)[None], att)
    att.commit()
    child = donor.fork_prefix(pool, 10)  # 2 full blocks and half of the third, all shared
    assert child.tables[0].blocks == donor.tables[0].blocks and pool.refs[donor.tables[0].blocks[2]] == 2
    other = seq.clone()
    other[10:] = (seq[10:] + 1) % 256  # the donor continues differently from the child
    for t in range(10, 16):
        step = PagedDecode(pool, [donor], runner.scaling)
        step.prepare()
        runner.forward(other[None, t:t + 1], step.positions, step)
        step.advance()
    assert donor.tables[0].blocks[2] != child.tables[0].blocks[2]  # the donor copied before writing into the shared block
    att = PagedPrefill(pool, [child], [14], runner.scaling)
    logits = runner.forward(seq[None, 10:], torch.arange(10, 24)[None], att, all_logits=True)[0]
    att.commit()
    assert (torch.log_softmax(logits.float(), -1) - want[10:]).abs().max().item() < 1e-4
    donor.release(pool)
    child.release(pool)
    assert pool.free_blocks == 32


def test_a_long_row_among_short_ones_is_grouped_apart_and_padding_stays_bounded() -> None:
    lens = [4] * 64 + [3000]
    groups = _length_groups(lens, slack=1024)
    assert sorted(i for g in groups for i in g) == list(range(65))
    assert all(len(g) * max(lens[i] for i in g) <= 2 * sum(lens[i] for i in g) + 1024 for g in groups)
    assert sum(len(g) * max(lens[i] for i in g) for g in groups) < 3 * sum(lens)  # not 65 x 3000
    assert _length_groups([100, 90, 120, 5], slack=1024) == [[0, 1, 2, 3]]  # a usual batch: one group, in order
    rng = random.Random(1)
    for _ in range(200):
        lens = [rng.choice([1, 7, 50, 400, 5000]) + rng.randrange(20) for _ in range(rng.randrange(1, 40))]
        groups = _length_groups(lens, slack=64)
        assert sorted(i for g in groups for i in g) == list(range(len(lens)))
        assert all(len(g) * max(lens[i] for i in g) <= 2 * sum(lens[i] for i in g) + 64 for g in groups)


def test_decode_over_several_length_groups_is_exact(qwen3) -> None:
    """Rows of very different lengths split into groups (small slack forces it); logprobs stay exact."""
    runner = ModelRunner(qwen3)
    pool = pool_for(runner, blocks=64)
    seqs = [probe_ids(256, n)[0] for n in (40, 6, 24, 9)]
    tables = [SequenceKV.new(pool) for _ in seqs]
    for table, seq in zip(tables, seqs, strict=True):
        att = PagedPrefill(pool, [table], [len(seq) - 3], runner.scaling)
        runner.forward(seq[None, :-3], torch.arange(len(seq) - 3)[None], att)
        att.commit()
    step = PagedDecode(pool, tables, runner.scaling)
    step.SLACK = 0
    step.prepare()
    assert len(step.groups) > 1
    ids = torch.stack([s[-3] for s in seqs])[:, None]
    logits = runner.forward(ids, step.positions, step)
    for row, seq in enumerate(seqs):
        want = reference_logprobs(qwen3, seq[None])[-3]
        assert (torch.log_softmax(logits[row].float(), -1) - want).abs().max().item() < 1e-4


def test_stale_non_finite_keys_in_reused_blocks_never_reach_another_row(qwen3) -> None:
    """Blocks last held by a request whose adapter produced NaN: the next holders read padding and
    slots past their length from them (masked, yet 0 x NaN = NaN), so allocation zeroes them."""
    runner = ModelRunner(qwen3)
    pool = pool_for(runner, blocks=16)
    for t in (*pool.k, *pool.v):
        t.fill_(float("nan"))
    seqs = [probe_ids(256, 13)[0], probe_ids(256, 5)[0]]
    logprobs = paged_logprobs(runner, pool, seqs, prefill=3)
    for seq, got in zip(seqs, logprobs, strict=True):
        assert torch.isfinite(got).all()
        assert (got - reference_logprobs(qwen3, seq[None])).abs().max().item() < 1e-4
