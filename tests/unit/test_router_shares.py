"""Admission of new sessions among tenants (router/shares.py): weighted fair order, quotas, waiters
that give up, the deadline, and nothing at all when it is not configured."""

from __future__ import annotations

import asyncio
import re
from typing import Any

import pytest

from burstrl.config import RouteConfig
from burstrl.router.registry import Registry, RouteError
from burstrl.router.shares import Shares
from tests.router_deaths import DEATHS, end_replica


async def never_gone() -> bool:
    return False


def fleet(replicas: int = 2, per_replica: int = 2, **cfg: Any) -> tuple[Registry, Shares]:
    reg = Registry()
    for i in range(replicas):
        reg.add(f"http://127.0.0.1:{9000 + i}")
    shares = Shares(RouteConfig(max_sessions_per_replica=per_replica, **cfg), reg, poll_s=0.01)
    return reg, shares


def fill(reg: Registry, tenant: str, count: int, start: int = 0) -> list[str]:
    """`count` live sessions of `tenant` homed on the first replica."""
    url = next(iter(reg.replicas))
    keys = [f"{tenant}~s{start + i}" for i in range(count)]
    for key in keys:
        reg.homes[key] = url
    return keys


async def open_session(shares: Shares, reg: Registry, tenant: str, key: str, order: list[str]) -> None:
    """What the router does with a new session: admission, then the session is homed."""
    async with shares.admission(tenant, f"{tenant}~{key}", never_gone):
        reg.homes[f"{tenant}~{key}"] = next(iter(reg.replicas))
        order.append(f"{tenant}:{key}")


async def free_one(shares: Shares, reg: Registry, key: str) -> None:
    reg.forget(key)
    shares.dispatch(force=True)
    for _ in range(5):
        await asyncio.sleep(0)


def test_off_by_default_admits_at_once() -> None:
    reg = Registry()
    reg.add("http://127.0.0.1:9000")
    shares = Shares(RouteConfig(), reg)
    assert not shares.enabled
    fill(reg, "a", 10_000)

    async def main() -> None:
        async with shares.admission("a", "a~new", never_gone):
            pass

    asyncio.run(asyncio.wait_for(main(), 1))
    assert reg.counters.admitted == 0 and not shares.pending


def test_known_sessions_and_calls_without_a_session_always_pass() -> None:
    reg, shares = fleet(replicas=1, per_replica=1)
    fill(reg, "a", 1)

    async def main() -> None:
        async with shares.admission("a", "a~s0", never_gone):  # placed already
            pass
        async with shares.admission("a", "a~s0/1", never_gone):  # a sample of a placed session
            pass
        async with shares.admission("a", None, never_gone):  # no session id: not counted, not queued
            pass

    asyncio.run(asyncio.wait_for(main(), 1))
    assert reg.counters.admission_waits == 0


def test_quota_refuses_with_429_naming_the_limit() -> None:
    reg, shares = fleet(per_replica=0, tenants={"a": {"max_sessions": 2}})
    assert shares.enabled
    fill(reg, "a", 2)

    async def main() -> None:
        async with shares.admission("b", "b~x", never_gone):  # another tenant is not capped
            pass
        with pytest.raises(RouteError) as exc:
            async with shares.admission("a", "a~x", never_gone):
                pass
        assert exc.value.status == 429 and "max_sessions = 2" in exc.value.message

    asyncio.run(main())
    assert reg.counters.admission_quota_refusals == 1


def test_weighted_order_when_places_free() -> None:
    """4 places held by a; a (weight 1) queued first, b (weight 3) after: b gets 3 of the 4 freed places."""
    reg, shares = fleet(tenants={"b": {"weight": 3}})
    held = fill(reg, "a", 4)
    order: list[str] = []

    async def main() -> None:
        tasks = [asyncio.create_task(open_session(shares, reg, "a", f"w{i}", order)) for i in range(4)]
        await asyncio.sleep(0.02)
        tasks += [asyncio.create_task(open_session(shares, reg, "b", f"w{i}", order)) for i in range(4)]
        await asyncio.sleep(0.02)
        assert order == [] and shares.waiting() == 8
        for key in held:
            await free_one(shares, reg, key)
        assert order == ["b:w0", "b:w1", "b:w2", "a:w0"]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(asyncio.wait_for(main(), 5))
    assert shares.waiting() == 0 and not shares.pending
    assert reg.counters.admission_waits == 8 and reg.counters.admission_abandoned == 4


def test_tenant_below_its_share_goes_before_an_older_waiter_above_it() -> None:
    reg, shares = fleet(replicas=1, per_replica=3)
    held = fill(reg, "a", 3)
    order: list[str] = []

    async def main() -> None:
        first = asyncio.create_task(open_session(shares, reg, "a", "old", order))
        await asyncio.sleep(0.02)
        second = asyncio.create_task(open_session(shares, reg, "b", "new", order))
        await asyncio.sleep(0.02)
        await free_one(shares, reg, held[0])
        assert order == ["b:new"]  # b has 0 live, a 2: b first although a waited longer
        await free_one(shares, reg, held[1])
        assert order == ["b:new", "a:old"]  # ties (1 vs 1 per weight) and a alone waits: a
        await asyncio.gather(first, second)

    asyncio.run(asyncio.wait_for(main(), 5))


def test_alone_a_tenant_takes_every_place_and_a_new_replica_adds_places() -> None:
    reg, shares = fleet(replicas=1, per_replica=2)
    order: list[str] = []

    async def main() -> None:
        for i in range(2):
            await open_session(shares, reg, "a", f"s{i}", order)  # no reservation for anyone else
        third = asyncio.create_task(open_session(shares, reg, "a", "s2", order))
        await asyncio.sleep(0.03)
        assert order == ["a:s0", "a:s1"]
        reg.add("http://127.0.0.1:9100")
        await asyncio.wait_for(third, 1)  # picked up at the waiter's next tick
        assert order[-1] == "a:s2"

    asyncio.run(asyncio.wait_for(main(), 5))
    assert reg.counters.admitted == 3 and reg.counters.admission_waits == 1


def test_waiter_whose_client_hangs_up_leaves_the_queue() -> None:
    reg, shares = fleet(replicas=1, per_replica=1)
    fill(reg, "a", 1)
    hung_up = False

    async def gone() -> bool:
        return hung_up

    async def main() -> None:
        nonlocal hung_up
        task = asyncio.create_task(shares.admit("b~x", "b", gone))
        await asyncio.sleep(0.03)
        assert shares.waiting() == 1
        hung_up = True
        with pytest.raises(RouteError) as exc:
            await asyncio.wait_for(task, 1)
        assert exc.value.status == 499

    asyncio.run(main())
    assert shares.waiting() == 0 and not shares.queues and reg.counters.admission_abandoned == 1


def test_deadline_gives_503_naming_the_reason() -> None:
    reg, shares = fleet(replicas=1, per_replica=1, admission_timeout_s=0.1)
    fill(reg, "a", 1)

    async def main() -> None:
        with pytest.raises(RouteError) as exc:
            await asyncio.wait_for(shares.admit("b~x", "b", never_gone), 2)
        assert exc.value.status == 503 and "admission_timeout_s" in exc.value.message

    asyncio.run(main())
    assert shares.waiting() == 0 and reg.counters.admission_timeouts == 1


def test_failed_placement_frees_its_place() -> None:
    reg, shares = fleet(replicas=1, per_replica=1)

    async def main() -> None:
        with pytest.raises(RouteError):
            async with shares.admission("a", "a~x", never_gone):
                raise RouteError(404, "model not found")
        assert not shares.pending
        async with shares.admission("b", "b~y", never_gone):  # the place is free again: no wait
            pass

    asyncio.run(asyncio.wait_for(main(), 1))
    assert reg.counters.admission_waits == 0


def test_config_refuses_unknown_keys_and_bad_values() -> None:
    from pydantic import ValidationError

    for bad in ({"tenants": {"a": {"wieght": 2}}}, {"tenants": {"a": {"weight": 0}}},
                {"tenants": {"a": {"max_sessions": -1}}}, {"max_sessions_per_replica": -1}):
        with pytest.raises(ValidationError, match="wieght|weight|max_sessions"):
            RouteConfig(**bad)
    cfg = RouteConfig(tenants={"run-a": {"weight": 2}})
    assert cfg.tenants["run-a"].weight == 2 and cfg.tenants["run-a"].max_sessions == 0


def test_config_refuses_a_tenant_name_no_token_can_carry() -> None:
    """A key of `router.tenants` that is no tenant name would silently apply to nobody: refused at load,
    the key named. `''` (the fleet's own sessions, without tenancy) stays allowed."""
    from pydantic import ValidationError

    from burstrl.config import RunConfig
    from burstrl.config.loading import ConfigError, load_config

    for bad in ("Run-A", "run-a~x", "-run", "a" * 33, "run a", "run_a", "ä"):
        with pytest.raises(ValidationError, match=rf"key {re.escape(repr(bad))} of router\.tenants is not a tenant"):
            RouteConfig(tenants={bad: {"weight": 2}})
    with pytest.raises(ConfigError, match=r"router\.tenants.*key 'Run-A' of router\.tenants is not a tenant name"):
        load_config(RunConfig, [], ["--router.tenants.Run-A.weight", "2"])
    cfg = RouteConfig(tenants={"run-a": {}, "0" * 32: {}, "": {"max_sessions": 4}})
    assert set(cfg.tenants) == {"run-a", "0" * 32, ""}


def test_pick_is_the_simulators_rule() -> None:
    """The router's pick and `tenant_sim.pick_fair` choose the same tenant on random queues."""
    import random
    from collections import Counter, deque
    from types import SimpleNamespace

    from burstrl.router.shares import Waiter, pick_tenant
    from burstrl.router.tenant_sim import pick_fair

    rng = random.Random(0)
    names = ["a", "b", "c"]
    for _ in range(500):
        weights = [rng.choice([0.5, 1.0, 2.0, 3.0]) for _ in names]
        admitted = [rng.randrange(6) for _ in names]
        heads = [rng.random() if rng.random() < 0.7 else None for _ in names]
        sim = [deque([SimpleNamespace(arrival_s=h)]) if h is not None else deque() for h in heads]
        mine = {n: deque([Waiter(f"{n}~x", n, h)]) for n, h in zip(names, heads, strict=True) if h is not None}
        expected = pick_fair(sim, admitted, weights)
        by_name = dict(zip(names, weights, strict=True))
        got = pick_tenant(mine, Counter(dict(zip(names, admitted, strict=True))), by_name.__getitem__)
        assert got == (None if expected is None else names[expected])


def test_a_dead_replica_releases_its_sessions_places_at_once() -> None:
    """Sessions homed on a replica that is removed (deregistered, or dropped on a failed call or a
    503 scrape) or leaves rotation (unanswered scrapes, a rejected answer) hold no place from then
    on; before, they counted until pruning forgot them, holding their tenant below its share."""
    for death in DEATHS:
        reg, shares = fleet(replicas=3, per_replica=2)
        dead, other, _ = reg.replicas
        mine = fill(reg, "a", 2)  # both on the first replica
        reg.homes["b~s0"] = other
        assert shares.live() == {"a": 2, "b": 1}
        end_replica(reg, dead, death)
        assert all(key in reg.homes for key in mine), death  # still remembered: a next call re-homes them
        assert shares.live() == {"b": 1}, death
        assert shares.stats()["live"] == 1 and shares.stats()["places"] == 4, death


def test_a_tenant_at_quota_on_a_dead_replica_may_start_sessions_again() -> None:
    reg, shares = fleet(replicas=2, per_replica=0, tenants={"a": {"max_sessions": 2}})
    dead, alive = reg.replicas
    fill(reg, "a", 2)

    async def main() -> None:
        with pytest.raises(RouteError) as refused:
            async with shares.admission("a", "a~new", never_gone):
                pass
        assert refused.value.status == 429  # control: the quota holds while its sessions are live
        reg.remove(dead)
        async with shares.admission("a", "a~new", never_gone):
            reg.homes["a~new"] = alive

    asyncio.run(asyncio.wait_for(main(), 1))
    assert reg.counters.admission_quota_refusals == 1 and shares.live() == {"a": 1}


def test_a_waiter_gets_the_places_a_dead_replicas_sessions_held() -> None:
    """Every place is held, one replica's by tenant a; it dies: b's waiting session is admitted on the
    next poll, not after the sessions' grace (30 min), though the fleet has one replica's places fewer."""
    reg, shares = fleet(replicas=2, per_replica=2)
    dead, alive = reg.replicas
    fill(reg, "a", 2)
    for i in range(2):
        reg.homes[f"b~s{i}"] = alive
    order: list[str] = []

    async def main() -> None:
        waiting = asyncio.create_task(open_session(shares, reg, "c", "s0", order))
        await asyncio.sleep(0.05)
        assert shares.waiting() == 1 and not order
        reg.scrape_failed(dead, 503)  # the replica's engine died: dropped
        assert shares.places() == 2 and shares.live() == {"b": 2}
        reg.forget("b~s1")  # one of the live replica's sessions ends: that place is free now
        await asyncio.wait_for(waiting, 1)

    asyncio.run(asyncio.wait_for(main(), 2))
    assert order == ["c:s0"]


def test_live_and_kv_held_agree_on_which_replicas_hold_places() -> None:
    """One rule (`Shares.healthy_urls`) for both figures: a draining replica's sessions still count in
    each (they run there), a dead one's in neither, for every way a replica is lost."""
    for death in DEATHS:
        reg, shares = fleet(replicas=3, per_replica=2, tenants={"a": {"max_kv_tokens": 10**9}})
        dead, draining, _ = reg.replicas
        reg.homes["a~s0"], reg.homes["a~s1"] = dead, draining
        reg.replicas[draining].draining = True
        held = shares.kv_held("a")
        assert shares.live() == {"a": 2} and held > 0, death
        end_replica(reg, dead, death)
        assert draining in shares.healthy_urls() and dead not in shares.healthy_urls(), death
        assert shares.live() == {"a": 1} and shares.kv_held("a") == held / 2, death
