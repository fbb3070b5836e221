"""KV-token quotas of tenants (router/kv_quota.py, router/shares.py): a tenant at its cap is refused a
new session with a 429 naming the setting, others are not; released sessions and sessions of a dead
replica free their tokens; the figure is placement's projection of final sizes, not current sizes."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from burstrl.config import RouteConfig
from burstrl.router.kv_quota import homed_kv
from burstrl.router.policies import NewSession, projected_headroom, record_assignment
from burstrl.router.registry import Registry, RouteError
from burstrl.router.shares import Shares
from tests.router_deaths import DEATHS, end_replica

PRIOR = 8192  # SizeModel's prior: a new session of an unseen kind is projected at this size


async def never_gone() -> bool:
    return False


def fleet(replicas: int = 2, per_replica: int = 0, **limits: Any) -> tuple[Registry, Shares]:
    reg = Registry()
    for i in range(replicas):
        view = reg.add(f"http://127.0.0.1:{9000 + i}", capacity_tokens=1_000_000)
        view.versions = {"base"}
    tenants = {name: {"max_kv_tokens": cap} for name, cap in limits.items()}
    return reg, Shares(RouteConfig(max_sessions_per_replica=per_replica, tenants=tenants), reg, poll_s=0.01)


def home(reg: Registry, key: str, replica: int = 0, tokens: int | None = None) -> None:
    """A placed session; `tokens`: the size its home reported at the last scrape (None: not scraped yet)."""
    view = list(reg.replicas.values())[replica]
    reg.homes[key] = view.id
    if tokens is not None:
        view.live_sessions = {**view.live_sessions, key: tokens}


async def admit(shares: Shares, tenant: str, key: str, expected: int = 0) -> None:
    async with shares.admission(tenant, key, never_gone, "default", expected):
        home(shares.registry, key)


def refused(shares: Shares, tenant: str, key: str, expected: int = 0) -> RouteError:
    with pytest.raises(RouteError) as exc:
        asyncio.run(admit(shares, tenant, key, expected))
    return exc.value


def test_tenant_at_its_cap_is_refused_naming_the_setting_and_another_is_admitted() -> None:
    reg, shares = fleet(**{"run-a": 2 * PRIOR + 100})
    assert shares.enabled
    for i in range(2):
        asyncio.run(admit(shares, "run-a", f"run-a~s{i}"))
    assert shares.kv_held("run-a") == 2 * PRIOR
    error = refused(shares, "run-a", "run-a~s2")
    assert error.status == 429 and error.kind == "rate_limit_error"
    assert f"router.tenants.run-a.max_kv_tokens = {2 * PRIOR + 100}" in error.message
    assert "run-a~s2" not in reg.homes and not shares.pending and not shares.pending_kv
    for i in range(5):  # honest control: another tenant (no cap) is admitted
        asyncio.run(admit(shares, "run-b", f"run-b~s{i}"))
    asyncio.run(admit(shares, "run-a", "run-a~s0"))  # a known session's calls always pass
    assert reg.counters.admission_kv_quota_refusals == 1 and reg.counters.admission_quota_refusals == 0


def test_released_session_frees_its_tokens() -> None:
    reg, shares = fleet(a=PRIOR)
    asyncio.run(admit(shares, "a", "a~s0"))
    assert refused(shares, "a", "a~s1").status == 429
    reg.forget("a~s0")  # a trace DELETE (or pruning)
    assert shares.kv_held("a") == 0
    asyncio.run(admit(shares, "a", "a~s1"))
    assert reg.counters.admission_kv_quota_refusals == 1


@pytest.mark.parametrize("death", DEATHS)
def test_dead_replicas_sessions_free_their_tokens(death: str) -> None:
    reg, shares = fleet(a=2 * PRIOR)
    dead, _ = reg.replicas
    home(reg, "a~s0", 0, tokens=500)
    home(reg, "a~s1", 0)
    assert refused(shares, "a", "a~new").status == 429  # control: the cap holds while they are live
    end_replica(reg, dead, death)
    assert "a~s0" in reg.homes and shares.kv_held("a") == 0
    asyncio.run(admit(shares, "a", "a~new"))
    assert "a~new" in reg.homes and reg.counters.admission_kv_quota_refusals == 1


def test_projected_final_sizes_not_current_sizes() -> None:
    """A session scraped at 10 tokens weighs its projection (the prior), one that outgrew it weighs its
    size now; a caller's hint only raises a new session's weight."""
    reg, shares = fleet(a=100_000)
    home(reg, "a~small", tokens=10)
    home(reg, "a~big", tokens=30_000)
    assert shares.kv_held("a") == PRIOR + 30_000
    error = refused(shares, "a", "a~huge", expected=70_000)  # 38192 + 70000 > 100000
    assert "this new session 70000 more" in error.message
    asyncio.run(admit(shares, "a", "a~hinted", expected=10))  # a low hint does not lower the prior
    assert shares.kv_held("a") == 2 * PRIOR + 30_000


def test_learned_sizes_move_the_projection() -> None:
    """Finished sessions of a kind teach the size model; the quota follows it as placement does."""
    reg, shares = fleet(a=50_000)
    for _ in range(reg.sizes.min_samples):
        reg.sizes.observe("a~default", 20_000)  # tenant a's sessions of no kind (its own, not the fleet's)
    asyncio.run(admit(shares, "a", "a~s0"))
    asyncio.run(admit(shares, "a", "a~s1"))
    assert shares.kv_held("a") == 40_000
    assert refused(shares, "a", "a~s2").status == 429


def test_figure_is_placements_projection() -> None:
    """A tenant alone on a replica holds what placement subtracts from that replica's capacity."""
    reg, shares = fleet(replicas=1, a=1 << 30)
    view = next(iter(reg.replicas.values()))
    for i in range(8):
        reg.sizes.observe("agent", 1000 * (i + 1))
    reg.kinds.update({"a~s0": "agent", "a~s1": "agent"})
    view.session_kinds = {"a~s0": "agent", "a~s1": "agent"}
    home(reg, "a~s0", tokens=3500)
    home(reg, "a~s1", tokens=100)
    home(reg, "a~s2")
    record_assignment(view, NewSession(id="a~s2", expected_tokens=12_345))
    probe = NewSession(id="")
    placement = view.capacity_tokens - projected_headroom(view, probe, reg.sizes) - reg.sizes.project_new(probe)
    held, counted = homed_kv(reg, "a", {view.id})
    assert counted == {"a~s0", "a~s1", "a~s2"} and held == pytest.approx(placement) and held > 12_345 + 3500


def test_waiting_and_admitted_unhomed_sessions_count() -> None:
    """A flood queued behind full places (or admitted and still being placed) holds its projection:
    a tenant cannot queue past its KV cap and collect the places later."""
    reg, shares = fleet(replicas=1, per_replica=1, a=3 * PRIOR)
    home(reg, "b~s0")  # the only place is taken

    async def main() -> None:
        waiters = [asyncio.create_task(admit(shares, "a", f"a~w{i}")) for i in range(3)]
        await asyncio.sleep(0.05)
        assert shares.waiting() == 3 and shares.kv_held("a") == 3 * PRIOR
        with pytest.raises(RouteError) as exc:
            await admit(shares, "a", "a~w3")
        assert exc.value.status == 429
        reg.forget("b~s0")
        shares.dispatch(force=True)
        await asyncio.sleep(0.05)
        assert sum(w.done() for w in waiters) == 1 and shares.kv_held("a") == 3 * PRIOR
        for w in waiters:
            w.cancel()
        await asyncio.gather(*waiters, return_exceptions=True)

    asyncio.run(asyncio.wait_for(main(), 5))
    assert reg.counters.admission_kv_quota_refusals == 1 and not shares.pending_kv


def test_config_validates_the_cap() -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="max_kv_tokens"):
        RouteConfig(tenants={"a": {"max_kv_tokens": -1}})
    assert RouteConfig(tenants={"a": {"max_kv_tokens": None}}).tenants["a"].max_kv_tokens == 0
    assert RouteConfig(tenants={"a": {}}).tenants["a"].max_kv_tokens == 0
    assert not fleet(a=0)[1].enabled  # 0 = no cap: admission stays off


def finish_sessions(reg: Registry, keys: list[str], tokens: int) -> None:
    """A scrape that shows `keys` live at `tokens` on replica 0, then one that shows them gone: the
    size model learns each one's final size under the kind its placement gave it."""
    url = list(reg.replicas)[0]
    loads = {"sessions": [{"session_id": k, "tokens": tokens} for k in keys], "max_total_num_tokens": 1_000_000}
    reg.apply_scrape(url, loads, {"data": [{"id": "base"}]})
    reg.apply_scrape(url, {"sessions": [], "max_total_num_tokens": 1_000_000}, {"data": [{"id": "base"}]})


def test_one_tenants_session_sizes_do_not_move_anothers_projection_or_quota() -> None:
    """Attack: run-a makes its `swe` sessions huge so the shared size model projects every `swe`
    session huge and run-b, with a KV cap, is refused. A tenant's kinds are its own (`run-a~swe`):
    run-b's `swe` stays at the prior and both its sessions fit its cap; run-a's own projection learns."""
    reg, shares = fleet(replicas=1, **{"run-b": 2 * PRIOR + 100})
    flood = [f"run-a~s{i}" for i in range(12)]
    for key in flood:
        reg.place(key, "base", kind="swe")
    finish_sessions(reg, flood, 200_000)
    assert reg.sizes.expected("run-a~swe") == 200_000  # run-a's own sessions are sized by what it did
    assert reg.sizes.expected("run-b~swe") == PRIOR and reg.sizes.expected("swe") == PRIOR

    async def admit_swe(key: str) -> None:
        async with shares.admission("run-b", key, never_gone, "swe", 0):
            reg.place(key, "base", kind="swe")

    for i in range(2):
        asyncio.run(admit_swe(f"run-b~s{i}"))
    assert shares.kv_held("run-b") == 2 * PRIOR and reg.counters.admission_kv_quota_refusals == 0


def test_one_tenants_flood_of_kind_names_leaves_anothers_kinds_its_own() -> None:
    """Attack: run-a sends more kind names than the size model tracks; run-b's kinds (and the
    fleet's) are still tracked as their own, and run-a's extra kinds fall back to its own default."""
    reg = Registry()
    limit = reg.sizes.max_kinds
    for i in range(limit + 10):
        assert reg.sizes.admit(f"run-a~k{i}") == (f"run-a~k{i}" if i < limit else "run-a~default")
    assert reg.sizes.admit("run-b~swe") == "run-b~swe" and reg.sizes.admit("swe") == "swe"
