"""Window-only KV (inference/paged.py layer groups, paged_attention.py, kvcache.py): sliding-window
layers keep only their window (+ WINDOW_MARGIN), results stay exact past the window, memory stays
bounded by the reservations, and resuming / sharing refuses what a sliding layer let go."""

from __future__ import annotations

import pytest
import torch

from burstrl.inference.generic import GenericRunner
from burstrl.inference.kvcache import SessionCache
from burstrl.inference.paged import WINDOW_MARGIN, KVPool, SequenceKV, layer_groups
from burstrl.inference.paged_attention import PagedDecode, PagedPrefill
from burstrl.inference.probe import reference_logprobs
from burstrl.inference.runner import ModelRunner

SHAPE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, max_position_embeddings=512)
WINDOW, BS = 5, 4
MARGIN = 12  # the pools' window margin here (the engine's is WINDOW_MARGIN): short sequences pass it
S, F = "sliding_attention", "full_attention"
SHAPES = {"2 groups of 2": [S, F, S, F], "4 groups of 1": [S, S, S, F]}
CPU = torch.device("cpu")
# most blocks a sliding table may list at any moment (window + margin, two partly used blocks)
SLIDING_CAP = -(-(WINDOW + MARGIN) // BS) + 2


def gemma(layer_types: list[str]):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    cfg = Gemma3TextConfig(**SHAPE, num_hidden_layers=len(layer_types), sliding_window=WINDOW,
                           query_pre_attn_scalar=16, layer_types=layer_types)
    return Gemma3ForCausalLM(cfg).eval()


def tokens(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed))


def pool_for(runner, tokens: int = 2048) -> KVPool:
    return KVPool.for_tokens(tokens, runner.num_layers, runner.num_kv_heads, runner.head_dim, runner.dtype,
                             runner.device, BS, runner.layer_windows, window_margin=MARGIN)


def prefill(runner, pool: KVPool, seqs: list[SequenceKV], chunks: list[torch.Tensor]) -> list[torch.Tensor]:
    """Packed prefill of each sequence's next tokens (from its length); -> per sequence [n, V] logprobs."""
    att = PagedPrefill(pool, seqs, [len(c) for c in chunks], runner.scaling)
    ids = torch.cat(chunks)[None]
    positions = torch.cat([torch.arange(s.length, s.length + len(c)) for s, c in zip(seqs, chunks, strict=True)])[None]
    logits = runner.forward(ids, positions, att, all_logits=True)[0]
    att.commit()
    out, off = [], 0
    for c in chunks:
        out.append(torch.log_softmax(logits[off:off + len(c)].float(), dim=-1))
        off += len(c)
    return out


def decode(runner, pool: KVPool, seq: SequenceKV, ids: torch.Tensor) -> list[torch.Tensor]:
    """Feed `ids` one decode step at a time; -> [len(ids), V] logprobs."""
    rows = []
    for t in ids:
        step = PagedDecode(pool, [seq], runner.scaling)
        step.prepare()
        rows.append(runner.forward(t.view(1, 1), step.positions, step))
        step.advance()
    return torch.log_softmax(torch.cat(rows).float(), dim=-1)


def sliding_start(pool: KVPool, seq: SequenceKV) -> int:
    return max(t.start(pool) for t, w in zip(seq.tables, pool.group_windows, strict=True) if w is not None)


# ---- 1: layer groups and the pool's memory ----

def test_layer_groups_split_layers_into_equal_groups_of_one_span() -> None:
    """A physical block holds one group's layers, so groups must be of one span and one size:
    Gemma 3 270M (every 6th layer global) is five sliding groups and one global group of 3."""
    gemma270m = [None if (i + 1) % 6 == 0 else 512 for i in range(18)]
    groups = layer_groups(gemma270m)
    assert len(groups) == 6 and all(len(g) == 3 for g in groups)
    assert [5, 11, 17] in groups
    assert sorted(i for g in groups for i in g) == list(range(18))
    assert all(len({gemma270m[i] for i in g}) == 1 for g in groups)
    assert layer_groups([None] * 7) == [list(range(7))]  # no windows: one table per sequence
    assert sorted(layer_groups([5, None, 5, None])) == [[0, 2], [1, 3]]
    assert sorted(layer_groups([5, 5, None, None])) == [[0, 1], [2, 3]]
    assert sorted(layer_groups([5, 5, 5, None])) == [[0], [1], [2], [3]]  # gcd(3, 1) = 1


@pytest.mark.parametrize("windows", [[None, 512, None, 512] * 3, [512] * 5 + [None], [7, 7, 7, None], [None] * 4])
def test_a_windowed_pool_keeps_the_memory_of_its_token_budget_in_every_layer(windows) -> None:
    """The token budget is memory: a pool split into layer groups must cost what a windowless pool
    of the same budget costs (more blocks, each of fewer layers), and hold `tokens` slots per layer."""
    layers = len(windows)
    pool = KVPool.for_tokens(640, layers, 2, 8, torch.float32, CPU, 16, windows)
    plain = KVPool.for_tokens(640, layers, 2, 8, torch.float32, CPU, 16)
    assert pool.nbytes == plain.nbytes == 2 * layers * 2 * 640 * 8 * 4
    assert pool.num_blocks == 640 // 16 * len(layer_groups(windows)) == pool.sequence_blocks * plain.num_blocks
    assert all(pool.group_windows[pool.where[layer][0]] == w for layer, w in enumerate(windows))


def test_gemma_270m_pattern_holds_a_long_sequence_in_a_fraction_of_the_windowless_memory() -> None:
    """What window-only KV is for: 8,000 tokens of Gemma 3 270M's layout (15 sliding layers of
    512) hold the full length only in the 3 global layers; the rest hold window + margin."""
    windows = [None if (i + 1) % 6 == 0 else 512 for i in range(18)]
    pool = KVPool.for_tokens(8192, 18, 1, 1, torch.float32, CPU, 16, windows)
    plain = KVPool.for_tokens(8192, 18, 1, 1, torch.float32, CPU, 16)
    seq, flat = SequenceKV.new(pool), SequenceKV.new(plain)
    peak, steady = seq.blocks_needed(pool, 1000, 8000)
    for chunk in [1000] + [7] * 1000:  # a prefill, then steps of a few tokens
        seq.reserve(pool, seq.length + chunk)
        assert seq.num_blocks <= (peak if seq.length < 1000 else steady)
        seq.advance(pool, chunk)
        flat.reserve(plain, flat.length + chunk)
        flat.advance(plain, chunk)
    assert seq.length == flat.length == 8000
    used = pool.used_blocks * pool.nbytes // pool.num_blocks
    plain_used = plain.used_blocks * plain.nbytes // plain.num_blocks
    assert used < 0.3 * plain_used
    assert steady * pool.nbytes // pool.num_blocks < 0.3 * plain_used  # the reservation is small too


# ---- 2, 3: exact past the window, memory bounded while decoding ----

LENGTHS, PREFILLS = (60, 45), (30, 10)  # one prefill already past window + margin, one not


def run_window(runner, pool: KVPool, seqs: list[torch.Tensor]) -> dict:
    """Prefill each sequence's PREFILLS tokens (packed), then decode the rest together (rows leave
    when done); snapshots of every table after each reservation and each advance."""
    kvs = [SequenceKV.new(pool) for _ in seqs]
    plans = [kv.blocks_needed(pool, p, len(s)) for kv, p, s in zip(kvs, PREFILLS, seqs, strict=True)]
    snaps: list[tuple] = []  # (phase, sequence, length, num_blocks, [(window, first, blocks, length)] per group)

    def snap(phase: str, i: int) -> None:
        kv = kvs[i]
        snaps.append((phase, i, kv.length, kv.num_blocks,
                      [(w, t.first, len(t.blocks), t.length) for t, w in zip(kv.tables, pool.group_windows,
                                                                             strict=True)]))

    att = PagedPrefill(pool, kvs, list(PREFILLS), runner.scaling)
    for i in range(len(kvs)):
        snap("prefill reserved", i)
    ids = torch.cat([s[:p] for s, p in zip(seqs, PREFILLS, strict=True)])[None]
    positions = torch.cat([torch.arange(p) for p in PREFILLS])[None]
    logits = runner.forward(ids, positions, att, all_logits=True)[0]
    att.commit()
    out, off = [], 0
    for i, p in enumerate(PREFILLS):
        out.append([logits[off:off + p]])
        off += p
        snap("prefilled", i)
    live = list(range(len(seqs)))
    while live:
        step = PagedDecode(pool, [kvs[i] for i in live], runner.scaling)
        step.prepare()
        for i in live:
            snap("step reserved", i)
        rows = runner.forward(torch.stack([seqs[i][kvs[i].length] for i in live])[:, None], step.positions, step)
        step.advance()
        for j, i in enumerate(live):
            out[i].append(rows[j:j + 1])
            snap("advanced", i)
        live = [i for i in live if kvs[i].length < len(seqs[i])]
    result = dict(logprobs=[torch.log_softmax(torch.cat(o).float(), dim=-1) for o in out], plans=plans,
                  snaps=snaps, used_blocks=pool.used_blocks,
                  final=[[(w, t.first, len(t.blocks)) for t, w in zip(kv.tables, pool.group_windows, strict=True)]
                         for kv in kvs])
    for kv in kvs:
        kv.release(pool)
    result["free_after"] = pool.free_blocks
    return result


@pytest.fixture(scope="module")
def runs() -> dict:
    """Both runners over both layer-group shapes, each over its own pool built from runner.layer_windows."""
    seqs = [tokens(n, seed=i) for i, n in enumerate(LENGTHS)]
    out = {}
    for name, types in SHAPES.items():
        model = gemma(types)
        want = [reference_logprobs(model, s[None]) for s in seqs]  # before GenericRunner swaps the attention
        for runner in (ModelRunner(model), GenericRunner(model)):
            pool = pool_for(runner)
            out[name, runner.path] = dict(run_window(runner, pool, seqs), want=want, pool=pool, runner=runner)
    return out


KEYS = [(name, path) for name in SHAPES for path in ("fast", "generic")]


@pytest.mark.parametrize("key", KEYS, ids=[f"{n}-{p}" for n, p in KEYS])
def test_logprobs_stay_exact_past_the_window_with_leading_blocks_dropped(runs, key) -> None:
    """Sliding groups let go of blocks before length - window - margin during the prefill commit
    and while decoding; what the model still attends to must be intact (HF forward, 1e-4)."""
    run = runs[key]
    pool, runner = run["pool"], run["runner"]
    assert runner.layer_windows == [WINDOW if t == S else None for t in SHAPES[key[0]]]
    assert pool.groups == layer_groups(runner.layer_windows) and len(pool.groups) == int(key[0][0])
    for got, want, n in zip(run["logprobs"], run["want"], LENGTHS, strict=True):
        assert got.shape == want.shape == (n, 256)
        assert (got - want).abs().max().item() < 1e-4
    for final, n in zip(run["final"], LENGTHS, strict=True):
        for window, first, _ in final:
            if window is None:
                assert first == 0
            else:  # really dropped: up to the window + margin before the end
                assert first == (n - WINDOW - MARGIN) // BS > 0
    assert run["free_after"] == pool.num_blocks  # every block back after release


@pytest.mark.parametrize("key", KEYS, ids=[f"{n}-{p}" for n, p in KEYS])
def test_tables_stay_within_their_window_and_their_reservation_at_every_step(runs, key) -> None:
    """The engine reserves blocks_needed's peak at admission and only steady after the prefill:
    a table that listed more at any moment could run the pool dry under a running request."""
    run = runs[key]
    pool = run["pool"]
    seen_prefill_peak = False
    for phase, i, length, num_blocks, tables in run["snaps"]:
        peak, steady = run["plans"][i]
        full = -(-LENGTHS[i] // BS) * len(pool.groups)
        assert steady < full  # a windowed sequence reserves less than its full length
        if phase == "prefill reserved":
            assert num_blocks <= peak
            seen_prefill_peak |= any(w is not None and blocks > SLIDING_CAP for w, _, blocks, _ in tables)
            continue
        assert num_blocks <= steady, (phase, length)
        reserved = length + (phase == "step reserved")  # prepare took the next token's slot
        for window, first, blocks, _ in tables:
            if window is None:
                assert first == 0 and blocks == -(-reserved // BS)
            else:
                assert blocks <= SLIDING_CAP - (phase == "advanced")
                # still holds what the next query sees, and let go of what is before window + margin
                assert first * BS <= length - WINDOW + 1
                assert first * BS > length - WINDOW - MARGIN - BS
    assert seen_prefill_peak  # the 30-token prefill briefly held more than a window in sliding groups
    assert run["plans"][0][0] > run["plans"][0][1]  # and blocks_needed's peak says so
    # after the run: exactly the window's blocks in sliding groups, far below a windowless pool
    per_block = pool.nbytes // pool.num_blocks
    windowless = sum(-(-n // BS) for n in LENGTHS) * per_block * len(pool.groups)
    expected = sum(-(-n // BS) - ((n - WINDOW - MARGIN) // BS if w is not None else 0)
                   for n in LENGTHS for w in pool.group_windows)
    assert run["used_blocks"] == expected
    assert run["used_blocks"] * per_block < 0.85 * windowless


# ---- 4, 5, 6: sessions over a windowed pool ----

P = 38  # a prompt past window + margin, ending in a partly used block


@pytest.fixture(scope="module")
def fast():
    """(model, fast runner) of 3 sliding layers and one global layer: 4 groups of 1."""
    model = gemma(SHAPES["4 groups of 1"])
    return model, ModelRunner(model)


def check_idle(cache: SessionCache) -> None:
    pool = cache.pool
    assert cache.idle_tokens == sum(e.table.held_tokens(pool) for e in cache.idle.values())
    assert cache.idle_blocks == sum(e.table.num_blocks for e in cache.idle.values())


def test_a_session_resumes_past_the_window_exactly_and_refuses_what_it_let_go(fast) -> None:
    """A session longer than window + margin resumes from anywhere its sliding tables still hold
    the next query's window (down to start + window - 1); one token earlier it must be refused
    (the keys are gone), counted as a window miss, and its blocks go back to the pool."""
    model, runner = fast
    pool = pool_for(runner)
    cache = SessionCache(pool, thrash_window_s=60)
    seq = tokens(P, seed=7)
    kvs = [SequenceKV.new(pool) for _ in range(4)]
    prefill(runner, pool, kvs, [seq] * 4)
    start = sliding_start(pool, kvs[0])
    assert start == (P - WINDOW - MARGIN) // BS * BS > WINDOW
    boundary = start + WINDOW - 1  # the first resumable length: its query sees keys from `start`
    for name, kv in zip("abcd", kvs, strict=True):
        cache.put(name, kv, seq.tolist(), 0)
    check_idle(cache)
    assert cache.idle_tokens == 4 * (P + 3 * (P - start))

    def resume(name: str, cut: int, tail: torch.Tensor) -> None:
        if cut < P:
            tail[0] = (seq[cut] + 1) % 256  # diverges exactly at `cut`
        prompt = torch.cat([seq[:cut], tail])
        want = reference_logprobs(model, prompt[None])[cut:]
        kv, reuse = cache.take(name, prompt.tolist(), 0)
        assert kv is not None and reuse == cut == kv.length
        assert sliding_start(pool, kv) == start  # the resumed table still lacks its leading blocks
        got = prefill(runner, pool, [kv], [tail])[0]
        assert (got - want).abs().max().item() < 1e-4
        kv.release(pool)

    resume("a", P, tokens(40, seed=8))  # the next call extends the last one
    resume("b", P - 8, tokens(20, seed=9))  # re-renders the last tokens (within the margin)
    resume("c", boundary, tokens(20, seed=10))  # the earliest point still resumable
    assert cache.stats.window_misses == 0
    used, held = pool.used_blocks, cache.idle["d"].table.num_blocks
    diverged = torch.cat([seq[:boundary - 1], (seq[boundary - 1:] + 1) % 256]).tolist()
    assert cache.take("d", diverged, 0) == (None, 0)
    assert cache.stats.window_misses == 1
    assert "d" not in cache.idle and cache.idle_tokens == 0 and cache.idle_blocks == 0
    assert pool.used_blocks == used - held == 0
    check_idle(cache)


def test_a_prefix_is_shared_past_the_window_until_the_donor_lets_it_go(fast) -> None:
    """A running donor's prompt (past window + margin) is shared by reference and continued
    exactly, even after the donor drops the blocks they share. Once the donor has decoded more
    than the margin further, its sliding tables no longer hold the prompt's last window:
    a share needing it must be refused (window miss), running or idle, without taking a block."""
    model, runner = fast
    pool = pool_for(runner)
    cache = SessionCache(pool, thrash_window_s=60)
    seq = tokens(P + 40, seed=11)
    want = reference_logprobs(model, seq[None])
    donor = SequenceKV.new(pool)
    prefill(runner, pool, [donor], [seq[:P]])
    cache.add_running("d", donor, seq[:P].tolist(), 0)
    used = pool.used_blocks
    child, reuse = cache.share(seq.tolist(), 0)
    assert child is not None and reuse == P == child.length
    assert pool.used_blocks == used  # shared by reference, not copied
    assert [(t.first, t.blocks) for t in child.tables] == [(t.first, t.blocks) for t in donor.tables]
    assert sliding_start(pool, child) > 0
    further = (tokens(MARGIN + 12, seed=12) + 1) % 256
    further[0] = (seq[P] + 1) % 256  # the donor continues differently from the child
    decode(runner, pool, donor, further)  # writes into the shared last block (copy-on-write), drops shared blocks
    assert sliding_start(pool, donor) > P - WINDOW + 1
    got = prefill(runner, pool, [child], [seq[P:]])[0]
    assert (got - want[P:]).abs().max().item() < 1e-4
    child.release(pool)

    used = pool.used_blocks
    assert cache.share(seq.tolist(), 0) == (None, 0)  # the running donor dropped the prompt's window
    assert cache.stats.window_misses == 1 and pool.used_blocks == used
    cache.remove_running("d")
    donor_tokens = torch.cat([seq[:P], further])
    cache.put("d", donor, donor_tokens.tolist(), 0)
    check_idle(cache)
    assert cache.share(seq.tolist(), 0) == (None, 0)  # idle, same refusal
    assert cache.stats.window_misses == 2 and pool.used_blocks == used
    tail = tokens(10, seed=13)
    whole = torch.cat([donor_tokens, tail])
    child, reuse = cache.share(whole.tolist(), 0)  # the donor's whole length is still resumable
    assert child is not None and reuse == len(donor_tokens) and pool.used_blocks == used
    got = prefill(runner, pool, [child], [tail])[0]
    assert (got - reference_logprobs(model, whole[None])[len(donor_tokens):]).abs().max().item() < 1e-4
    assert cache.stats.window_misses == 2
    child.release(pool)
    cache.drop("d")
    assert pool.used_blocks == 0


def test_used_tokens_and_capacity_count_tokens_of_every_layers_memory() -> None:
    """The router reads used_tokens against capacity: both must be tokens of every layer's memory
    (group-tokens / groups), so a windowed pool's capacity is the budget it was built for, and a
    long sequence uses less of it than its length."""
    windows = [WINDOW, WINDOW, WINDOW, None]
    budget = 1024
    pool = KVPool.for_tokens(budget, 4, 2, 8, torch.float32, CPU, BS, windows)
    cache = SessionCache(pool, thrash_window_s=60)
    groups = len(pool.groups)
    assert groups == 4 and cache.capacity == budget and pool.window_margin == WINDOW_MARGIN == 128  # the engine's
    assert cache.capacity * 2 * 4 * 2 * 8 * 4 == pool.nbytes  # k and v, 4 layers, 2 KV heads, dim 8, fp32
    seq = SequenceKV.new(pool)
    peak, steady = seq.blocks_needed(pool, 180, 240)
    assert cache.reserve(peak) and cache.reserved == peak * BS // groups
    att = PagedPrefill(pool, [seq], [180], 1.0)
    cache.hold_running(att.commit())
    cache.unreserve(peak - steady)
    for _ in range(60):
        step = PagedDecode(pool, [seq], 1.0)
        step.prepare()  # no forward needed: the accounting is the tables'
        cache.hold_running(step.advance())
        assert cache.running_tokens == seq.held_tokens(pool)
        assert cache.used_tokens == seq.held_tokens(pool) // groups
        assert pool.used_blocks <= cache.reserved_blocks == steady
    start = sliding_start(pool, seq)
    assert seq.held_tokens(pool) == 240 + 3 * (240 - start)
    assert cache.used_tokens == (240 + 3 * (240 - start)) // 4 < 240
    cache.release_running(seq.held_tokens(pool))
    cache.unreserve(steady)
    cache.put("s", seq, list(range(240)), 0)
    assert cache.running_tokens == 0 and cache.idle_tokens == seq.held_tokens(pool)
    assert cache.used_tokens == (240 + 3 * (240 - start)) // 4
    assert cache.reserved_total == seq.num_blocks * BS // groups == pool.used_blocks * BS // groups
    check_idle(cache)


def test_a_next_prompt_sharing_nothing_with_a_long_session_is_not_a_window_miss() -> None:
    """window_misses counts reuses a sliding layer's dropped keys refused; a prompt with no token in
    common with the session (an agent that starts over) could reuse nothing with or without windows,
    so it is not one (share already returns before its window check when nothing is common)."""
    pool = KVPool.for_tokens(1024, 4, 2, 8, torch.float32, CPU, BS, [WINDOW, WINDOW, WINDOW, None],
                             window_margin=MARGIN)
    cache = SessionCache(pool, thrash_window_s=60)
    seq = SequenceKV.new(pool)
    seq.reserve(pool, P)
    seq.advance(pool, P)  # the keys' values do not matter here
    assert sliding_start(pool, seq) > 0
    cache.put("s", seq, list(range(P)), 0)
    kv, reuse = cache.take("s", [999] + list(range(1, 50)), 0)
    assert reuse == 0 and (kv is None or kv.length == 0)
    assert cache.stats.window_misses == 0
    if kv is not None:
        kv.release(pool)
    assert pool.used_blocks == 0 and cache.idle_blocks == 0 and cache.idle_tokens == 0
