"""The dense KV layout: one preallocated tensor per sequence (or per padded batch), no paging.

Why it is kept: it is the simplest exact cache, so it is the reference the engine is measured
against (benchmarks/replica.py's bare batched loop with a preallocated cache: this CPU's practical
limit) and the straightforward cache tests check the runner with. The engine itself stores KV in
blocks (paged.py, kvcache.SessionCache): this layout is not bounded by the tokens it holds (the
padded batch grows rows x longest row), which is why the engine left it (issue 33).

Shapes: a sequence's cache is per layer [KVH, capacity, D]; a batch's is [rows, KVH, L, D].
"""

from __future__ import annotations

import torch

from burstrl.inference.runner import PackedTokens, causal_attention, decode_attention


class SessionKV:
    """Keys/values of one sequence: per layer [KVH, capacity, D]; the first `length` are valid."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, capacity: int = 64) -> None:
        shape = (kv_heads, capacity, head_dim)
        self.k = [torch.empty(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.v = [torch.empty(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.length = 0

    @property
    def capacity(self) -> int:
        return self.k[0].shape[1]

    def reserve(self, total: int) -> None:
        """Make room for `total` tokens (doubling), keeping the valid prefix."""
        if total <= self.capacity:
            return
        cap = max(total, 2 * self.capacity)
        for store in (self.k, self.v):
            for i, old in enumerate(store):
                new = old.new_empty((old.shape[0], cap, old.shape[2]))
                new[:, : self.length] = old[:, : self.length]
                store[i] = new

    def truncate(self, length: int) -> None:
        self.length = min(self.length, length)


class PackedPrefillAttention(PackedTokens):
    """Attention for several sequences' new tokens packed into one [1, sum(T)] forward.

    The projections and MLP of every admitted request then run as one batch of tokens (on CPU a
    forward costs about the same for 20 tokens as for 600), while attention stays per sequence:
    sequence i's new tokens are appended to its own cache and attend to it causally.
    """

    def __init__(self, kvs: list[SessionKV], new_tokens: list[int], scale: float) -> None:
        super().__init__(new_tokens)
        self.kvs, self.scale = kvs, scale
        self.past = [kv.length for kv in kvs]
        for kv, n in zip(kvs, new_tokens, strict=False):
            kv.reserve(kv.length + n)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               window: int | None = None) -> torch.Tensor:
        outs = []
        for kv, past, n, off in zip(self.kvs, self.past, self.new, self.offsets, strict=False):
            end = past + n
            kv.k[layer][:, past:end] = k[0, :, off:off + n]
            kv.v[layer][:, past:end] = v[0, :, off:off + n]
            keys, values = kv.k[layer][None, :, :end], kv.v[layer][None, :, :end]
            outs.append(causal_attention(q[:, :, off:off + n], keys, values, past, self.scale, window))
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)

    def commit(self) -> None:
        """Call after the forward pass: the new tokens become part of each cache."""
        for kv, past, n in zip(self.kvs, self.past, self.new, strict=False):
            kv.length = past + n


class DecodeBatch:
    """Keys/values of the running sequences, one row each: per layer [rows, KVH, L, D].

    Row r holds `lens[r]` valid tokens. A decode step writes each row's new key/value at
    position lens[r] and attends over positions [0, lens[r]]; `advance()` then bumps lens.
    """

    def __init__(self, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, scale: float) -> None:
        self.layers, self.kv_heads, self.head_dim = layers, kv_heads, head_dim
        self.dtype, self.device, self.scale = dtype, device, scale
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.lens = torch.zeros(0, dtype=torch.long, device=device)
        self._alloc(rows=8, length=256)
        self._mask: torch.Tensor | None = None
        self._window_masks: dict[int, torch.Tensor] = {}

    @property
    def size(self) -> int:
        return int(self.lens.shape[0])

    def _alloc(self, rows: int, length: int) -> None:
        shape = (rows, self.kv_heads, length, self.head_dim)
        old_k, old_v = self.k, self.v
        self.k = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.layers)]
        self.v = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.layers)]
        n = self.size
        if n and old_k:
            used = min(old_k[0].shape[2], length)
            for i in range(self.layers):
                self.k[i][:n, :, :used] = old_k[i][:n, :, :used]
                self.v[i][:n, :, :used] = old_v[i][:n, :, :used]

    def _ensure(self, rows: int, length: int) -> None:
        cur_rows, cur_len = self.k[0].shape[0], self.k[0].shape[2]
        if rows <= cur_rows and length <= cur_len:
            return
        self._alloc(max(rows, cur_rows if rows <= cur_rows else 2 * cur_rows),
                    max(length, cur_len if length <= cur_len else 2 * cur_len))

    def add(self, kv: SessionKV) -> int:
        """Copy a sequence's cache into a new last row; returns the row index."""
        row, n = self.size, kv.length
        self._ensure(row + 1, n + 1)
        for i in range(self.layers):
            self.k[i][row, :, :n] = kv.k[i][:, :n]
            self.v[i][row, :, :n] = kv.v[i][:, :n]
        self.lens = torch.cat([self.lens, torch.tensor([n], device=self.device)])
        return row

    def remove(self, row: int, kv: SessionKV | None) -> None:
        """Copy row `row` out into `kv` (if given), then move the last row into its place."""
        n, last = int(self.lens[row]), self.size - 1
        if kv is not None:
            kv.length = 0
            kv.reserve(n)
            for i in range(self.layers):
                kv.k[i][:, :n] = self.k[i][row, :, :n]
                kv.v[i][:, :n] = self.v[i][row, :, :n]
            kv.length = n
        if row != last:
            m = int(self.lens[last])
            for i in range(self.layers):
                self.k[i][row, :, :m] = self.k[i][last, :, :m]
                self.v[i][row, :, :m] = self.v[i][last, :, :m]
            self.lens[row] = self.lens[last]
        self.lens = self.lens[:last].clone()

    def prepare(self) -> None:
        """Before a decode step: room for one more token per row, and the length mask."""
        width = int(self.lens.max()) + 1
        self._ensure(self.size, width)
        self._width = width
        keys = torch.arange(width, device=self.device)
        self._mask = (keys[None, :] > self.lens[:, None])[:, None, None, :]  # [B, 1, 1, W]: True = hidden
        self._window_masks: dict[int, torch.Tensor] = {}

    def _hidden(self, window: int | None) -> torch.Tensor:
        """The step's mask, plus for a sliding-window layer the keys at or before lens - window."""
        if window is None:
            return self._mask
        if window not in self._window_masks:
            keys = torch.arange(self._width, device=self.device)
            old = (keys[None, :] <= self.lens[:, None] - window)[:, None, None, :]
            self._window_masks[window] = self._mask | old
        return self._window_masks[window]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               window: int | None = None) -> torch.Tensor:
        n = self.size
        rows = torch.arange(n, device=self.device)
        self.k[layer][rows, :, self.lens] = k[:, :, 0]
        self.v[layer][rows, :, self.lens] = v[:, :, 0]
        keys = self.k[layer][:n, :, : self._width]
        values = self.v[layer][:n, :, : self._width]
        return decode_attention(q, keys, values, self._hidden(window), self.scale)

    def advance(self) -> None:
        self.lens += 1
