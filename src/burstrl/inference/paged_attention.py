"""Attention over paged KV (paged.py): a packed prefill and a decode step of many sequences.

Attention gathers a sequence's slots of the layer's group from the pool for the step (prefill:
one sequence's keys; decode: rows grouped by length, padded within a group at most 2x), so what
a step touches is bounded by the tokens held, not by rows x longest row. A sliding group's table
starts at `start` (blocks before its window were let go): its keys are gathered from there and
the masks are shifted by it. Shapes: q [B, H, T, D], k/v [B, KVH, T, D] as in runner.Attention.
"""

from __future__ import annotations

import torch

from burstrl.inference.paged import BlockTable, KVPool, OutOfBlocks, SequenceKV
from burstrl.inference.runner import PackedTokens, causal_attention


def _layer(pool: KVPool, layer: int, window: int | None) -> tuple[int, torch.Tensor, torch.Tensor]:
    """(group, k, v) of a layer; the pool's layout must keep every key the runner's window sees
    (all of them where the layout keeps no window: `engine.kv_window_only` off)."""
    kept = pool.windows[layer]
    if kept is not None and (window is None or window > kept):
        raise RuntimeError(f"layer {layer} attends with window {window}, the KV layout keeps only {kept}")
    g, i = pool.where[layer]
    return g, pool.k[i], pool.v[i]


class PagedPrefill(PackedTokens):
    """Attention for several sequences' new tokens packed into one [1, sum(T)] forward (as
    dense.PackedPrefillAttention): each sequence's keys/values go to its blocks, and its new
    queries attend causally to its own slots. Blocks are reserved up front (`OutOfBlocks` before any
    forward) and `commit` makes the new tokens part of each sequence."""

    def __init__(self, pool: KVPool, seqs: list[SequenceKV], new_tokens: list[int], scale: float) -> None:
        super().__init__(new_tokens)
        self.pool, self.seqs, self.scale = pool, seqs, scale
        self.past = [s.length for s in seqs]
        try:
            for seq, n in zip(seqs, new_tokens, strict=True):
                seq.reserve(pool, seq.length + n)
        except OutOfBlocks:
            for seq in seqs:  # give back the blocks this prefill took (past each sequence's tokens)
                seq.truncate(pool, seq.length)
            raise
        device = pool.k[0].device
        # per group, per sequence: (slots of positions [start, past + n), start)
        self.slots = [[(s.tables[g].slots(pool, p + n, device), s.tables[g].start(pool))
                       for s, p, n in zip(seqs, self.past, new_tokens, strict=True)]
                      for g in range(len(pool.groups))]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               window: int | None = None) -> torch.Tensor:
        g, kl, vl = _layer(self.pool, layer, window)
        outs = []
        for (slots, start), past, n, off in zip(self.slots[g], self.past, self.new, self.offsets, strict=False):
            kl[:, slots[past - start:]] = k[0, :, off:off + n]  # [KVH, n, D]
            vl[:, slots[past - start:]] = v[0, :, off:off + n]
            keys = kl.index_select(1, slots)[None]  # [1, KVH, past + n - start, D]
            values = vl.index_select(1, slots)[None]
            outs.append(causal_attention(q[:, :, off:off + n], keys, values, past - start, self.scale, window))
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)

    def commit(self) -> int:
        """The new tokens are part of each sequence; returns the change in held group-tokens."""
        return sum(seq.advance(self.pool, n) for seq, n in zip(self.seqs, self.new, strict=True))


class PagedDecode:
    """One decode step of B running sequences (one new token each) over their block tables.

    `prepare()` reserves the step's slot in each sequence (RowsOutOfBlocks names the rows that
    could not get one, before any forward); `advance()` after the forward counts the new tokens.

    Attention gathers each row's blocks of the layer's group from the pool into a
    [KVH, rows, W, D] tensor for the step and runs the two matmuls of `grouped_decode_attention`.
    Rows are grouped by length so that padding stays small: a group's padded size is at most twice
    the keys it holds (plus `SLACK`), so the transient a step allocates is bounded by the tokens
    held, never by rows x the longest row (64 short rows and one 3,000-token row make two groups,
    not 64 x 3,000 slots). Rows of similar lengths (the usual batch) form one group in their own
    order: no reordering cost.
    """

    SLACK = 1024  # padding slots a group may always carry (tiny rows are not split apart)

    def __init__(self, pool: KVPool, seqs: list[SequenceKV], scale: float) -> None:
        self.pool, self.seqs, self.scale = pool, seqs, scale

    def prepare(self) -> None:
        short = []
        for i, seq in enumerate(self.seqs):
            try:
                seq.reserve(self.pool, seq.length + 1)
            except OutOfBlocks:
                short.append(i)
        if short:
            raise RowsOutOfBlocks(short)
        device, bs = self.pool.k[0].device, self.pool.block_size
        lens = [s.length + 1 for s in self.seqs]  # keys per row, the new one included
        self.lens = torch.tensor(lens, device=device)
        self.new_slots = [torch.tensor([t.blocks[(n - 1) // bs - t.first] * bs + (n - 1) % bs for t, n in
                                        zip((s.tables[g] for s in self.seqs), lens, strict=True)], device=device)
                          for g in range(len(self.pool.groups))]
        self.groups = []  # per row group: a _Group per layer group
        for rows in _length_groups(lens, self.SLACK):
            whole = len(rows) == len(lens)
            row_lens = self.lens if whole else self.lens[rows]
            self.groups.append([_Group(rows, [self.seqs[i].tables[g] for i in rows], row_lens, self.pool, whole)
                                for g in range(len(self.pool.groups))])

    @property
    def positions(self) -> torch.Tensor:
        """[B, 1] position of each row's new token."""
        return (self.lens - 1)[:, None]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               window: int | None = None) -> torch.Tensor:
        g, kl, vl = _layer(self.pool, layer, window)
        kl[:, self.new_slots[g]] = k[:, :, 0].transpose(0, 1)  # [KVH, B, D]
        vl[:, self.new_slots[g]] = v[:, :, 0].transpose(0, 1)
        bs = self.pool.block_size
        if len(self.groups) == 1 and self.groups[0][g].whole:
            return self.groups[0][g].attend(q, kl, vl, bs, self.scale, window)
        out = torch.empty_like(q)
        for row_group in self.groups:
            part = row_group[g]
            out[part.index] = part.attend(q[part.index], kl, vl, bs, self.scale, window)
        return out

    def advance(self) -> int:
        """Each row holds its new token; returns the change in held group-tokens."""
        return sum(seq.advance(self.pool, 1) for seq in self.seqs)


class _Group:
    """Rows of one decode step attended together in one layer group: their block tables padded
    to the longest, and masks.

    The gather copies whole blocks (a block's keys are contiguous per KV head: one memcpy each,
    several times faster than gathering slot by slot) into buffers reused by every layer of the
    group in the step, so fresh memory is faulted in once per step, not once per layer.
    """

    def __init__(self, rows: list[int], tables: list[BlockTable], lens: torch.Tensor, pool: KVPool, whole: bool) -> None:
        device, block_size = lens.device, pool.block_size
        self.whole = whole  # all the step's rows, in order
        self.index = torch.tensor(rows, device=device)
        starts = torch.tensor([t.start(pool) for t in tables], device=device)
        held = [-(-n // block_size) - t.first for t, n in zip(tables, lens.tolist(), strict=True)]
        width = max(held)
        # pads repeat the row's own first block: masked, and never another row's (maybe non-finite) data
        blocks = [t.blocks[:n] + [t.blocks[0]] * (width - n) for t, n in zip(tables, held, strict=True)]
        self.blocks = torch.tensor(blocks, dtype=torch.long, device=device).flatten()  # [G * width]
        self.shape = (len(rows), width * block_size)  # G, W
        keys = torch.arange(width * block_size, device=device)
        self.last = (lens - 1 - starts)[:, None]  # [G, 1] each row's new position, from its table's start
        self.hidden = (keys[None, :] > self.last)[:, None, :]  # [G, 1, W]: True = padding or beyond the row
        self._windows: dict[int, torch.Tensor] = {}
        self._bufs: tuple[torch.Tensor, torch.Tensor] | None = None

    def attend(self, q: torch.Tensor, kl: torch.Tensor, vl: torch.Tensor, block_size: int,
               scale: float, window: int | None) -> torch.Tensor:
        kvh, slots, d = kl.shape
        g, w = self.shape
        if self._bufs is None:
            self._bufs = tuple(kl.new_empty((kvh, len(self.blocks), block_size, d)) for _ in range(2))
        kbuf, vbuf = self._bufs
        torch.index_select(kl.view(kvh, slots // block_size, block_size, d), 1, self.blocks, out=kbuf)
        torch.index_select(vl.view(kvh, slots // block_size, block_size, d), 1, self.blocks, out=vbuf)
        return grouped_decode_attention(q, kbuf.view(kvh, g, w, d), vbuf.view(kvh, g, w, d), self._hidden(window),
                                        scale)

    def _hidden(self, window: int | None) -> torch.Tensor:
        """The padding mask, plus for a sliding-window layer the keys at or before last - window."""
        if window is None:
            return self.hidden
        if window not in self._windows:
            keys = torch.arange(self.shape[1], device=self.hidden.device)
            self._windows[window] = self.hidden | (keys[None, :] <= self.last - window)[:, None, :]
        return self._windows[window]


def grouped_decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, hidden: torch.Tensor,
                             scale: float) -> torch.Tensor:
    """One query per row over its padded keys, as two batched matmuls (runner.decode_attention
    with the KV head as the outer batch dimension, the layout a gather from the pool gives).

    q: [G, H, 1, D]; keys/values: [KVH, G, W, D]; hidden: [G, 1, W] True where a key is padding.
    """
    g, h, _, d = q.shape
    kvh = keys.shape[0]
    qg = q.view(g, kvh, h // kvh, d).transpose(0, 1)  # [KVH, G, Gq, D]: query heads grouped on their KV head
    scores = torch.matmul(qg, keys.transpose(-1, -2)) * scale  # [KVH, G, Gq, W]
    scores = scores.masked_fill(hidden, float("-inf")).softmax(dim=-1)
    return torch.matmul(scores, values).transpose(0, 1).reshape(g, h, 1, d)


def _length_groups(lens: list[int], slack: int) -> list[list[int]]:
    """Rows split so that each group's rows x longest <= 2 x its keys + slack (longest rows first);
    one group, in row order, when the whole step already fits that bound."""
    if len(lens) * max(lens) <= 2 * sum(lens) + slack:
        return [list(range(len(lens)))]
    groups: list[list[int]] = []
    cur: list[int] = []
    held = 0
    for i in sorted(range(len(lens)), key=lambda i: -lens[i]):
        if cur and (len(cur) + 1) * lens[cur[0]] > 2 * (held + lens[i]) + slack:
            groups.append(cur)
            cur, held = [], 0
        cur.append(i)
        held += lens[i]
    groups.append(cur)
    return groups


class RowsOutOfBlocks(OutOfBlocks):
    """Decode rows (indices) that could not get a slot for their next token."""

    def __init__(self, rows: list[int]) -> None:
        super().__init__(f"no free KV block for {len(rows)} decoding row(s)")
        self.rows = rows
