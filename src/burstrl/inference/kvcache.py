"""KV storage for the engine: per-session caches, the decode batch, and the token budget.

Why sessions: an agent rollout is many calls whose prompts each extend the last one. Keeping a
session's keys/values between its calls means the next call prefills only the new suffix (the
reference system reports a 99.6% hit rate). The budget (`max_total_num_tokens`) bounds idle cached
tokens plus what running requests may grow to; idle sessions are evicted least-recently-used when
room is needed, and a session evicted soon after being re-filled is counted as thrashing.

Layout: a session's cache is one [KVH, capacity, D] key and value tensor per layer, grown by
doubling. While a request decodes, its keys/values live in a row of the `DecodeBatch` instead
(copied in when it joins, out when it leaves): rows are right-padded and masked by length.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from burstrl.inference.prefix import PrefixIndex
from burstrl.inference.runner import causal_attention


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


class PackedPrefillAttention:
    """Attention for several sequences' new tokens packed into one [1, sum(T)] forward.

    The projections and MLP of every admitted request then run as one batch of tokens (on CPU a
    forward costs about the same for 20 tokens as for 600), while attention stays per sequence:
    sequence i's new tokens are appended to its own cache and attend to it causally.
    """

    def __init__(self, kvs: list[SessionKV], new_tokens: list[int], scale: float) -> None:
        self.kvs, self.new, self.scale = kvs, new_tokens, scale
        self.past = [kv.length for kv in kvs]
        self.offsets = [0]
        for kv, n in zip(kvs, new_tokens, strict=False):
            kv.reserve(kv.length + n)
            self.offsets.append(self.offsets[-1] + n)

    @property
    def last_positions(self) -> list[int]:
        """Index of each sequence's last new token in the packed sequence."""
        return [end - 1 for end in self.offsets[1:]]

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


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, hidden: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """One query per row over its padded keys, as two small matmuls.

    q: [B, H, 1, D]; k/v: [B, KVH, W, D]; hidden: [B, 1, 1, W] True where a key is padding.
    SDPA's CPU kernels are built for long queries: for a single query they cost ~10x these matmuls.
    Query heads are grouped onto their key/value head (GQA) instead of repeating k and v.
    """
    b, h, _, d = q.shape
    kvh = k.shape[1]
    qg = q.reshape(b, kvh, h // kvh, d)  # [B, KVH, G, D]
    scores = torch.matmul(qg, k.transpose(-1, -2)) * scale  # [B, KVH, G, W]
    scores = scores.masked_fill(hidden, float("-inf")).softmax(dim=-1)
    return torch.matmul(scores, v).reshape(b, h, 1, d)


@dataclass
class CacheStats:
    """Counters exported on /v1/loads and /metrics (tokens, not requests)."""

    queries_tokens: int = 0
    hit_tokens: int = 0
    shared_hit_tokens: int = 0  # of hit_tokens: copied from another session's cache
    evictions: int = 0
    evicted_tokens: int = 0
    refills: int = 0
    thrash: int = 0


@dataclass
class _Entry:
    kv: SessionKV
    tokens: list[int]
    namespace: int  # the adapter version whose weights computed these keys/values
    last_used: float = field(default_factory=time.monotonic)


class SessionCache:
    """Idle sessions' KV caches under a token budget shared with running requests.

    Budget invariant: sum(idle cached tokens) + sum(running reservations) <= capacity. A running
    request reserves the tokens it may reach (cached prefix + new prompt + max_tokens) and gives
    back its reservation when it finishes and its cache becomes idle (actual length <= reserved).

    Exactness invariant: every cache carries the namespace (adapter version) that computed it, and
    a cache is reused or copied only by a request in the same namespace.
    """

    def __init__(self, capacity: int, thrash_window_s: float) -> None:
        self.capacity = capacity
        self.thrash_window_s = thrash_window_s
        self.idle: OrderedDict[str, _Entry] = OrderedDict()  # LRU order: oldest first
        self.idle_tokens = 0
        self.reserved = 0
        self.running_tokens = 0
        self.stats = CacheStats()
        self._evicted: set[str] = set()
        self._refilled_at: dict[str, float] = {}
        self.prefixes = PrefixIndex()
        self._running: dict[str, tuple[SessionKV, list[int], int]] = {}  # prompts being decoded: donors too

    @property
    def used_tokens(self) -> int:
        """Tokens actually held: idle caches plus running sequences' current lengths."""
        return self.idle_tokens + self.running_tokens

    def hold_running(self, tokens: int) -> None:
        """Running sequences now hold `tokens` more keys/values (a prefill, a decode step).

        Why the cache counts them and not the engine: `used_tokens` (what /v1/loads and the
        router's headroom read) is only right if every change goes through one owner."""
        self.running_tokens += tokens

    def release_running(self, tokens: int) -> None:
        """Running sequences that left (finished, failed, dropped) no longer hold `tokens`."""
        self.running_tokens -= tokens

    def take(self, session_id: str, prompt: list[int], namespace: int) -> tuple[SessionKV | None, int]:
        """Remove a session's idle cache for a new call; returns (kv, reusable prefix length).

        At least one prompt token is always left to prefill (the forward needs an input). Give the
        cache back with `put` if the call cannot start yet. A cache from another namespace (a
        released session id reused on another version) is dropped, never reused.
        """
        entry = self._pop(session_id)
        if entry is None:
            return None, 0
        if entry.namespace != namespace:
            return None, 0
        reuse = _common_prefix(entry.tokens, prompt, limit=min(entry.kv.length, len(prompt) - 1))
        entry.kv.truncate(reuse)
        return entry.kv, reuse

    def share(self, prompt: list[int], namespace: int,
              new_kv: Callable[[int], SessionKV]) -> tuple[SessionKV | None, int]:
        """A fresh cache holding the longest prefix of `prompt` found in any cache of `namespace` (a copy).

        The donor stays idle (and becomes most recently used). Returns (None, 0) if no cache of the
        same namespace shares a full block with the prompt. At least one prompt token is left to prefill.
        """
        donor_id, _ = self.prefixes.longest(prompt, namespace)
        if donor_id is None:
            return None, 0
        if donor_id in self.idle:
            entry = self.idle[donor_id]
            source, tokens, donor_ns = entry.kv, entry.tokens[: entry.kv.length], entry.namespace
            self.idle.move_to_end(donor_id)
        else:  # a running request: its prompt's keys/values stay in its cache until it leaves
            source, tokens, donor_ns = self._running[donor_id]
        if donor_ns != namespace:  # a hash collision across versions: never copy
            return None, 0
        reuse = _common_prefix(tokens, prompt, limit=min(len(tokens), len(prompt) - 1))
        if reuse == 0:
            return None, 0
        kv = new_kv(len(prompt) + 1)
        for dst, src in ((kv.k, source.k), (kv.v, source.v)):
            for layer, tensor in enumerate(src):
                dst[layer][:, :reuse] = tensor[:, :reuse]
        kv.length = reuse
        return kv, reuse

    def add_running(self, request_id: str, kv: SessionKV, prompt: list[int], namespace: int) -> None:
        """Offer a running request's prefilled prompt as a donor (until `remove_running`)."""
        key = f" {request_id}"  # a space: never a session id
        self._running[key] = (kv, prompt, namespace)
        self.prefixes.add(key, prompt, namespace)

    def remove_running(self, request_id: str) -> None:
        key = f" {request_id}"
        if self._running.pop(key, None) is not None:
            self.prefixes.remove(key)

    def record(self, session_id: str, prompt_tokens: int, reused: int, shared: bool = False) -> None:
        """Count a started call's prefix-cache query and hit (in tokens), and re-fills."""
        self.stats.queries_tokens += prompt_tokens
        self.stats.hit_tokens += reused
        if shared:
            self.stats.shared_hit_tokens += reused
        if (reused == 0 or shared) and session_id in self._evicted:
            self._evicted.discard(session_id)
            self.stats.refills += 1
            self._refilled_at[session_id] = time.monotonic()

    def reserve(self, tokens: int) -> bool:
        """Reserve budget for a running request, evicting idle sessions LRU; False if it cannot fit.

        Nothing is evicted when even an empty cache could not make room.
        """
        if self.reserved + tokens > self.capacity:
            return False
        while self.idle_tokens + self.reserved + tokens > self.capacity and self.idle:
            self._evict_oldest()
        if self.idle_tokens + self.reserved + tokens > self.capacity:
            return False
        self.reserved += tokens
        return True

    def unreserve(self, tokens: int) -> None:
        self.reserved -= tokens

    def put(self, session_id: str, kv: SessionKV, tokens: list[int], namespace: int) -> None:
        """A finished call's cache becomes idle (most recently used). `tokens` match kv.length."""
        self._pop(session_id)  # never two entries (and two budget charges) for one session
        entry = self.idle[session_id] = _Entry(kv=kv, tokens=tokens[: kv.length], namespace=namespace)
        self.idle_tokens += kv.length
        self.prefixes.add(session_id, entry.tokens, namespace)

    def drop(self, session_id: str) -> None:
        """Forget a session (released by its owner); not an eviction."""
        self._pop(session_id)
        self._evicted.discard(session_id)
        self._refilled_at.pop(session_id, None)

    def cached_length(self, session_id: str) -> int:
        entry = self.idle.get(session_id)
        return entry.kv.length if entry else 0

    def _pop(self, session_id: str) -> _Entry | None:
        entry = self.idle.pop(session_id, None)
        if entry is not None:
            self.idle_tokens -= entry.kv.length
            self.prefixes.remove(session_id)
        return entry

    def _evict_oldest(self) -> None:
        session_id = next(iter(self.idle))
        entry = self._pop(session_id)
        self.stats.evictions += 1
        self.stats.evicted_tokens += entry.kv.length
        self._evicted.add(session_id)
        refilled = self._refilled_at.pop(session_id, None)
        if refilled is not None and time.monotonic() - refilled < self.thrash_window_s:
            self.stats.thrash += 1


def _common_prefix(a: list[int], b: list[int], limit: int) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if n >= limit or x != y:
            break
        n += 1
    return n
