"""What a replica reports of its engine's load: `/v1/loads` and the router's prefix index.

Read from the server's threads while the engine thread runs: every value is a snapshot (the
session table's copy, counters read once), never a lock on the engine's step.
"""

from __future__ import annotations

from collections.abc import Callable

from burstrl.inference.backend import MetricRow
from burstrl.inference.kvcache import SessionCache
from burstrl.inference.request import EngineCounters
from burstrl.inference.sessions import SessionTable
from burstrl.protocol.blocks import BLOCK_TOKENS, cache_scope, prefix_block_hashes


class LoadReport:
    """The engine's load and prefix summary; memoises the summary's hashes between scrapes.
    `queues()`: (running, waiting) requests now."""

    def __init__(self, sessions: SessionTable, cache: SessionCache, queues: Callable[[], tuple[int, int]]) -> None:
        self.sessions, self.cache, self.queues = sessions, cache, queues
        self._memo: dict[tuple, list[int]] = {}  # prefix_summary's hashes of the last scrape
        pool = cache.pool
        spans = [w for w in pool.group_windows if w is not None]
        # the longest session whose sliding layers still hold every key (nothing let go yet)
        self.shareable_tokens = min(spans) + pool.window_margin if spans else float("inf")
        # for the router's KV projection: sliding groups hold at most window + margin of a session
        self.kv_window = ({"tokens": max(spans) + pool.window_margin, "fraction": len(spans) / len(pool.groups)}
                          if spans else None)

    def prefix_summary(self, max_blocks: int = 16384) -> dict:
        """Keys (protocol.blocks) of every session's cached full blocks: the router's exact prefix index.

        Memoised per (session, version, blocks, prompt length) between calls, so a scrape re-hashes
        only sessions that changed; at most `max_blocks` keys. A session past its sliding layers'
        window + margin is left out: it let go of the keys a new prompt sharing its first blocks
        would need (only a prompt reaching its end could still share), so advertising it would draw
        sessions the replica then has to prefill anyway.
        """
        keys: set[int] = set()
        memo: dict[tuple, list[int]] = {}
        for s in self.sessions.snapshot():
            tokens = s.kv_tokens if s.busy else self.cache.cached_length(s.id)
            n = tokens // BLOCK_TOKENS
            if n == 0 or len(keys) >= max_blocks or tokens > self.shareable_tokens:
                continue
            key = (s.id, s.version, s.cache_salt, n, len(s.prompt_ids))
            hashes = self._memo.get(key)
            if hashes is None:
                hashes = prefix_block_hashes((s.prompt_ids + s.completion_ids)[: n * BLOCK_TOKENS],
                                             cache_scope(s.version, s.cache_salt))
            memo[key] = hashes
            keys.update(hashes[: max_blocks - len(keys)])
        self._memo = memo
        return {"block_tokens": BLOCK_TOKENS, "hashes": sorted(keys)}

    def loads(self) -> dict:
        c, stats = self.cache, self.cache.stats
        sessions = [{"session_id": s.id, "version": s.version,
                     "tokens": s.kv_tokens if s.busy else c.cached_length(s.id),
                     "context_tokens": len(s.prompt_ids) + len(s.completion_ids),
                     "busy": s.busy} for s in self.sessions.snapshot()]
        running, waiting = self.queues()
        return {
            "num_running_reqs": running,
            "num_waiting_reqs": waiting,
            "num_used_tokens": c.used_tokens,
            "max_total_num_tokens": c.capacity,
            "token_usage": c.used_tokens / c.capacity,
            "reserved_tokens": c.reserved_total,
            "cache_hit_rate": stats.hit_tokens / stats.queries_tokens if stats.queries_tokens else 0.0,
            "prefix_cache_queries_tokens": stats.queries_tokens,
            "prefix_cache_hit_tokens": stats.hit_tokens,
            "prefix_cache_shared_hit_tokens": stats.shared_hit_tokens,
            "evictions": stats.evictions,
            "refills": stats.refills,
            "thrash": stats.thrash,
            "prefix_cache_window_misses": stats.window_misses,
            "num_sessions": len(sessions),
            "sessions": sessions,
            "kv_window": self.kv_window,
        }

    def metric_rows(self, counters: EngineCounters) -> list[MetricRow]:
        """The engine's own figures, with vLLM's names where vLLM has one (`inference.metrics`)."""
        stats, cache, c = self.cache.stats, self.cache, counters
        running, waiting = self.queues()
        return [
            ("vllm:num_requests_running", "gauge", "Requests in the decode batch.", running),
            ("vllm:num_requests_waiting", "gauge", "Requests waiting for admission.", waiting),
            ("vllm:kv_cache_usage_perc", "gauge", "KV tokens held / budget (0-1).", cache.used_tokens / cache.capacity),
            ("vllm:prefix_cache_queries_total", "counter", "Prompt tokens looked up in the cache.", stats.queries_tokens),
            ("vllm:prefix_cache_hits_total", "counter", "Prompt tokens served from the cache.", stats.hit_tokens),
            ("burstrl:prefix_cache_shared_hits_total", "counter", "Hit tokens copied from another session.",
             stats.shared_hit_tokens),
            ("vllm:prompt_tokens_total", "counter", "Prompt tokens prefilled.", c.prompt_tokens),
            ("vllm:generation_tokens_total", "counter", "Tokens sampled.", c.generation_tokens),
            ("burstrl:decode_steps_total", "counter", "Batched decode steps run.", c.decode_steps),
            ("burstrl:kv_evictions_total", "counter", "Idle session caches evicted.", stats.evictions),
            ("burstrl:kv_evicted_tokens_total", "counter", "Tokens of evicted caches.", stats.evicted_tokens),
            ("burstrl:kv_refills_total", "counter", "Sessions re-prefilled after eviction.", stats.refills),
            ("burstrl:kv_thrash_total", "counter", "Evictions of a session soon after its re-fill.", stats.thrash),
            ("burstrl:failed_requests_total", "counter", "Requests failed alone inside the engine (the engine "
             "served on).", c.failed_requests),
            ("burstrl:engine_step_failures_total", "counter", "Forward passes that raised (their requests failed).",
             c.step_failures),
        ]
