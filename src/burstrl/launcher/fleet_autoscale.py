"""The shared fleet's autoscaler: the on-demand pool sized from all tenants' demand as the router sees it.

Why the router's admission figures and not a run's: a run's autoscaler reads its own trainer's wait
and its own store's buffer, which say nothing of the other tenants. What every tenant's demand has in
common is new sessions asking the router for a place: with `router.max_sessions_per_replica` = P > 0
the fleet has P places per routable (healthy, undrained) replica, and `/v1/stats` says how many are
there (`admission.places`), how many sessions of all tenants hold one (`live`) and how many new
sessions wait for one (`waiting`, router/shares.py). That is demand and capacity in one unit.

The signal (`signal_of`), from one snapshot plus the replicas the launcher is still starting (S,
any pool: they bring P places each once they register):

- pressure: live + waiting > places + P x S. New sessions wait beyond what the replicas already on
  their way will take, or live sessions exceed the places left (a routable replica was lost and no
  replacement is starting: its sessions were re-homed onto the others).
- slack: nobody waits, nothing starts, at least two replicas are routable, and live <= (1 - MARGIN)
  x (places - P): every live session would fit in one replica fewer with MARGIN of its places free.
- steady: anything else (and a snapshot the router did not give: unknown demand changes nothing).

The rule (`decide`, a pure function of the snapshot, the pool and the history): the pool is first
brought within autoscale.min_on_demand..max_on_demand. Then a signal that has held on every snapshot
for autoscale.interval_s, with no change of the pool for as long (the cool-down; a pool changed from
outside, by `burstrl scale` or a lost replica, restarts it too), decides: pressure adds
ceil(excess / P) on-demand replicas (a burst of many waiting sessions is met in one step, not one
replica per interval), up to the maximum; slack removes one (sessions end one by one: capacity is
given back as gradually, and a drained replica's sessions lose their KV). After a decision the
signal must hold a whole interval again. The margin makes a hysteresis: after a removal at most
1 - MARGIN of the places are used, and pressure needs more than all of them.

Why `router.max_sessions_per_replica` > 0 is required (the fleet refuses `autoscale.enabled`
without it): without places the router admits every session at once, so nothing ever waits and
capacity has no count in sessions; live sessions alone cannot say whether the fleet is short
(KV headroom per replica depends on each session's length). P is also the unit that turns excess
sessions into replicas.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from typing import Any

from burstrl.config import AutoscaleConfig, RunConfig
from burstrl.launcher.run import Launcher, LaunchError, _get_json

MARGIN = 0.25  # share of the remaining places left free after a removal (the hysteresis between the two signals)
OBSERVE_S = 1.0  # how often the router's figures are read (the streaks are only as fine as this)
PRESSURE, SLACK, STEADY = "pressure", "slack", "steady"


@dataclass(frozen=True)
class Demand:
    """One `/v1/stats` snapshot's admission figures (all tenants together)."""

    places: int  # P x routable replicas
    live: int  # sessions holding a place (placed, or admitted and being placed)
    waiting: int  # new sessions queued for a place


@dataclass(frozen=True)
class Pool:
    """What the launcher knows of its replicas at the moment of a decision."""

    on_demand: int  # on-demand replicas starting or up (draining ones are on their way out)
    starting: int  # replicas of any pool started and not yet registered


@dataclass(frozen=True)
class SignalHistory:
    """What `decide` remembers between snapshots."""

    signal: str = STEADY  # the signal of the current streak
    since: float = -math.inf  # when the current streak began
    changed: float = -math.inf  # when the on-demand pool last changed (ours or seen from outside)
    on_demand: int = -1  # the pool size at the last call (-1: no call yet)
    reported: bool = False  # the streak's hold at the maximum was reported


@dataclass(frozen=True)
class Decision:
    """The on-demand pool's target (== the pool: hold), why, and an event to record without a change."""

    target: int
    reason: str
    event: str = ""  # "autoscale_capped": pressure that the maximum holds back (once a streak)


def demand_of(stats: dict[str, Any] | None) -> Demand | None:
    """The admission figures of a `/v1/stats` body; None if absent or admission has no places."""
    admission = (stats or {}).get("admission")
    if not isinstance(admission, dict):
        return None
    try:
        places, live, waiting = (int(admission[k]) for k in ("places", "live", "waiting"))
    except (KeyError, TypeError, ValueError):
        return None
    if places < 0 or live < 0 or waiting < 0:  # places -1: the router runs without per-replica places
        return None
    return Demand(places, live, waiting)


def signal_of(d: Demand, per_replica: int, starting: int) -> tuple[str, str]:
    """PRESSURE, SLACK or STEADY for one snapshot (module docstring), and the figures that made it."""
    coming = per_replica * starting
    figures = f"{d.live} live + {d.waiting} waiting in {d.places} places" + (f" (+{coming} starting)" if coming else "")
    if d.live + d.waiting > d.places + coming:
        return PRESSURE, figures
    fewer = d.places - per_replica
    if not d.waiting and not starting and fewer >= per_replica and d.live <= (1 - MARGIN) * fewer:
        return SLACK, figures
    return STEADY, figures


def decide(d: Demand | None, pool: Pool, per_replica: int, cfg: AutoscaleConfig, h: SignalHistory,
           now: float) -> tuple[Decision, SignalHistory]:
    """The on-demand pool's target for this snapshot, and the history for the next (module docstring)."""
    have, lo, hi = pool.on_demand, cfg.min_on_demand, cfg.max_on_demand
    if h.on_demand >= 0 and have != h.on_demand:  # changed from outside since the last call: the cool-down restarts
        h = replace(h, changed=now, signal=STEADY, since=now)
    h = replace(h, on_demand=have)
    bound = lo if have < lo else hi if have > hi else have
    if bound != have:
        why = f"autoscale: {have} on-demand replicas, outside autoscale.min_on_demand..max_on_demand = {lo}..{hi}"
        return Decision(bound, why), _changed(h, bound, now)
    if d is None:
        return Decision(have, "no admission figures from the router"), replace(h, signal=STEADY, since=now)
    signal, figures = signal_of(d, per_replica, pool.starting)
    if signal != h.signal:
        h = replace(h, signal=signal, since=now, reported=False)
    held = now - max(h.since, h.changed)
    if signal == STEADY or held < cfg.interval_s:
        return Decision(have, f"{signal}: {figures}"), h
    if signal == SLACK:
        if have <= lo:
            return Decision(have, f"slack at autoscale.min_on_demand = {lo}: {figures}"), h
        why = f"autoscale: {figures} for {held:.0f} s: they fit in one replica fewer"
        return Decision(have - 1, why), _changed(h, have - 1, now)
    excess = d.live + d.waiting - d.places - per_replica * pool.starting
    target = min(hi, have + math.ceil(excess / per_replica))
    if target == have:
        first = not h.reported
        return (Decision(have, f"{figures} for {held:.0f} s, at autoscale.max_on_demand = {hi}",
                         "autoscale_capped" if first else ""), replace(h, reported=True))
    why = f"autoscale: {figures} for {held:.0f} s: {excess} sessions over"
    return Decision(target, why), _changed(h, target, now)


def _changed(h: SignalHistory, target: int, now: float) -> SignalHistory:
    """The history after the pool was set to `target`: a new streak, and the cool-down from now."""
    return replace(h, signal=STEADY, since=now, changed=now, on_demand=target, reported=False)


class FleetAutoscaler:
    """Reads the router's figures once a second and applies `decide` through `Launcher.scale_on_demand`."""

    def __init__(self, cfg: RunConfig, clock: Any = time.monotonic) -> None:
        """LaunchError if `autoscale.enabled` without session places (module docstring: why)."""
        self.cfg, self.clock = cfg.autoscale, clock
        self.per_replica = cfg.router.max_sessions_per_replica
        if self.cfg.enabled and self.per_replica <= 0:
            raise LaunchError("autoscale.enabled on a shared fleet needs router.max_sessions_per_replica > 0: the "
                              "fleet autoscaler sizes the on-demand pool from the sessions waiting for a place and "
                              "the places in use, and without per-replica places nothing waits (e.g. "
                              "--router.max_sessions_per_replica 16)")
        self.history = SignalHistory()
        self.last_observed = -math.inf

    def check(self, fleet: Launcher) -> None:
        """One tick of the fleet's supervising loop: a decision at most once per OBSERVE_S."""
        now = self.clock()
        if not self.cfg.enabled or now - self.last_observed < OBSERVE_S:
            return
        self.last_observed = now
        stats = _get_json(fleet.http, f"{fleet.router.url}/v1/stats") if fleet.http is not None else None
        f = fleet.fleet
        started = sum(f.count(p) for p in ("reserved", "on_demand"))  # starting or up
        pool = Pool(on_demand=f.count("on_demand"), starting=max(0, started - sum(f.alive().values())))
        decision, self.history = decide(demand_of(stats), pool, self.per_replica, self.cfg, self.history, now)
        if decision.target != pool.on_demand:
            fleet.scale_on_demand(decision.target, decision.reason)
        elif decision.event:
            fleet.event(decision.event, pool="on_demand", detail=decision.reason)
