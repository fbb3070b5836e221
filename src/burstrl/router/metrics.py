"""The router's `/metrics`: `/v1/stats` as Prometheus text.

Why apart from the registry: it is a rendering of the stats, and label values come from replicas
(version names) and registrations (URLs), so they are escaped here as the text format requires; a
version named with a quote or a newline must not forge or break other series.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from burstrl.router.registry import RouterCounters

COUNTERS = tuple(f.name for f in fields(RouterCounters))


def prometheus_text(stats: dict[str, Any]) -> str:
    """`/v1/stats` as Prometheus text: totals as counters/gauges, per-replica gauges by label."""
    totals = stats["totals"]
    lines = []
    for name, kind in (*((c, "counter") for c in COUNTERS), ("sessions", "gauge"), ("replicas", "gauge")):
        metric = f"burstrl_router_{name}" + ("_total" if kind == "counter" else "")
        lines += [f"# TYPE {metric} {kind}", f"{metric} {totals[name]}"]
    for name in ("thrash", "evictions", "cache_hit_rate"):  # summed over the replicas' own counters
        metric = f"burstrl_router_fleet_{name}"
        lines += [f"# TYPE {metric} gauge", f"{metric} {float(totals[name])}"]
    lines.append("# TYPE burstrl_router_versions_in_use gauge")
    lines.append(f"burstrl_router_versions_in_use {stats['versions']['in_use']}")
    lines.append("# TYPE burstrl_router_version_live_sessions gauge")
    for version, count in stats["versions"]["live_sessions"].items():
        lines.append(f'burstrl_router_version_live_sessions{{version="{label(version)}"}} {count}')
    for field in ("sessions", "live_sessions", "used_tokens", "capacity_tokens", "projected_headroom",
                  "cache_hit_rate", "thrash", "evictions"):
        metric = f"burstrl_router_replica_{field}"
        lines.append(f"# TYPE {metric} gauge")
        for r in stats["replicas"]:
            lines.append(f'{metric}{{replica="{label(r["url"])}",pool="{label(r["pool"])}"}} {float(r[field])}')
    return "\n".join(lines) + "\n"


def label(value: str) -> str:
    """A Prometheus label value, escaped (backslash, double quote, newline)."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
