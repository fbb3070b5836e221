"""Paged KV storage: fixed-size blocks in one preallocated pool, per-sequence block tables, and
layer groups so that sliding-window layers hold only their window.

Why (issue 33): the engine's first KV layout kept each session in its own tensor grown by
doubling and copied running sequences into a decode batch padded to its longest row, so what it
allocated was not bounded by the tokens it held (64 short rows and one 3,000-token call asked for
64 x 3,000 slots and killed the engine). Here, as in vLLM's PagedAttention, keys and values live in
one pool of `num_blocks` blocks of `block_size` token slots, allocated once at the token budget; a
sequence owns lists of blocks (block tables). Memory is the pool's, at every moment; a sequence
that needs a block when none is free gets `OutOfBlocks` (that request fails, nothing else). Blocks
can be shared by several sequences (a common prompt prefix, same adapter version) through
reference counts, without a copy.

Layer groups (as vLLM's hybrid allocator): the layers are split into groups of equal size, each
group of one attention span (Gemma 3 270M: 15 sliding-window layers and 3 global ones make five
sliding groups and one global group of 3 layers). A physical block holds `block_size` slots of
every layer of one group, so all groups draw on the one pool and one budget, and a sequence has a
block table per group. A sliding group's table lets go of the blocks that fell out of its window
(plus `WINDOW_MARGIN`, so that a next call whose prompt re-renders the last few tokens can still
resume), so a long sequence holds about window + margin tokens in those layers, not its length.
A model without sliding windows is one group of all layers: one table per sequence.

Sharing invariant: a table writes only at slot `length`, and never into a block someone else
holds: `reserve` first replaces a shared, partly used last block with a private copy
(copy-on-write). So a block shared from a running donor, or left partly used by a truncation,
keeps exactly what every holder read from it.

Layout: per index i within a group, k and v are [KVH, num_blocks * block_size, D] (a slot is
block * block_size + offset): a gather of a row's slots is then contiguous per KV head, what the
decode matmuls want. Layer l lives at `pool.k[pool.where[l][1]]` in its group's blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from math import gcd

import torch

WINDOW_MARGIN = 128  # tokens a sliding group keeps past its window (resume a few tokens back)


class OutOfBlocks(RuntimeError):
    """The pool has no free block for a sequence's next token(s)."""


def layer_groups(windows: list[int | None]) -> list[list[int]]:
    """Layers split into groups of one attention span and one size (the gcd of each span's layer
    count), in layer order: [[0..L-1]] without sliding windows."""
    spans: dict[int | None, list[int]] = {}
    for layer, window in enumerate(windows):
        spans.setdefault(window, []).append(layer)
    size = 0
    for layers in spans.values():
        size = gcd(size, len(layers))
    return [layers[i:i + size] for layers in spans.values() for i in range(0, len(layers), size)]


class KVPool:
    """The blocks of every layer group's keys and values, and which are free (reference counts).

    `windows`: each layer's sliding window (None = global attention); omitted, every layer is global.
    `window_margin`: tokens a sliding group keeps past its window."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                 num_blocks: int, block_size: int = 16, windows: list[int | None] | None = None,
                 window_margin: int = WINDOW_MARGIN) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("a KV pool needs at least one block of at least one slot")
        windows = list(windows) if windows is not None else [None] * layers
        if len(windows) != layers:
            raise ValueError(f"{len(windows)} layer windows for {layers} layers")
        self.block_size, self.num_blocks, self.window_margin = block_size, num_blocks, window_margin
        self.groups = layer_groups(windows)
        self.windows = windows
        self.group_windows = [windows[g[0]] for g in self.groups]
        self.where = [(0, 0)] * layers  # layer -> (group, index within the group)
        for g, members in enumerate(self.groups):
            for i, layer in enumerate(members):
                self.where[layer] = (g, i)
        shape = (kv_heads, num_blocks * block_size, head_dim)
        # empty, not zeros: untouched pages of a large CPU allocation stay unmapped, so resident
        # memory grows with the blocks first used; `allocate` zeroes each block it hands out
        self.k = [torch.empty(shape, dtype=dtype, device=device) for _ in self.groups[0]]
        self.v = [torch.empty(shape, dtype=dtype, device=device) for _ in self.groups[0]]
        self.refs = [0] * num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # a stack: the lowest ids are used first

    @classmethod
    def for_tokens(cls, tokens: int, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                   device: torch.device, block_size: int = 16, windows: list[int | None] | None = None,
                   window_margin: int = WINDOW_MARGIN) -> KVPool:
        """A pool of the memory of `tokens` slots in every layer (the token budget, in whole blocks)."""
        groups = len(layer_groups(list(windows) if windows is not None else [None] * layers))
        return cls(layers, kv_heads, head_dim, dtype, device, max(1, tokens // block_size) * groups, block_size,
                   windows, window_margin)

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    @property
    def used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def sequence_blocks(self) -> int:
        """Physical blocks a sequence holds per block of its tokens in every layer (the group count)."""
        return len(self.groups)

    def copy_block(self, src: int, dst: int, slots: int) -> None:
        """The first `slots` keys/values of block `src`, in every layer of the group, into block `dst`."""
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
    """One sequence's blocks of one layer group, in order; positions [start, length) hold
    keys/values. The first `first` blocks were dropped (out of a sliding window): start = first x
    block_size, and blocks[0] is the block of position `start`."""

    blocks: list[int] = field(default_factory=list)
    length: int = 0
    first: int = 0
    _slots: torch.Tensor | None = field(default=None, repr=False)  # slot of every position of the blocks

    def start(self, pool: KVPool) -> int:
        return self.first * pool.block_size

    def reserve(self, pool: KVPool, total: int) -> None:
        """Blocks for `total` tokens, and a private last block to write into (copy-on-write);
        OutOfBlocks, with nothing taken, when the pool is short."""
        block = pool.block_size
        need = -(-total // block) - self.first - len(self.blocks)
        tail = self.length // block - self.first
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
        """Pool slot of each position in [start, end): [end - start] int64 (a view of a cached tensor)."""
        if self._slots is None:
            table = torch.tensor(self.blocks, dtype=torch.long)
            self._slots = (table[:, None] * pool.block_size + torch.arange(pool.block_size)).flatten().to(device)
        return self._slots[: end - self.start(pool)]

    def truncate(self, pool: KVPool, length: int) -> None:
        """Keep the first `length` tokens; blocks past them go back to the pool. A table that
        dropped blocks before `length` cannot be cut below its start."""
        if length < self.start(pool):
            raise ValueError(f"cannot keep {length} tokens of a table whose keys start at {self.start(pool)}")
        keep = -(-length // pool.block_size) - self.first
        if keep < len(self.blocks):
            pool.release(self.blocks[keep:])
            del self.blocks[keep:]
            self._slots = None
        self.length = min(self.length, length)

    def drop_before(self, pool: KVPool, position: int) -> int:
        """Let go of the leading blocks whose every slot is before `position`; returns their count."""
        n = min(position // pool.block_size - self.first, len(self.blocks) - 1)
        if n <= 0:
            return 0
        pool.release(self.blocks[:n])
        del self.blocks[:n]
        self.first += n
        self._slots = None
        return n

    def release(self, pool: KVPool) -> None:
        pool.release(self.blocks)
        self.blocks, self.length, self.first, self._slots = [], 0, 0, None

    def fork_prefix(self, pool: KVPool, tokens: int) -> BlockTable:
        """A new table holding this one's first `tokens` keys/values by sharing their blocks (no
        copy; a partly used last block is copied when either side first writes into it)."""
        tokens = min(tokens, self.length)
        if tokens < self.start(pool):
            raise ValueError(f"cannot share {tokens} tokens of a table whose keys start at {self.start(pool)}")
        shared = self.blocks[: max(0, -(-tokens // pool.block_size) - self.first)]
        pool.share(shared)
        return BlockTable(blocks=list(shared), length=tokens, first=self.first)


@dataclass(eq=False)
class SequenceKV:
    """One sequence's keys/values: a block table per layer group of its pool, all of one length."""

    tables: list[BlockTable]

    @classmethod
    def new(cls, pool: KVPool) -> SequenceKV:
        return cls([BlockTable() for _ in pool.groups])

    @property
    def length(self) -> int:
        return self.tables[0].length

    @length.setter
    def length(self, n: int) -> None:
        """Tokens written by hand (tests, a probe): the engine moves lengths with `advance`."""
        for t in self.tables:
            t.length = n

    @property
    def num_blocks(self) -> int:
        """Physical blocks listed (shared ones included)."""
        return sum(len(t.blocks) for t in self.tables)

    def held_tokens(self, pool: KVPool) -> int:
        """Token slots held summed over groups (a group-token: one token in the layers of one group)."""
        return sum(t.length - t.start(pool) for t in self.tables)

    def resumable(self, pool: KVPool, length: int) -> bool:
        """Can a next call continue from the first `length` tokens? Every sliding group must still
        hold the keys the next query sees: positions after length - window."""
        return all(w is None or t.start(pool) <= max(0, length - w + 1)
                   for t, w in zip(self.tables, pool.group_windows, strict=True))

    def reserve(self, pool: KVPool, total: int) -> None:
        """Blocks for `total` tokens in every group; OutOfBlocks with nothing new kept."""
        try:
            for t in self.tables:
                t.reserve(pool, total)
        except OutOfBlocks:
            self.truncate(pool, self.length)
            raise

    def advance(self, pool: KVPool, n: int) -> int:
        """n more tokens were written; sliding groups let go of what left their window.
        Returns the change in held group-tokens."""
        dropped = 0
        for t, w in zip(self.tables, pool.group_windows, strict=True):
            t.length += n
            if w is not None:
                dropped += t.drop_before(pool, t.length - w - pool.window_margin)
        return n * len(self.tables) - dropped * pool.block_size

    def truncate(self, pool: KVPool, length: int) -> None:
        for t in self.tables:
            t.truncate(pool, length)

    def release(self, pool: KVPool) -> None:
        for t in self.tables:
            t.release(pool)

    def fork_prefix(self, pool: KVPool, tokens: int) -> SequenceKV:
        return SequenceKV([t.fork_prefix(pool, tokens) for t in self.tables])

    def blocks_needed(self, pool: KVPool, prompt: int, total: int) -> tuple[int, int]:
        """(peak, steady): the most physical blocks this sequence can hold while its `prompt` is
        prefilled, and after that while it grows to `total` tokens (its reservations)."""
        bs, peak, steady = pool.block_size, 0, 0
        for t, w in zip(self.tables, pool.group_windows, strict=True):
            full = -(-total // bs) - t.first
            if w is None:
                peak, steady = peak + full, steady + full
            else:  # after a prefill and each step, at most window + margin + two partial blocks
                after = min(full, -(-(w + pool.window_margin) // bs) + 2)
                peak, steady = peak + max(after, -(-prompt // bs) - t.first), steady + after
        return peak, steady
