"""The shared fleet's autoscaler (launcher/fleet_autoscale.py): its signal and its rule, snapshot by snapshot.

Each case drives `decide` through a timeline of `/v1/stats` snapshots the way the fleet's loop does
(one a second), applying every decision to the pool as `Launcher.scale_on_demand` would.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import pytest

from burstrl.config import AutoscaleConfig, RunConfig
from burstrl.launcher.fleet_autoscale import (
    MARGIN,
    PRESSURE,
    SLACK,
    STEADY,
    Decision,
    Demand,
    FleetAutoscaler,
    Pool,
    SignalHistory,
    decide,
    demand_of,
    signal_of,
)
from burstrl.launcher.run import LaunchError

P = 2  # places per replica in these cases


def cfg(**kw: Any) -> AutoscaleConfig:
    return AutoscaleConfig(**{"enabled": True, "min_on_demand": 0, "max_on_demand": 4, "interval_s": 5.0, **kw})


@dataclass
class Sim:
    """A fleet under `decide`: `reserved` routable reserved replicas, an on-demand pool that becomes
    routable `start_s` after a decision adds to it, and the decisions taken so far."""

    a: AutoscaleConfig = field(default_factory=cfg)
    reserved: int = 1
    on_demand: int = 0
    start_s: float = 0.0
    now: float = 0.0
    history: SignalHistory = field(default_factory=SignalHistory)
    decisions: list[tuple[float, Decision]] = field(default_factory=list)
    ready_at: list[float] = field(default_factory=list)  # when each starting replica registers

    def starting(self) -> int:
        return sum(1 for t in self.ready_at if t > self.now)

    def routable(self) -> int:
        return self.reserved + self.on_demand - self.starting()

    def tick(self, live: int, waiting: int = 0, places: int | None = None) -> Decision:
        """One snapshot (`places` None: P x routable replicas) and its decision, applied."""
        d = Demand(P * self.routable() if places is None else places, live, waiting)
        decision, self.history = decide(d, Pool(self.on_demand, self.starting()), P, self.a, self.history, self.now)
        self.apply(decision)
        return decision

    def apply(self, decision: Decision) -> None:
        if decision.target > self.on_demand:
            self.ready_at += [self.now + self.start_s] * (decision.target - self.on_demand)
        elif decision.target < self.on_demand:
            self.ready_at = sorted(self.ready_at)[: decision.target]
        if decision.target != self.on_demand or decision.event:
            self.decisions.append((self.now, decision))
        self.on_demand = decision.target

    def run(self, seconds: float, live: int | Any, waiting: int | Any = 0) -> None:
        """Snapshots once a second for `seconds`; live/waiting may be functions of the sim."""
        end = self.now + seconds
        while self.now < end:
            self.tick(live(self) if callable(live) else live, waiting(self) if callable(waiting) else waiting)
            self.now += 1.0

    def changes(self) -> list[tuple[float, int]]:
        return [(t, d.target) for t, d in self.decisions if not d.event]


# ---- the signal of one snapshot ----
@pytest.mark.parametrize("d, starting, expected", [
    (Demand(places=4, live=4, waiting=1), 0, PRESSURE),  # a new session waits
    (Demand(places=4, live=4, waiting=2), 1, STEADY),  # the starting replica takes both waiters
    (Demand(places=4, live=4, waiting=3), 1, PRESSURE),  # ... but not three
    (Demand(places=2, live=4, waiting=0), 0, PRESSURE),  # a replica lost: its sessions re-homed over the places left
    (Demand(places=2, live=4, waiting=0), 1, STEADY),  # ... and its replacement is starting
    (Demand(places=4, live=4, waiting=0), 0, STEADY),  # full, nobody waits
    (Demand(places=4, live=1, waiting=0), 0, SLACK),  # 1 <= 0.75 x 2
    (Demand(places=4, live=2, waiting=0), 0, STEADY),  # fits one replica fewer, but with no margin
    (Demand(places=8, live=4, waiting=0), 0, SLACK),  # 4 <= 0.75 x 6
    (Demand(places=8, live=5, waiting=0), 0, STEADY),
    (Demand(places=4, live=0, waiting=0), 1, STEADY),  # idle, but a replica is on its way: nothing removed now
    (Demand(places=2, live=0, waiting=0), 0, STEADY),  # idle on the last routable replica: it stays
    (Demand(places=0, live=0, waiting=0), 0, STEADY),  # no routable replica, no demand
    (Demand(places=0, live=0, waiting=1), 0, PRESSURE),  # no routable replica and a session waits
])
def test_the_signal_of_a_snapshot(d: Demand, starting: int, expected: str) -> None:
    signal, figures = signal_of(d, P, starting)
    assert signal == expected, figures
    assert f"{d.live} live + {d.waiting} waiting in {d.places} places" in figures


def test_the_margin_is_a_hysteresis() -> None:
    """Right after a removal the places are at most 1 - MARGIN used: never pressure at once."""
    for replicas in range(2, 12):
        for live in range(0, P * replicas + 1):
            if signal_of(Demand(P * replicas, live, 0), P, 0)[0] == SLACK:
                assert live <= (1 - MARGIN) * P * (replicas - 1)
                assert signal_of(Demand(P * (replicas - 1), live, 0), P, 0)[0] != PRESSURE


@pytest.mark.parametrize("stats, expected", [
    ({"admission": {"enabled": True, "places": 4, "live": 3, "waiting": 1}}, Demand(4, 3, 1)),
    ({"totals": {}, "admission": {"places": "4", "live": 0, "waiting": 0}}, Demand(4, 0, 0)),
    ({"admission": {"enabled": False, "places": -1, "live": 3, "waiting": 0}}, None),  # no per-replica places
    ({"admission": {"places": 4, "live": 3}}, None),
    ({"admission": {"places": None, "live": 3, "waiting": 0}}, None),
    ({"admission": "on"}, None),
    ({}, None),
    (None, None),  # the router did not answer
])
def test_demand_of_a_stats_body(stats: dict[str, Any] | None, expected: Demand | None) -> None:
    assert demand_of(stats) == expected


# ---- the rule over time ----
def test_a_burst_adds_replicas_once_it_has_lasted_an_interval() -> None:
    sim = Sim()
    sim.run(3, live=2, waiting=3)  # a short burst: gone before interval_s
    sim.run(10, live=2)
    assert sim.changes() == []
    sim.run(6, live=2, waiting=3)  # 3 over two places: two replicas in one step
    assert sim.changes() == [(sim.now - 1, 2)]
    _, decision = sim.decisions[-1]
    assert "2 live + 3 waiting in 2 places" in decision.reason and "3 sessions over" in decision.reason


def test_a_burst_is_capped_at_the_maximum_and_says_so_once() -> None:
    sim = Sim(a=cfg(max_on_demand=1))
    sim.run(20, live=2, waiting=9)
    assert sim.changes() == [(5.0, 1)]
    capped = [d for _, d in sim.decisions if d.event]
    assert len(capped) == 1 and capped[0].event == "autoscale_capped"
    assert "autoscale.max_on_demand = 1" in capped[0].reason


def test_idle_removes_one_replica_per_interval_down_to_the_minimum() -> None:
    sim = Sim(a=cfg(min_on_demand=1), on_demand=4)
    sim.run(60, live=0)
    assert sim.changes() == [(5.0, 3), (11.0, 2), (17.0, 1)]  # each streak starts at the first snapshot after a change
    assert all("fit in one replica fewer" in d.reason for _, d in sim.decisions)


def test_busy_fleet_holds() -> None:
    """Every place in use and nobody waiting: neither signal."""
    sim = Sim(on_demand=2)
    sim.run(60, live=6)
    assert sim.changes() == []


def test_the_signal_must_hold_on_every_snapshot() -> None:
    """Waiters every other second never make a streak of interval_s."""
    sim = Sim()
    sim.run(60, live=2, waiting=lambda s: int(s.now) % 2)
    assert sim.changes() == []


def test_no_figures_from_the_router_change_nothing_and_restart_the_streak() -> None:
    sim = Sim()
    sim.run(4, live=2, waiting=1)
    decision, sim.history = decide(None, Pool(0, 0), P, sim.a, sim.history, sim.now)
    assert decision.target == 0 and "no admission figures" in decision.reason
    sim.now += 1
    sim.run(4, live=2, waiting=1)
    assert sim.changes() == []
    sim.run(2, live=2, waiting=1)
    assert sim.changes() == [(10.0, 1)]


def test_one_tenant_flooding_grows_the_pool_to_its_maximum_only() -> None:
    """The router's figures are all tenants' together: a flood is demand like any other, bounded by the
    maximum (its fair share is the router's business, its quota caps what it can queue)."""
    sim = Sim(a=cfg(max_on_demand=3), start_s=3.0)

    def waiting(s: Sim) -> int:  # the flood keeps 20 sessions queued beyond whatever the fleet takes
        return 20

    sim.run(60, live=lambda s: P * s.routable(), waiting=waiting)
    assert sim.on_demand == 3 and max(t for t, _ in sim.changes()) == 5.0  # one step: 20 over -> capped at 3
    assert [d.event for _, d in sim.decisions if d.event] == ["autoscale_capped"]


def test_demand_met_by_starting_replicas_adds_no_more() -> None:
    """A replica that takes 20 s to start: while it starts, its places count, so no second one."""
    sim = Sim(start_s=20.0)
    sim.run(6, live=2, waiting=2)
    assert sim.changes() == [(5.0, 1)]
    sim.run(30, live=lambda s: 2 if s.starting() else 4, waiting=lambda s: 2 if s.starting() else 0)
    assert sim.changes() == [(5.0, 1)]


def test_a_replica_lost_without_replacement_is_made_up_by_on_demand() -> None:
    """Two reserved replicas full; one dies (replace_dead off) and its sessions are re-homed."""
    sim = Sim(reserved=2)
    sim.run(5, live=4)
    sim.reserved = 1
    sim.run(6, live=4)
    assert sim.changes() == [(10.0, 1)]
    assert "2 sessions over" in sim.decisions[-1][1].reason


def test_a_replica_lost_and_replaced_adds_nothing() -> None:
    """Two reserved replicas full; one dies and the launcher's replacement starts for 15 s: its places
    are on their way, so the re-homed sessions are no excess."""
    a, h = cfg(), SignalHistory()
    for t in range(40):
        lost = 5 <= t < 20
        d = Demand(places=P if lost else 2 * P, live=4, waiting=0)
        decision, h = decide(d, Pool(on_demand=0, starting=1 if lost else 0), P, a, h, float(t))
        assert decision.target == 0, (t, decision)


def test_a_pool_changed_from_outside_restarts_the_cool_down() -> None:
    """`burstrl scale` (or an on-demand replica lost): the pool seen differs from the last one."""
    a = cfg()
    h = SignalHistory()
    d = Demand(places=4, live=0, waiting=0)
    for t in range(4):
        decision, h = decide(d, Pool(2, 0), P, a, h, float(t))
    decision, h = decide(Demand(6, 0, 0), Pool(3, 0), P, a, h, 4.0)  # someone scaled to 3
    assert decision.target == 3
    for t in range(5, 9):
        decision, h = decide(Demand(6, 0, 0), Pool(3, 0), P, a, h, float(t))
        assert decision.target == 3
    decision, h = decide(Demand(6, 0, 0), Pool(3, 0), P, a, h, 9.0)
    assert decision.target == 2


def test_the_cool_down_after_a_decision() -> None:
    """After adding, even a persisting excess waits a whole interval before the next step."""
    sim = Sim(a=cfg(interval_s=5.0))
    sim.run(30, live=lambda s: P * s.routable(), waiting=5)
    times = [t for t, _ in sim.changes()]
    assert times[0] == 5.0 and all(b - a >= 5.0 for a, b in zip(times, times[1:], strict=False)) and len(times) > 1


@pytest.mark.parametrize("have, lo, hi, target", [(0, 2, 4, 2), (5, 0, 3, 3), (2, 1, 3, 2)])
def test_the_pool_is_brought_within_bounds_at_once(have: int, lo: int, hi: int, target: int) -> None:
    decision, _ = decide(Demand(4, 4, 0), Pool(have, 0), P, cfg(min_on_demand=lo, max_on_demand=hi), SignalHistory(), 0.0)
    assert decision.target == target
    if target != have:
        assert f"{lo}..{hi}" in decision.reason


def test_no_step_at_the_minimum_when_idle() -> None:
    sim = Sim(a=cfg(min_on_demand=1), on_demand=1)
    sim.run(30, live=0)
    assert sim.changes() == [] and not sim.decisions


def test_scale_down_then_up_again_when_demand_returns() -> None:
    sim = Sim(on_demand=2)
    sim.run(8, live=0)
    assert sim.on_demand == 1
    sim.run(20, live=lambda s: P * s.routable(), waiting=1)
    assert sim.on_demand >= 2


def test_pressure_excess_rounds_up_to_whole_replicas() -> None:
    sim = Sim()
    sim.run(6, live=2, waiting=1)
    assert sim.on_demand == math.ceil(1 / P)


# ---- the config it needs ----
def test_enabled_without_session_places_is_refused_with_the_fix() -> None:
    with pytest.raises(LaunchError, match="router.max_sessions_per_replica > 0"):
        FleetAutoscaler(RunConfig.model_validate({"autoscale": {"enabled": True}}))
    FleetAutoscaler(RunConfig.model_validate({"autoscale": {"enabled": True},
                                              "router": {"max_sessions_per_replica": 4}}))
    FleetAutoscaler(RunConfig.model_validate({}))  # off: nothing needed


def test_off_it_never_reads_the_router() -> None:
    class NoFleet:
        def __getattr__(self, name: str) -> Any:
            raise AssertionError(f"read {name}")

    FleetAutoscaler(RunConfig.model_validate({})).check(NoFleet())  # type: ignore[arg-type]
