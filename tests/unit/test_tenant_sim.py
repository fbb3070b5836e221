"""Tenants on one fleet, simulated: fair admission order, the dedicated split, Jain's index, and
small shared-vs-dedicated runs (sharing wins when trainer pauses are long; a flood starves no one)."""

from collections import deque

import pytest

from burstrl.router import tenant_sim
from burstrl.router.sim import TaskKind, TraceSession
from burstrl.router.tenant_sim import TenantSimConfig, TenantSpec, dedicated_split, jain, pick_fair, run_modes

SHORT = TaskKind(calls_min=2, calls_max=4, prompt_tokens=1000, tool_tokens=200, output_tokens=100, tool_time_s=1.0)


def waiting(*arrivals: float) -> deque:
    return deque(TraceSession(f"s{a}", "swe", a, []) for a in arrivals)


def test_fair_admission_serves_the_fewest_admitted_per_weight_then_the_oldest():
    queues = [waiting(5.0), waiting(1.0), waiting()]
    assert pick_fair(queues, admitted=[3, 4, 0], weights=[1, 2, 1]) == 1  # 4/2 < 3/1; the idle one has nothing
    assert pick_fair(queues, admitted=[2, 4, 0], weights=[1, 2, 1]) == 1  # a tie: the older head
    assert pick_fair(queues, admitted=[1, 4, 0], weights=[1, 2, 1]) == 0
    assert pick_fair([waiting(), waiting()], admitted=[0, 0], weights=[1, 1]) is None


def test_dedicated_split_sums_to_the_fleet_in_proportion_to_weight():
    assert sorted(dedicated_split(128, [1.0] * 10)) == [12, 12] + [13] * 8
    weights = [1, 1, 1, 1, 1, 2, 2, 2, 4, 4]
    split = dedicated_split(128, weights)
    assert sum(split) == 128
    assert all(abs(n - 128 * w / sum(weights)) < 1 for n, w in zip(split, weights, strict=True))
    assert dedicated_split(3, [100, 1, 1]) == [1, 1, 1]  # everyone gets a replica
    with pytest.raises(ValueError):
        dedicated_split(2, [1, 1, 1])


def test_jain_index_on_known_inputs():
    assert jain([1, 1, 1, 1]) == pytest.approx(1.0)
    assert jain([1, 0, 0, 0]) == pytest.approx(0.25)
    assert jain([1, 2]) == pytest.approx(0.9)


def two_runs(step_s: float, **first: object) -> TenantSimConfig:
    """Two synchronous runs whose batch (24) outgrows a dedicated half (2 replicas x 4 places), the
    second starting half a cycle later, so one samples while the other's trainer steps."""
    specs = [TenantSpec("a", batch=24, group_size=4, step_s=step_s, step_jitter=0.0, async_level=0, burst_s=1.0,
                        kind=SHORT, **first),
             TenantSpec("b", batch=24, group_size=4, step_s=step_s, step_jitter=0.0, async_level=0, burst_s=1.0,
                        kind=SHORT, start_s=step_s / 2)]
    return TenantSimConfig(tenants=specs, replicas=4, sessions_per_replica=4, horizon_s=900.0, seed=3)


def test_same_seed_same_figures():
    cfg = two_runs(60.0)
    assert run_modes(cfg) == run_modes(cfg)


def test_sharing_wins_when_trainer_pauses_are_long():
    res = run_modes(two_runs(120.0))
    shared, dedicated = res["shared"], res["dedicated"]
    assert shared["rollouts_per_s"] > 1.15 * dedicated["rollouts_per_s"]
    assert shared["p50_session_s"] < dedicated["p50_session_s"]  # a burst spreads over twice the places
    assert dedicated["tenants"][0]["replicas"] == 2
    assert shared["jain_all_active"] > 0.9


def test_no_gain_without_idle_share():
    """The contrast: runs that always have more work than places (no pauses felt, async 2) keep
    every place busy either way, and sharing has nothing to lend."""
    cfg = two_runs(1.0)
    for spec in cfg.tenants:
        spec.async_level, spec.start_s = 2, 0.0
    res = run_modes(cfg)
    shared, dedicated = res["shared"], res["dedicated"]
    assert dedicated["slot_occupancy"] > 0.95
    assert shared["rollouts_per_s"] == pytest.approx(dedicated["rollouts_per_s"], rel=0.05)


def flood_run() -> TenantSimConfig:
    cfg = two_runs(30.0, max_in_flight=80)
    cfg.tenants[0].batch, cfg.tenants[0].burst_s = 80, 0.0  # 10x its share of 8 places, at once
    return cfg


def test_a_flood_does_not_push_another_tenant_below_its_share():
    res = run_modes(flood_run())
    b_shared, b_dedicated = res["shared"]["tenants"][1], res["dedicated"]["tenants"][1]
    assert b_shared["rollouts"] >= 0.9 * b_dedicated["rollouts"]
    assert res["shared"]["tenants"][0]["slot_share"] > 0.5  # the flood got the idle share


def test_without_fair_admission_the_flood_starves_the_other(monkeypatch):
    """The control: first come, first served lets the flood hold the fleet; the check above can fail."""
    def fifo(queues: list[deque], admitted: list[int], weights: list[float]) -> int | None:
        heads = [(q[0].arrival_s, i) for i, q in enumerate(queues) if q]
        return min(heads)[1] if heads else None

    monkeypatch.setattr(tenant_sim, "pick_fair", fifo)
    res = run_modes(flood_run(), modes=("shared",))
    fair = run_modes(flood_run(), modes=("dedicated",))
    assert res["shared"]["tenants"][1]["rollouts"] < 0.9 * fair["dedicated"]["tenants"][1]["rollouts"]
