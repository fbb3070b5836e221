"""Paged KV storage: fixed-size blocks in one preallocated pool, and per-sequence block tables.

Why (issue 33): the engine's first KV layout kept each session in its own tensor grown by
doubling and copied running sequences into a decode batch padded to its longest row, so what it
allocated was not bounded by the tokens it held (64 short rows and one 3,000-token call asked for
64 x 3,000 slots and killed the engine). Here, as in vLLM's PagedAttention, every layer's keys and
values live in one pool of `num_blocks` blocks of `block_size` token slots, allocated once at the
token budget; a sequence owns a list of blocks (its block table). Memory is the pool's, at every
moment; a sequence that needs a block when none is free gets `OutOfBlocks` (that request fails,
nothing else). Blocks can be shared by several sequences (a common prompt prefix, same adapter
version) through reference counts, without a copy.

Sharing invariant: a table writes only at slot `length`, and never into a block someone else
holds: `reserve` first replaces a shared, partly used last block with a private copy
(copy-on-write). So a block shared from a running donor, or left partly used by a truncation,
keeps exactly what every holder read from it.

Attention gathers a sequence's slots from the pool for the step (prefill: one sequence's keys;
decode: rows grouped by length, padded within a group at most 2x), so what a step touches is
bounded by the tokens held, not by rows x longest row.

Layout: per layer, k and v are [KVH, num_blocks * block_size, D] (a slot is block * block_size +
offset): a gather of a row's slots is then contiguous per KV head, what the decode matmuls want. Shapes: q [B, H, T, D], k/v [B, KVH, T, D] as in runner.Attention.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from burstrl.inference.runner import causal_attention


class OutOfBlocks(RuntimeError):
    """The pool has no free block for a sequence's next token(s)."""


class KVPool:
    """The blocks of every layer's keys and values, and which are free (reference counts)."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                 num_blocks: int, block_size: int = 16) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("a KV pool needs at least one block of at least one slot")
        self.block_size, self.num_blocks = block_size, num_blocks
        shape = (kv_heads, num_blocks * block_size, head_dim)
        # empty, not zeros: untouched pages of a large CPU allocation stay unmapped, so resident
        # memory grows with the blocks first used; `allocate` zeroes each block it hands out
        self.k = [torch.empty(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.v = [torch.empty(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.refs = [0] * num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # a stack: the lowest ids are used first

    @classmethod
    def for_tokens(cls, tokens: int, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                   device: torch.device, block_size: int = 16) -> KVPool:
        """A pool of at most `tokens` slots (the token budget, rounded down to whole blocks)."""
        return cls(layers, kv_heads, head_dim, dtype, device, max(1, tokens // block_size), block_size)

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    @property
    def used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def copy_block(self, src: int, dst: int, slots: int) -> None:
        """The first `slots` keys/values of block `src`, in every layer, into block `dst`."""
        a, b = src * self.block_size, dst * self.block_size
        for t in (*self.k, *self.v):
            t[:, b:b + slots] = t[:, a:a + slots]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))

    def allocate(self, n: int) -> list[int]:
        """n blocks (reference count 1 each), or OutOfBlocks with nothing taken."""
        if n > len(self._free):
            raise OutOfBlocks(f"{n} KV blocks needed, {len(self._free)} free of {self.num_blocks}")
        blocks = [self._free.pop() for _ in range(n)]
        for b in blocks:
            self.refs[b] = 1
        if blocks:
            self._zero(blocks)
        return blocks

    def _zero(self, blocks: list[int]) -> None:
        """Why: decode reads whole blocks and masks the slots past a row's length, and a masked
        slot still meets its value in `weights @ values` (0 x NaN = NaN). Stale keys/values of a
        previous holder (a request whose adapter produced NaN, say) must not reach the next one."""
        index = torch.tensor(blocks, dtype=torch.long, device=self.k[0].device)
        for t in (*self.k, *self.v):
            kvh, slots, d = t.shape
            t.view(kvh, slots // self.block_size, self.block_size, d).index_fill_(1, index, 0)

    def share(self, blocks: list[int]) -> None:
        """Another sequence holds these (full, never written again) blocks too."""
        for b in blocks:
            if self.refs[b] < 1:
                raise ValueError(f"block {b} is free; only held blocks can be shared")
            self.refs[b] += 1

    def release(self, blocks: list[int]) -> None:
        """A sequence lets go of its blocks; a block is free when nobody holds it."""
        for b in blocks:
            if self.refs[b] < 1:
                raise ValueError(f"block {b} released more often than held")
            self.refs[b] -= 1
            if self.refs[b] == 0:
                self._free.append(b)


@dataclass(eq=False)
class BlockTable:
    """One sequence's blocks in order; its first `length` slots hold keys/values."""

    blocks: list[int] = field(default_factory=list)
    length: int = 0
    _slots: torch.Tensor | None = field(default=None, repr=False)  # slot of every position of the blocks

    def reserve(self, pool: KVPool, total: int) -> None:
        """Blocks for `total` tokens, and a private last block to write into (copy-on-write);
        OutOfBlocks, with nothing taken, when the pool is short."""
        block = pool.block_size
        need = -(-total // block) - len(self.blocks)
        tail = self.length // block
        cow = self.length % block != 0 and pool.refs[self.blocks[tail]] > 1
        fresh = pool.allocate(max(need, 0) + cow)
        if cow:
            old, self.blocks[tail] = self.blocks[tail], fresh.pop()
            pool.copy_block(old, self.blocks[tail], self.length % block)
            pool.release([old])
        if fresh or cow:
            self.blocks += fresh
            self._slots = None

    def slots(self, pool: KVPool, end: int, device: torch.device) -> torch.Tensor:
        """Pool slot of each position in [0, end): [end] int64 (a view of a cached tensor)."""
        if self._slots is None:
            table = torch.tensor(self.blocks, dtype=torch.long)
            self._slots = (table[:, None] * pool.block_size + torch.arange(pool.block_size)).flatten().to(device)
        return self._slots[:end]

    def truncate(self, pool: KVPool, length: int) -> None:
        """Keep the first `length` tokens; blocks past them go back to the pool."""
        keep = -(-length // pool.block_size)
        if keep < len(self.blocks):
            pool.release(self.blocks[keep:])
            del self.blocks[keep:]
            self._slots = None
        self.length = min(self.length, length)

    def release(self, pool: KVPool) -> None:
        pool.release(self.blocks)
        self.blocks, self.length, self._slots = [], 0, None

    def fork_prefix(self, pool: KVPool, tokens: int) -> BlockTable:
        """A new table holding this one's first `tokens` keys/values by sharing their blocks (no
        copy; a partly used last block is copied when either side first writes into it)."""
        tokens = min(tokens, self.length)
        shared = self.blocks[: -(-tokens // pool.block_size)]
        pool.share(shared)
        return BlockTable(blocks=list(shared), length=tokens)


class PagedPrefill:
    """Attention for several sequences' new tokens packed into one [1, sum(T)] forward (as
    kvcache.PackedPrefillAttention): each sequence's keys/values go to its blocks, and its new
    queries attend causally to its own slots. Blocks are reserved up front (`OutOfBlocks` before any
    forward) and `commit` makes the new tokens part of each table."""

    def __init__(self, pool: KVPool, tables: list[BlockTable], new_tokens: list[int], scale: float) -> None:
        self.pool, self.tables, self.new, self.scale = pool, tables, new_tokens, scale
        self.past = [t.length for t in tables]
        try:
            for table, n in zip(tables, new_tokens, strict=True):
                table.reserve(pool, table.length + n)
        except OutOfBlocks:
            for table in tables:  # give back the blocks this prefill took (past each table's tokens)
                table.truncate(pool, table.length)
            raise
        device = pool.k[0].device
        self.slots = [t.slots(pool, p + n, device) for t, p, n in zip(tables, self.past, new_tokens, strict=True)]
        self.offsets = [0]
        for n in new_tokens:
            self.offsets.append(self.offsets[-1] + n)

    @property
    def last_positions(self) -> list[int]:
        return [end - 1 for end in self.offsets[1:]]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               window: int | None = None) -> torch.Tensor:
        outs = []
        kl, vl = self.pool.k[layer], self.pool.v[layer]
        for slots, past, n, off in zip(self.slots, self.past, self.new, self.offsets, strict=False):
            kl[:, slots[past:]] = k[0, :, off:off + n]  # [KVH, n, D]
            vl[:, slots[past:]] = v[0, :, off:off + n]
            keys = kl.index_select(1, slots)[None]  # [1, KVH, past + n, D]
            values = vl.index_select(1, slots)[None]
            outs.append(causal_attention(q[:, :, off:off + n], keys, values, past, self.scale, window))
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)

    def commit(self) -> None:
        for table, past, n in zip(self.tables, self.past, self.new, strict=True):
            table.length = past + n


class PagedDecode:
    """One decode step of B running sequences (one new token each) over their block tables.

    `prepare()` reserves the step's slot in each table (RowsOutOfBlocks names the rows that could
    not get one, before any forward); `advance()` after the forward counts the new tokens.

    Attention gathers each row's blocks from the pool into a [KVH, rows, W, D] tensor for the step
    and runs the two matmuls of `grouped_decode_attention`. Rows are grouped by length so that padding
    stays small: a group's padded size is at most twice the keys it holds (plus `SLACK`), so the
    transient a step allocates is bounded by the tokens held, never by rows x the longest row
    (64 short rows and one 3,000-token row make two groups, not 64 x 3,000 slots). Rows of
    similar lengths (the usual batch) form one group in their own order: no reordering cost.
    """

    SLACK = 1024  # padding slots a group may always carry (tiny rows are not split apart)

    def __init__(self, pool: KVPool, tables: list[BlockTable], scale: float) -> None:
        self.pool, self.tables, self.scale = pool, tables, scale

    def prepare(self) -> None:
        short = []
        for i, table in enumerate(self.tables):
            try:
                table.reserve(self.pool, table.length + 1)
            except OutOfBlocks:
                short.append(i)
        if short:
            raise RowsOutOfBlocks(short)
        device, bs = self.pool.k[0].device, self.pool.block_size
        lens = [t.length + 1 for t in self.tables]  # keys per row, the new one included
        self.lens = torch.tensor(lens, device=device)
        self.new_slots = torch.tensor([t.blocks[n // bs] * bs + n % bs for t, n in
                                       zip(self.tables, (n - 1 for n in lens), strict=True)], device=device)
        self.groups = [_Group(rows, [self.tables[i] for i in rows], self.lens[rows] if len(rows) < len(lens)
                              else self.lens, bs, len(rows) == len(lens))
                       for rows in _length_groups(lens, self.SLACK)]

    @property
    def positions(self) -> torch.Tensor:
        """[B, 1] position of each row's new token."""
        return (self.lens - 1)[:, None]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               window: int | None = None) -> torch.Tensor:
        kl, vl = self.pool.k[layer], self.pool.v[layer]
        kl[:, self.new_slots] = k[:, :, 0].transpose(0, 1)  # [KVH, B, D]
        vl[:, self.new_slots] = v[:, :, 0].transpose(0, 1)
        bs = self.pool.block_size
        if len(self.groups) == 1 and self.groups[0].whole:
            return self.groups[0].attend(q, kl, vl, bs, self.scale, window)
        out = torch.empty_like(q)
        for g in self.groups:
            out[g.index] = g.attend(q[g.index], kl, vl, bs, self.scale, window)
        return out

    def advance(self) -> None:
        for table in self.tables:
            table.length += 1


class _Group:
    """Rows of one decode step attended together: their block tables padded to the longest, and masks.

    The gather copies whole blocks (a block's keys are contiguous per KV head: one memcpy each,
    several times faster than gathering slot by slot) into buffers reused by every layer of the
    step, so fresh memory is faulted in once per step, not once per layer.
    """

    def __init__(self, rows: list[int], tables: list[BlockTable], lens: torch.Tensor, block_size: int,
                 whole: bool) -> None:
        device = lens.device
        self.whole = whole  # all the step's rows, in order
        self.index = torch.tensor(rows, device=device)
        width = max(-(-int(n) // block_size) for n in lens.tolist())
        # pads repeat the row's own first block: masked, and never another row's (maybe non-finite) data
        blocks = [t.blocks[:width] + [t.blocks[0]] * (width - len(t.blocks[:width])) for t in tables]
        self.blocks = torch.tensor(blocks, dtype=torch.long, device=device).flatten()  # [G * width]
        self.shape = (len(rows), width * block_size)  # G, W
        keys = torch.arange(width * block_size, device=device)
        self.last = (lens - 1)[:, None]  # [G, 1] each row's new position
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
