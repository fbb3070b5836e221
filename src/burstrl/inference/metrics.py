"""Prometheus text for a replica, with vLLM's metric names so existing dashboards and routers work.

Prefix-cache counters are in tokens (as vLLM's are). burstrl-only figures (evictions, re-fills,
thrashing, sessions, continuity) use the `burstrl:` prefix.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from burstrl.inference.replica import InferenceReplica


def prometheus_text(rep: InferenceReplica) -> str:
    eng, stats = rep.engine, rep.engine.cache.stats
    label = f'model_name="{rep.cfg.served_model_name}"'
    cache = eng.cache
    rows: list[tuple[str, str, str, float]] = [
        ("vllm:num_requests_running", "gauge", "Requests in the decode batch.", len(eng.rows)),
        ("vllm:num_requests_waiting", "gauge", "Requests waiting for admission.", len(eng.waiting)),
        ("vllm:kv_cache_usage_perc", "gauge", "KV tokens held / budget (0-1).", cache.used_tokens / cache.capacity),
        ("vllm:prefix_cache_queries_total", "counter", "Prompt tokens looked up in the cache.", stats.queries_tokens),
        ("vllm:prefix_cache_hits_total", "counter", "Prompt tokens served from the cache.", stats.hit_tokens),
        ("burstrl:prefix_cache_shared_hits_total", "counter", "Hit tokens copied from another session.",
         stats.shared_hit_tokens),
        ("vllm:prompt_tokens_total", "counter", "Prompt tokens prefilled.", eng.counters.prompt_tokens),
        ("vllm:generation_tokens_total", "counter", "Tokens sampled.", eng.counters.generation_tokens),
        ("burstrl:decode_steps_total", "counter", "Batched decode steps run.", eng.counters.decode_steps),
        ("burstrl:kv_evictions_total", "counter", "Idle session caches evicted.", stats.evictions),
        ("burstrl:kv_evicted_tokens_total", "counter", "Tokens of evicted caches.", stats.evicted_tokens),
        ("burstrl:kv_refills_total", "counter", "Sessions re-prefilled after eviction.", stats.refills),
        ("burstrl:kv_thrash_total", "counter", "Evictions of a session soon after its re-fill.", stats.thrash),
        ("burstrl:live_sessions", "gauge", "Sessions held by this replica.", len(rep.sessions.snapshot())),
        ("burstrl:sessions_expired_total", "counter", "Sessions released by the idle TTL or their lifetime.", rep.sessions.expired),
        ("burstrl:capture_tokens", "gauge", "Token ids held by all sessions' captures (deltas).",
         rep.sessions.captured_tokens),
        ("burstrl:capture_calls_total", "counter", "Calls recorded.", rep.sessions.captured_calls),
        ("burstrl:capture_dropped_calls_total", "counter", "Calls served but not recorded (past a capture cap).",
         rep.sessions.dropped_calls),
        ("burstrl:capture_diverged_calls_total", "counter", "Recorded calls whose prompt did not extend "
         "their session's previous call.", rep.sessions.diverged_calls),
        ("burstrl:client_disconnects_total", "counter", "Requests aborted by client disconnect.",
         rep.counters.client_disconnects),
        ("burstrl:bad_requests_total", "counter", "Requests refused with a 4xx.", rep.counters.bad_requests),
        ("burstrl:uploads_refused_total", "counter", "Adapter loads/uploads refused.", rep.counters.uploads_refused),
        ("burstrl:failed_requests_total", "counter", "Requests failed alone inside the engine (the engine served on).",
         eng.counters.failed_requests),
        ("burstrl:engine_step_failures_total", "counter", "Forward passes that raised (their requests failed).",
         eng.counters.step_failures),
    ]
    if rep.chat is not None:
        rows.append(("burstrl:chat_continuity_breaks_total", "counter",
                     "Session chat calls re-tokenized (history did not extend the last call).", rep.chat.breaks))
    lines = []
    for name, kind, help_text, value in rows:
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name}{{{label}}} {float(value)}"]
    lines += ["# HELP vllm:request_success_total Finished requests by reason.",
              "# TYPE vllm:request_success_total counter"]
    for reason, count in sorted(eng.counters.requests.items()):
        lines.append(f'vllm:request_success_total{{{label},finished_reason="{reason}"}} {float(count)}')
    return "\n".join(lines) + "\n"
