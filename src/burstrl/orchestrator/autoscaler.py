"""When to grow or shrink the on-demand pool: from the trainer's waiting and the store's buffer.

Why these two signals: a trainer that spends a large share of its steps waiting for data is
starved (more replicas make rollouts faster), and groups piling up in the store beyond a couple of
batches only grow stale (fewer replicas waste nothing). Both are read from files the run writes
anyway (metrics.jsonl, the store), so the policy is a pure function the launcher calls.
"""

from __future__ import annotations

from dataclasses import dataclass

from burstrl.config import AutoscaleConfig


@dataclass
class FleetSignals:
    wait_fraction: float | None  # mean of wait_s / step_s over the trainer's recent steps; None = no step yet
    buffered_groups: int
    batch_groups: int
    on_demand: int  # on-demand replicas starting or up


def decide(cfg: AutoscaleConfig, s: FleetSignals) -> int:
    """+1 to add an on-demand replica, -1 to remove one, 0 to hold (always within min..max)."""
    if s.on_demand < cfg.min_on_demand:
        return 1
    if s.on_demand > cfg.max_on_demand:
        return -1
    starving = s.wait_fraction is not None and s.wait_fraction > cfg.wait_fraction
    overflowing = s.buffered_groups > cfg.overflow_batches * s.batch_groups
    if starving and not overflowing and s.on_demand < cfg.max_on_demand:
        return 1
    if overflowing and s.on_demand > cfg.min_on_demand:
        return -1
    return 0


def wait_fraction(steps: list[dict], window: int = 3) -> float | None:
    """Share of the last `window` steps' time the trainer spent waiting for a batch."""
    recent = [m for m in steps[-window:] if m.get("step_s")]
    if not recent:
        return None
    return sum(float(m.get("wait_s", 0.0)) for m in recent) / sum(float(m["step_s"]) for m in recent)
