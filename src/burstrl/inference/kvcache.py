"""The engine's KV budget: idle sessions' caches and running requests' reservations, in blocks.

Why sessions: an agent rollout is many calls whose prompts each extend the last one. Keeping a
session's keys/values between its calls means the next call prefills only the new suffix (the
reference system reports a 99.6% hit rate). Idle sessions are evicted least-recently-used when
room is needed, and a session evicted soon after being re-filled is counted as thrashing.

Storage is paged (paged.py): every sequence, idle or running, is a `SequenceKV` (a block table
per layer group) into the one `KVPool` allocated at the token budget, so the memory held never
exceeds the budget. A running request keeps its tables; when it finishes they become the
session's idle cache as they are (no copy in or out of a batch). A new call shares another
cache's prefix by reference (`share`). Sliding-window layers keep only their window, so a cache
can resume only near its end: a reuse that needs keys a sliding layer let go is not taken
(counted as `window_misses`; the call prefills from the start, exact either way).

Budget invariant, in blocks: sum(blocks listed by idle tables) + sum(running reservations) <=
pool blocks. A running request reserves the blocks of everything it may reach (prompt +
max_tokens; a sliding group at most its window past the prefill, paged.SequenceKV.blocks_needed)
when admitted, before any block is taken, so the pool cannot run dry under a running request. A block shared by two tables is counted by both: conservative, and it stays
counted while any holder keeps it (evicting a donor does not free a block a running sharer holds).

Exactness invariant: every cache carries the namespace (adapter version) that computed it, and a
cache is reused or shared only by a request in the same namespace.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field

from burstrl.inference.paged import KVPool, SequenceKV
from burstrl.inference.prefix import KvNamespace, PrefixIndex


@dataclass
class CacheStats:
    """Counters exported on /v1/loads and /metrics (tokens, not requests)."""

    queries_tokens: int = 0
    hit_tokens: int = 0
    shared_hit_tokens: int = 0  # of hit_tokens: shared from another session's cache
    evictions: int = 0
    evicted_tokens: int = 0
    refills: int = 0
    thrash: int = 0
    window_misses: int = 0  # reuses refused: a sliding-window layer no longer held the keys needed


@dataclass
class _Entry:
    table: SequenceKV
    tokens: list[int]
    namespace: KvNamespace  # the adapter version (and cache_salt) whose request computed these
    last_used: float = field(default_factory=time.monotonic)


class SessionCache:
    """Idle sessions' block tables under a block budget shared with running requests.

    Token counts here are group-tokens (one token in the layers of one group; a token of a
    model without sliding windows is one); the properties report tokens of every layer's memory."""

    def __init__(self, pool: KVPool, thrash_window_s: float) -> None:
        self.pool = pool
        self.block = pool.block_size
        self.groups = pool.sequence_blocks
        self.capacity = pool.num_blocks * pool.block_size // self.groups  # tokens in every layer
        self.thrash_window_s = thrash_window_s
        self.idle: OrderedDict[str, _Entry] = OrderedDict()  # LRU order: oldest first
        self.idle_tokens = 0
        self.idle_blocks = 0
        self.reserved_blocks = 0
        self.running_tokens = 0
        self.stats = CacheStats()
        self._evicted: set[str] = set()
        self._refilled_at: dict[str, float] = {}
        self.prefixes = PrefixIndex()
        self._running: dict[str, tuple[SequenceKV, list[int], KvNamespace]] = {}  # prompts being decoded: donors too

    @property
    def used_tokens(self) -> int:
        """Tokens actually held (of every layer's memory): idle caches plus running sequences."""
        return (self.idle_tokens + self.running_tokens) // self.groups

    @property
    def reserved(self) -> int:
        """Running requests' reservations, in tokens of every layer's memory (whole blocks)."""
        return self.reserved_blocks * self.block // self.groups

    @property
    def reserved_total(self) -> int:
        """Reservations and idle caches together, in tokens of every layer's memory."""
        return (self.reserved_blocks + self.idle_blocks) * self.block // self.groups

    def blocks_for(self, tokens: int) -> int:
        """Blocks of `tokens` in every layer group."""
        return -(-tokens // self.block) * self.groups

    def hold_running(self, tokens: int) -> None:
        """Running sequences now hold `tokens` more group-tokens (a prefill, a decode step; fewer
        when sliding layers let go of more than the step added).

        Why the cache counts them and not the engine: `used_tokens` (what /v1/loads and the
        router's headroom read) is only right if every change goes through one owner."""
        self.running_tokens += tokens

    def release_running(self, tokens: int) -> None:
        """Running sequences that left (finished, failed, dropped) no longer hold `tokens` group-tokens."""
        self.running_tokens -= tokens

    def take(self, session_id: str, prompt: list[int], namespace: KvNamespace) -> tuple[SequenceKV | None, int]:
        """Remove a session's idle cache for a new call; returns (table, reusable prefix length).

        The table is cut to the reusable prefix. At least one prompt token is always left to
        prefill (the forward needs an input). Give the table back with `put` if the call cannot
        start yet. A cache from another namespace (a released session id reused on another
        version) is dropped, never reused.
        """
        entry = self._pop(session_id)
        if entry is None:
            return None, 0
        if entry.namespace != namespace:
            entry.table.release(self.pool)
            return None, 0
        reuse = _common_prefix(entry.tokens, prompt, limit=min(entry.table.length, len(prompt) - 1))
        if reuse == 0 or not entry.table.resumable(self.pool, reuse):
            self.stats.window_misses += reuse > 0
            entry.table.release(self.pool)
            return None, 0  # nothing to resume: the caller may still share another cache's prefix
        entry.table.truncate(self.pool, reuse)
        return entry.table, reuse

    def share(self, prompt: list[int], namespace: KvNamespace) -> tuple[SequenceKV | None, int]:
        """A new table holding the longest prefix of `prompt` found in any cache of `namespace`,
        sharing the donor's blocks (no copy). Release it if the call cannot start yet.

        The donor stays (an idle one becomes most recently used). Returns (None, 0) if no cache of
        the same namespace shares a full prefix block with the prompt. At least one prompt token
        is left to prefill.
        """
        donor_id, _ = self.prefixes.longest(prompt, namespace)
        if donor_id is None:
            return None, 0
        if donor_id in self.idle:
            entry = self.idle[donor_id]
            source, tokens, donor_ns = entry.table, entry.tokens[: entry.table.length], entry.namespace
        else:  # a running request: its prompt's keys/values stay in its table until it leaves
            source, tokens, donor_ns = self._running[donor_id]
        if donor_ns != namespace:  # a hash collision across versions: never share
            return None, 0
        reuse = _common_prefix(tokens, prompt, limit=min(len(tokens), len(prompt) - 1))
        if reuse == 0:
            return None, 0
        if not source.resumable(self.pool, reuse):
            self.stats.window_misses += 1
            return None, 0
        if donor_id in self.idle:
            self.idle.move_to_end(donor_id)
        return source.fork_prefix(self.pool, reuse), reuse

    def add_running(self, request_id: str, table: SequenceKV, prompt: list[int], namespace: KvNamespace) -> None:
        """Offer a running request's prefilled prompt as a donor (until `remove_running`)."""
        key = f" {request_id}"  # a space: never a session id
        self._running[key] = (table, prompt, namespace)
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

    def reserve(self, blocks: int) -> bool:
        """Reserve blocks for a running request, evicting idle sessions LRU; False if it cannot fit.

        Nothing is evicted when even an empty cache could not make room.
        """
        total = self.pool.num_blocks
        if self.reserved_blocks + blocks > total:
            return False
        while self.idle_blocks + self.reserved_blocks + blocks > total and self.idle:
            self._evict_oldest()
        if self.idle_blocks + self.reserved_blocks + blocks > total:
            return False
        self.reserved_blocks += blocks
        return True

    def unreserve(self, blocks: int) -> None:
        self.reserved_blocks -= blocks

    def put(self, session_id: str, table: SequenceKV, tokens: list[int], namespace: KvNamespace) -> None:
        """A finished call's table becomes idle (most recently used). `tokens` match table.length."""
        old = self._pop(session_id)  # never two entries (and two budget charges) for one session
        if old is not None:
            old.table.release(self.pool)
        table.truncate(self.pool, table.length)  # a block reserved for a token never fed goes back
        entry = self.idle[session_id] = _Entry(table=table, tokens=tokens[: table.length], namespace=namespace)
        self.idle_tokens += table.held_tokens(self.pool)
        self.idle_blocks += table.num_blocks
        self.prefixes.add(session_id, entry.tokens, namespace)

    def drop(self, session_id: str) -> None:
        """Forget a session (released by its owner); not an eviction."""
        entry = self._pop(session_id)
        if entry is not None:
            entry.table.release(self.pool)
        self._evicted.discard(session_id)
        self._refilled_at.pop(session_id, None)

    def cached_length(self, session_id: str) -> int:
        entry = self.idle.get(session_id)
        return entry.table.length if entry else 0

    def _pop(self, session_id: str) -> _Entry | None:
        """Take an entry out of the idle set and the budget; the caller owns its table's blocks."""
        entry = self.idle.pop(session_id, None)
        if entry is not None:
            self.idle_tokens -= entry.table.held_tokens(self.pool)
            self.idle_blocks -= entry.table.num_blocks
            self.prefixes.remove(session_id)
        return entry

    def _evict_oldest(self) -> None:
        session_id = next(iter(self.idle))
        entry = self._pop(session_id)
        self.stats.evictions += 1
        self.stats.evicted_tokens += entry.table.length
        entry.table.release(self.pool)
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
