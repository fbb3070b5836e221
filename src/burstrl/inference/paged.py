"""Paged KV storage: fixed-size blocks in one preallocated pool, and per-sequence block tables.

Why (issue 33): the engine's first KV layout (kvcache.py) keeps each session in its own tensor
grown by doubling and copies running sequences into a decode batch padded to its longest row, so
what it allocates is not bounded by the tokens it holds (64 short rows and one 3,000-token call
asked for 64 x 3,000 slots and killed the engine). Here, as in vLLM's PagedAttention, every
layer's keys and values live in one pool of `num_blocks` blocks of `block_size` token slots,
allocated once at the token budget; a sequence owns a list of blocks (its block table). Memory is
the pool's, at every moment; a sequence that needs a block when none is free gets `OutOfBlocks`
(that request fails, nothing else). Full blocks can be shared by several sequences (a common
prompt prefix, same adapter version) through reference counts, without a copy.

Attention gathers a sequence's slots from the pool for the step (prefill: one sequence's keys;
decode: every row's keys concatenated, no padding), so what a step touches is bounded by the
tokens held, not by rows x longest row.

Layout: per layer, k and v are [num_blocks * block_size, KVH, D] (a slot is block * block_size +
offset). Shapes: q [B, H, T, D], k/v [B, KVH, T, D] as in runner.Attention.
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
        shape = (num_blocks * block_size, kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
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
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))

    def allocate(self, n: int) -> list[int]:
        """n blocks (reference count 1 each), or OutOfBlocks with nothing taken."""
        if n > len(self._free):
            raise OutOfBlocks(f"{n} KV blocks needed, {len(self._free)} free of {self.num_blocks}")
        blocks = [self._free.pop() for _ in range(n)]
        for b in blocks:
            self.refs[b] = 1
        return blocks

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


@dataclass
class BlockTable:
    """One sequence's blocks in order; its first `length` slots hold keys/values."""

    blocks: list[int] = field(default_factory=list)
    length: int = 0

    def capacity(self, block_size: int) -> int:
        return len(self.blocks) * block_size

    def reserve(self, pool: KVPool, total: int) -> None:
        """Blocks for `total` tokens (OutOfBlocks, with nothing taken, when the pool is short)."""
        need = -(-total // pool.block_size) - len(self.blocks)
        if need > 0:
            self.blocks += pool.allocate(need)

    def slots(self, pool: KVPool, start: int, end: int, device: torch.device) -> torch.Tensor:
        """Pool slot of each position in [start, end): [end - start] int64."""
        pos = torch.arange(start, end)
        table = torch.tensor(self.blocks, dtype=torch.long)
        return (table[pos // pool.block_size] * pool.block_size + pos % pool.block_size).to(device)

    def release(self, pool: KVPool) -> None:
        pool.release(self.blocks)
        self.blocks, self.length = [], 0

    def fork_prefix(self, pool: KVPool, tokens: int) -> BlockTable:
        """A new table sharing this one's first `tokens // block_size` full blocks (no copy)."""
        full = min(tokens, self.length) // pool.block_size
        shared = self.blocks[:full]
        pool.share(shared)
        return BlockTable(blocks=list(shared), length=full * pool.block_size)


class PagedPrefill:
    """Attention for several sequences' new tokens packed into one [1, sum(T)] forward (as
    kvcache.PackedPrefillAttention): each sequence's keys/values go to its blocks, and its new
    queries attend causally to its own slots. Blocks are reserved up front (`OutOfBlocks` before any
    forward) and `commit` makes the new tokens part of each table."""

    def __init__(self, pool: KVPool, tables: list[BlockTable], new_tokens: list[int], scale: float) -> None:
        self.pool, self.tables, self.new, self.scale = pool, tables, new_tokens, scale
        self.past = [t.length for t in tables]
        reserved: list[tuple[BlockTable, int]] = []
        try:
            for table, n in zip(tables, new_tokens, strict=True):
                before = len(table.blocks)
                table.reserve(pool, table.length + n)
                reserved.append((table, before))
        except OutOfBlocks:
            for table, before in reserved:  # give back what this prefill took
                pool.release(table.blocks[before:])
                del table.blocks[before:]
            raise
        device = pool.k[0].device
        self.slots = [t.slots(pool, 0, p + n, device) for t, p, n in zip(tables, self.past, new_tokens, strict=True)]
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
            kl[slots[past:]] = k[0, :, off:off + n].transpose(0, 1)  # [n, KVH, D]
            vl[slots[past:]] = v[0, :, off:off + n].transpose(0, 1)
            keys = kl[slots].transpose(0, 1)[None]  # [1, KVH, past + n, D]
            values = vl[slots].transpose(0, 1)[None]
            outs.append(causal_attention(q[:, :, off:off + n], keys, values, past, self.scale, window))
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)

    def commit(self) -> None:
        for table, past, n in zip(self.tables, self.past, self.new, strict=True):
            table.length = past + n


class PagedDecode:
    """One decode step of B running sequences (one new token each) over their block tables.

    `prepare()` reserves the step's slot in each table (OutOfBlocks names the rows that could not
    get one, before any forward); `advance()` after the forward counts the new tokens. Attention is
    ragged: every row's keys are gathered into one [sum(len), KVH, D] tensor and each row's query
    attends over its own segment (a segment softmax), so nothing is padded to the longest row.
    """

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
        device = self.pool.k[0].device
        self.lens = torch.tensor([t.length + 1 for t in self.tables], device=device)  # keys incl. the new one
        self.slots = torch.cat([t.slots(self.pool, 0, t.length + 1, device) for t in self.tables])
        self.row = torch.repeat_interleave(torch.arange(len(self.tables), device=device), self.lens)
        starts = torch.cumsum(self.lens, 0) - self.lens
        self.pos = torch.arange(len(self.row), device=device) - starts[self.row]  # each key's position
        self.new_slots = self.slots[torch.cumsum(self.lens, 0) - 1]  # the last slot of each row
        self._masks: dict[int | None, torch.Tensor] = {}

    @property
    def positions(self) -> torch.Tensor:
        """[B, 1] position of each row's new token."""
        return (self.lens - 1)[:, None]

    def _visible(self, window: int | None) -> torch.Tensor | None:
        if window is None:
            return None
        if window not in self._masks:
            self._masks[window] = self.pos > (self.lens - 1)[self.row] - window
        return self._masks[window]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               window: int | None = None) -> torch.Tensor:
        kl, vl = self.pool.k[layer], self.pool.v[layer]
        kl[self.new_slots] = k[:, :, 0]  # [B, KVH, D]
        vl[self.new_slots] = v[:, :, 0]
        return ragged_attention(q, kl[self.slots], vl[self.slots], self.row, len(self.tables), self.scale,
                                self._visible(window))

    def advance(self) -> None:
        for table in self.tables:
            table.length += 1


class RowsOutOfBlocks(OutOfBlocks):
    """Decode rows (indices) that could not get a slot for their next token."""

    def __init__(self, rows: list[int]) -> None:
        super().__init__(f"no free KV block for {len(rows)} decoding row(s)")
        self.rows = rows


def ragged_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, row: torch.Tensor, rows: int,
                     scale: float, visible: torch.Tensor | None = None) -> torch.Tensor:
    """One query per row over that row's segment of the concatenated keys.

    q: [B, H, 1, D]; keys/values: [N, KVH, D] (N = sum of the rows' lengths); row: [N] the row of
    each key; visible: [N] bool or None. -> [B, H, 1, D]. Query heads are grouped onto their KV head.
    """
    b, h, _, d = q.shape
    kvh = keys.shape[1]
    qg = q.reshape(b, kvh, h // kvh, d)[row]  # [N, KVH, G, D]: each key's row's query
    scores = torch.einsum("nkgd,nkd->nkg", qg, keys).float() * scale  # [N, KVH, G]
    if visible is not None:
        scores = scores.masked_fill(~visible[:, None, None], float("-inf"))
    index = row[:, None, None].expand_as(scores)
    peak = torch.full((rows, kvh, h // kvh), float("-inf"), device=q.device).scatter_reduce(
        0, index, scores, reduce="amax")
    weights = torch.exp(scores - peak[row])  # [N, KVH, G]
    total = torch.zeros((rows, kvh, h // kvh), device=q.device).index_add_(0, row, weights)
    out = torch.zeros((rows, kvh, h // kvh, d), device=q.device).index_add_(
        0, row, weights[..., None] * values.float()[:, :, None, :])
    return (out / total[..., None]).to(q.dtype).reshape(b, h, 1, d)
