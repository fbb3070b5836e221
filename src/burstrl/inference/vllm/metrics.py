"""vLLM's /metrics read into the figures a replica reports (`/v1/loads`, `/metrics`).

Why from vLLM's own figures: the router's KV-headroom policy and thrashing monitor need capacity
and usage of the cache that actually holds the keys, which only vLLM knows.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


@dataclass(frozen=True)
class VllmFigures:
    """One scrape of vLLM's /metrics (sums over its engines)."""

    running: int = 0
    waiting: int = 0
    usage: float = 0.0  # KV cache usage, 0-1
    capacity_tokens: int = 0
    prefix_queries: float = 0.0  # tokens
    prefix_hits: float = 0.0
    prompt_tokens: float = 0.0
    generation_tokens: float = 0.0
    preemptions: float = 0.0
    block_size: int = 16  # tokens per KV block (vLLM's default until its cache config is read)


def parse(text: str) -> VllmFigures:
    """The figures from Prometheus text (unknown or malformed lines are skipped)."""
    sums: dict[str, float] = {}
    capacity, block_size = 0, 0
    for line in text.splitlines():
        m = _LINE.match(line)
        if m is None or line.startswith("#"):
            continue
        name, labels, value = m.group(1), m.group(2) or "", m.group(3)
        try:
            number = float(value)
        except ValueError:
            continue
        if name == "vllm:cache_config_info":
            info = dict(_LABEL.findall(labels))
            tokens, block = info.get("kv_cache_size_tokens", ""), info.get("block_size", "")
            capacity += int(tokens) if tokens.isdigit() else 0
            block_size = max(block_size, int(block) if block.isdigit() else 0)
            continue
        sums[name] = sums.get(name, 0.0) + number
    usage = sums.get("vllm:kv_cache_usage_perc", 0.0)
    return VllmFigures(
        running=int(sums.get("vllm:num_requests_running", 0)), waiting=int(sums.get("vllm:num_requests_waiting", 0)),
        usage=min(max(usage, 0.0), 1.0), capacity_tokens=capacity,
        prefix_queries=sums.get("vllm:prefix_cache_queries_total", 0.0),
        prefix_hits=sums.get("vllm:prefix_cache_hits_total", 0.0),
        prompt_tokens=sums.get("vllm:prompt_tokens_total", 0.0),
        generation_tokens=sums.get("vllm:generation_tokens_total", 0.0),
        preemptions=sums.get("vllm:num_preemptions_total", 0.0), block_size=block_size or 16)
