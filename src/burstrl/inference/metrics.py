"""Prometheus text for a replica, with vLLM's metric names so existing dashboards and routers work.

Prefix-cache counters are in tokens (as vLLM's are). burstrl-only figures (evictions, re-fills,
thrashing, sessions, continuity) use the `burstrl:` prefix.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from burstrl.inference.backend import MetricRow

if TYPE_CHECKING:
    from burstrl.inference.replica import InferenceReplica


def prometheus_text(rep: InferenceReplica) -> str:
    eng = rep.engine
    label = f'model_name="{rep.cfg.served_model_name}"'
    rows: list[MetricRow] = [
        *eng.metric_rows(),
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
