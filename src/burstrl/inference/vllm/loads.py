"""`/v1/loads`, the router's prefix index and `/metrics` rows for a replica on vLLM.

The same fields as the own engine's (`inference.load_report`), from vLLM's figures: capacity is
vLLM's KV cache in tokens (`kv_cache_size_tokens`), usage its `kv_cache_usage_perc`. Evictions,
re-fills and thrash, which vLLM does not report, are read from each call's cached tokens
(`vllm.refills`), and its preemptions are reported beside them; its prefix cache is
content-addressed, so every session's history is advertised to the router as cached (vLLM may have
evicted part of it: the next call's re-fill counts it).
"""

from __future__ import annotations

from burstrl.inference.backend import MetricRow
from burstrl.inference.request import EngineCounters
from burstrl.inference.sessions import SessionTable
from burstrl.inference.vllm.metrics import VllmFigures
from burstrl.inference.vllm.refills import RefillTracker
from burstrl.protocol.blocks import BLOCK_TOKENS, cache_scope, prefix_block_hashes


def loads_body(f: VllmFigures, sessions: SessionTable, in_flight: int, refills: RefillTracker) -> dict:
    capacity = max(f.capacity_tokens, 1)
    waiting = _waiting(f, in_flight)
    rows = [{"session_id": s.id, "version": s.version, "tokens": len(s.prompt_ids) + len(s.completion_ids),
             "context_tokens": len(s.prompt_ids) + len(s.completion_ids), "busy": s.busy}
            for s in sessions.snapshot()]
    return {
        "engine": "vllm",
        "num_running_reqs": f.running,
        "num_waiting_reqs": waiting,
        "num_used_tokens": int(f.usage * capacity),
        "max_total_num_tokens": capacity,
        "token_usage": f.usage,
        "reserved_tokens": 0,
        "cache_hit_rate": f.prefix_hits / f.prefix_queries if f.prefix_queries else 0.0,
        "prefix_cache_queries_tokens": int(f.prefix_queries),
        "prefix_cache_hit_tokens": int(f.prefix_hits),
        "prefix_cache_shared_hit_tokens": 0,
        "evictions": refills.evictions,
        "refills": refills.refills,
        "thrash": refills.thrash,
        "preemptions": int(f.preemptions),
        "prefix_cache_window_misses": 0,
        "num_sessions": len(rows),
        "sessions": rows,
        "kv_window": None,
    }


def prefix_summary(sessions: SessionTable, max_blocks: int = 16384) -> dict:
    """Keys (protocol.blocks) of every session's full blocks, at most `max_blocks`."""
    keys: set[int] = set()
    for s in sessions.snapshot():
        history = s.prompt_ids + s.completion_ids
        n = len(history) // BLOCK_TOKENS
        if n == 0 or len(keys) >= max_blocks:
            continue
        hashes = prefix_block_hashes(history[: n * BLOCK_TOKENS], cache_scope(s.version, s.cache_salt))
        keys.update(hashes[: max_blocks - len(keys)])
    return {"block_tokens": BLOCK_TOKENS, "hashes": sorted(keys)}


def metric_rows(f: VllmFigures, c: EngineCounters, in_flight: int, refills: RefillTracker) -> list[MetricRow]:
    return [
        ("vllm:num_requests_running", "gauge", "Requests running in vLLM.", f.running),
        ("vllm:num_requests_waiting", "gauge", "Requests waiting in vLLM or on their way to it.",
         _waiting(f, in_flight)),
        ("vllm:kv_cache_usage_perc", "gauge", "vLLM's KV cache usage (0-1).", f.usage),
        ("vllm:prefix_cache_queries_total", "counter", "Prompt tokens looked up in vLLM's cache.", f.prefix_queries),
        ("vllm:prefix_cache_hits_total", "counter", "Prompt tokens served from vLLM's cache.", f.prefix_hits),
        ("vllm:num_preemptions_total", "counter", "Requests vLLM preempted.", f.preemptions),
        ("burstrl:kv_refills_total", "counter", "Calls that prefilled history vLLM had evicted.", refills.refills),
        ("burstrl:kv_refilled_tokens_total", "counter", "History tokens prefilled again.", refills.refilled_tokens),
        ("burstrl:kv_thrash_total", "counter", "Sessions evicted again soon after a re-fill.", refills.thrash),
        ("vllm:prompt_tokens_total", "counter", "Prompt tokens sent to vLLM.", c.prompt_tokens),
        ("vllm:generation_tokens_total", "counter", "Tokens vLLM sampled for this replica.", c.generation_tokens),
        ("burstrl:failed_requests_total", "counter", "Calls failed alone (the engine served on).", c.failed_requests),
    ]


def _waiting(f: VllmFigures, in_flight: int) -> int:
    """Waiting calls: vLLM's figure, or more when calls were sent since its last scrape."""
    return max(f.waiting, in_flight - f.running)
