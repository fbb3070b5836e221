"""Weighted fair shares of a sandbox node's slots (`sandbox/node_shares.py`): the arithmetic, the
active window, the tenant's own view, and the fleet's flags that carry the router's weights."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from burstrl.config.run import RunConfig
from burstrl.launcher.sandbox_nodes import tenant_flags
from burstrl.sandbox.node_shares import FairShares, fair_shares, owed, parse_weights, share_refusal
from burstrl.sandbox.node_tenants import NodeTenancy, tenant_view


class Clock:
    """A settable monotonic clock, so the active window is tested without waiting."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_parse_weights_reads_floats_and_names_bad_entries() -> None:
    assert parse_weights("a=2, b=0.5,,") == {"a": 2.0, "b": 0.5}
    assert parse_weights(None) == {}
    for bad in ("a", "a=", "a=0", "a=-1", "a=x", "A=1", "a=inf"):
        with pytest.raises(ValueError):
            parse_weights(bad)


def test_shares_are_proportional_to_weights() -> None:
    assert fair_shares(6, {"a": 2, "b": 1}) == {"a": 4.0, "b": 2.0}
    assert fair_shares(4, {"a": 1}) == {"a": 4.0}
    assert fair_shares(4, {}) == {}
    assert sum(fair_shares(7, {"a": 2, "b": 1, "c": 1}).values()) == pytest.approx(7)


def test_owed_rounds_up_and_stops_at_the_cap() -> None:
    assert owed(2.0, 0) == 2
    assert owed(1.3333333, 1) == 1
    assert owed(2.0000000001, 2) == 0  # float slack is not a slot
    assert owed(2.0, 3) == 0
    assert owed(4.0, 0, cap=1) == 1  # slots it may not use are not held for it


def test_a_lone_tenant_takes_every_slot() -> None:
    shares = fair_shares(4, {"a": 1})
    for held in range(4):
        assert share_refusal("a", 4, Counter({"a": held}), shares) is None


def test_over_share_is_refused_only_while_others_below_share_are_owed() -> None:
    shares = fair_shares(4, {"a": 1, "b": 1})
    # A holds 3 of 4, B none: A's ask would leave 0 free of the 2 owed to B
    assert share_refusal("a", 4, Counter({"a": 3}), shares) == (0, 2)
    assert share_refusal("b", 4, Counter({"a": 3}), shares) is None  # B below its share: admitted
    assert share_refusal("a", 4, Counter({"a": 2, "b": 2}), shares) is None  # full, nobody owed: the pool's 429
    # A at its share, B at its share with one free: B's idle slot is A's (nobody below share is owed)
    assert share_refusal("a", 4, Counter({"a": 2, "b": 1}), shares) == (0, 1)
    assert share_refusal("a", 5, Counter({"a": 2, "b": 2}), fair_shares(5, {"a": 1, "b": 1})) is None


def test_weights_two_to_one() -> None:
    shares = fair_shares(6, {"a": 2, "b": 1})
    assert share_refusal("a", 6, Counter({"a": 5}), shares) == (0, 2)
    assert share_refusal("a", 6, Counter({"a": 4, "b": 1}), shares) == (0, 1)
    assert share_refusal("b", 6, Counter({"a": 4, "b": 1}), shares) is None
    assert share_refusal("a", 6, Counter({"a": 3, "b": 2}), shares) is None  # A below its 4
    assert share_refusal("b", 6, Counter({"a": 3, "b": 2}), shares) == (0, 1)


def test_the_node_tokens_sandboxes_take_slots_but_no_share() -> None:
    clock = Clock()
    fs = FairShares(NodeTenancy(key="k"), slots=4, clock=clock)
    live = Counter({None: 2, "a": 1})
    assert fs.refusal(None, live, "n") is None
    assert fs.refusal("b", live, "n") is None  # b below its share of the 2 tenant slots
    assert fs.shares(live) == {"a": 1.0, "b": 1.0}
    assert "fair share" in (fs.refusal("a", Counter({None: 2, "a": 1, "b": 0}), "n") or "")


def test_an_ask_keeps_a_tenant_active_for_the_window() -> None:
    clock = Clock()
    fs = FairShares(NodeTenancy(key="k", weights={"b": 2.0}, active_s=30.0), slots=6, clock=clock)
    assert fs.refusal("b", Counter({"a": 6}), "n") is None  # b asked (the pool would refuse: full)
    why = fs.refusal("a", Counter({"a": 5}), "n")
    assert why and "'a'" in why and "fair share 2.00 of 6 slots" in why and "weight 1 of 3" in why
    assert "'b'" not in why  # the refused tenant learns nothing of who is owed
    clock.now += 31  # b went quiet: its share is a's again
    assert fs.refusal("a", Counter({"a": 5}), "n") is None
    assert fs.report(Counter({"a": 5}))["tenants"] == {"a": {"held": 5, "weight": 1.0, "share": 6.0, "active": True}}


def test_without_slots_shares_are_off() -> None:
    fs = FairShares(NodeTenancy(key="k"), slots=None, clock=Clock())
    assert fs.refusal("a", Counter({"a": 50}), "n") is None
    assert fs.report(Counter({"a": 1}))["tenants"]["a"]["share"] is None


def test_a_tenant_sees_only_its_own_share() -> None:
    fs = FairShares(NodeTenancy(key="k", weights={"secret-b": 3.0}), slots=8, clock=Clock())
    live = Counter({"a": 1, "secret-b": 2})
    report = {"sandboxes": [], "shares": fs.report(live), "swept_at_start": []}
    assert set(report["shares"]["tenants"]) == {"a", "secret-b"}
    mine = tenant_view(report, "a")
    assert mine["share"] == {"slots": 8, "held": 1, "weight": 1.0, "share": 2.0, "active": True}
    assert "shares" not in mine and "secret-b" not in repr(mine)
    assert tenant_view(report, "c")["share"]["held"] == 0
    assert tenant_view(report, None)["shares"]["tenants"]["secret-b"]["share"] == 6.0


def test_the_fleet_passes_the_routers_weights_and_its_slots(tmp_path: Path) -> None:
    key = tmp_path / "tenant.key"
    cfg = RunConfig()
    assert tenant_flags(cfg, key) == ["--tenant-key-file", str(key)]
    cfg = RunConfig.model_validate({"fleet": {"sandbox_node_slots": 6, "sandbox_tenant_max": 5},
                                    "router": {"tenants": {"a": {"weight": 2}, "b": {"weight": 1},
                                                           "c": {"weight": 0.5}, "": {"weight": 3}}}})
    flags = tenant_flags(cfg, key)
    assert flags == ["--tenant-key-file", str(key), "--tenant-max-sandboxes", "5", "--max-sandboxes", "6",
                     "--tenant-weights", "a=2,c=0.5"]
    assert parse_weights(flags[-1]) == {"a": 2.0, "c": 0.5}
