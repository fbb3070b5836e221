"""Placement policies on constructed replica states: choices, projection math, version gating."""

import random

import pytest

from burstrl.router.policies import (
    CacheAwarePolicy,
    HeadroomPolicy,
    LeastLoadedPolicy,
    NewSession,
    NoReplicaError,
    RandomPolicy,
    ReplicaView,
    RoundRobinPolicy,
    SizeModel,
    make_policy,
    newest_routable_version,
    projected_headroom,
    record_assignment,
)


def replica(rid, capacity=100_000, weight=1, pool="on_demand", versions=("v0", "v1"), live=None, used=0, healthy=True):
    return ReplicaView(rid, pool, weight, capacity, used, dict(live or {}), versions=set(versions), healthy=healthy)


def test_size_model_prior_blend_quantile_and_mean():
    m = SizeModel(prior_tokens=1000, stat="quantile", quantile=0.5, min_samples=4)
    assert m.expected("swe") == 1000
    m.observe("swe", 3000)
    assert m.expected("swe") == pytest.approx(0.75 * 1000 + 0.25 * 3000)
    for size in (1000, 2000, 4000):
        m.observe("swe", size)
    assert m.expected("swe") == 3000  # sorted [1000, 2000, 3000, 4000], index int(0.5 * 4) = 2
    assert m.expected("math") == 1000  # kinds are separate
    mean = SizeModel(prior_tokens=0, stat="mean", min_samples=1)
    mean.observe("a", 10)
    mean.observe("a", 30)
    assert mean.expected("a") == 20


def test_projection_never_below_current_size_and_hint_is_a_floor():
    m = SizeModel(prior_tokens=5000)
    assert m.project("swe", 2000) == 5000
    assert m.project("swe", 9000) == 9000
    assert m.project_new(NewSession("s", "swe", expected_tokens=7000)) == 7000
    assert m.project_new(NewSession("s", "swe", expected_tokens=100)) == 5000


def test_projected_headroom_counts_live_recent_and_new():
    m = SizeModel(prior_tokens=10_000)
    r = replica("a", capacity=100_000, live={"x": 2000, "y": 30_000})
    record_assignment(r, NewSession("z"))
    record_assignment(r, NewSession("x"))  # already live: not counted twice
    # 100k - (10k + 30k) live - 10k recent - 10k new
    assert projected_headroom(r, NewSession("new"), m) == 40_000


def test_headroom_picks_most_projected_headroom():
    m = SizeModel(prior_tokens=10_000)
    busy = replica("busy", live={"a": 1000, "b": 1000, "c": 1000})  # small now, 30k projected
    idle = replica("idle", used=50_000)  # big cache of finished sessions: evictable, not live
    policy = HeadroomPolicy(k=2, sizes=m)
    assert policy.choose(NewSession("s"), [busy, idle], random.Random(0)).id == "idle"


def test_recent_assignments_prevent_herding_between_scrapes():
    policy = HeadroomPolicy(k=2, sizes=SizeModel(prior_tokens=10_000))
    views = [replica("a"), replica("b")]
    rng = random.Random(0)
    counts = {"a": 0, "b": 0}
    for i in range(10):  # no scrape in between: only recent_assignments tell them apart
        chosen = policy.choose(NewSession(f"s{i}"), views, rng)
        record_assignment(chosen, NewSession(f"s{i}"))
        counts[chosen.id] += 1
    assert counts == {"a": 5, "b": 5}


def test_headroom_weights_by_replica_size():
    policy = HeadroomPolicy(k=2, sizes=SizeModel(prior_tokens=10_000))
    big = replica("big", capacity=800_000, weight=8, pool="reserved")
    small = [replica(f"s{i}") for i in range(8)]
    views = [big] + small
    rng = random.Random(1)
    for i in range(160):
        chosen = policy.choose(NewSession(f"n{i}"), views, rng)
        record_assignment(chosen, NewSession(f"n{i}"))
    share = len(big.recent_assignments) / 160
    assert 0.4 <= share <= 0.6  # half of the capacity and compute -> about half of the sessions
    # per unit of size, a big replica with 8x the headroom of a small one is equally good
    q = NewSession("q")
    assert policy.score(replica("B", 800_000, 8), q) > policy.score(replica("S", 100_000, 1), q)


def test_weighted_sampling_offers_big_replicas_more_often():
    policy = HeadroomPolicy(k=1, sizes=SizeModel())
    views = [replica("big", capacity=800_000, weight=8)] + [replica(f"s{i}") for i in range(8)]
    rng = random.Random(2)
    picks = sum(policy.choose(NewSession(f"n{i}"), views, rng).id == "big" for i in range(1000))
    assert 400 <= picks <= 600


def test_version_gating_and_error():
    views = [replica("old", versions=("v1",)), replica("new", versions=("v1", "v2"))]
    rng = random.Random(0)
    for name in ("headroom", "random", "round_robin", "least_loaded", "cache_aware"):
        policy = make_policy(name)
        for _ in range(5):
            assert policy.choose(NewSession("s", version="v2"), views, rng).id == "new"
        with pytest.raises(NoReplicaError, match="v3"):
            policy.choose(NewSession("s", version="v3"), views, rng)
    views[1].healthy = False
    with pytest.raises(NoReplicaError):
        RandomPolicy().choose(NewSession("s", version="v2"), views, rng)


def test_newest_routable_version_needs_every_pool():
    views = [
        replica("r", pool="reserved", versions=("policy-v9", "policy-v10", "policy-v11")),
        replica("o1", pool="on_demand", versions=("policy-v9",)),
        replica("o2", pool="on_demand", versions=("policy-v10",)),
    ]
    assert newest_routable_version(views) == "policy-v10"  # numeric order, not string order
    views[2].healthy = False
    assert newest_routable_version(views) == "policy-v9"
    assert newest_routable_version([]) is None
    assert newest_routable_version(views, pools=("reserved", "spot")) is None


def test_random_and_round_robin():
    views = [replica("a"), replica("b"), replica("c")]
    rr = RoundRobinPolicy()
    assert [rr.choose(NewSession("s"), views, random.Random(0)).id for _ in range(4)] == ["a", "b", "c", "a"]
    rng = random.Random(0)
    assert {RandomPolicy().choose(NewSession("s"), views, rng).id for _ in range(50)} == {"a", "b", "c"}


def test_least_loaded_uses_fraction_and_recent_sends():
    a = replica("a", capacity=100_000, used=50_000)
    b = replica("b", capacity=400_000, used=100_000)
    policy = LeastLoadedPolicy()
    assert policy.choose(NewSession("s"), [a, b], random.Random(0)).id == "b"  # 0.25 < 0.5
    record_assignment(b, NewSession("big", expected_tokens=200_000))
    assert policy.choose(NewSession("s"), [a, b], random.Random(0)).id == "a"  # 0.75 > 0.5


def test_cache_aware_follows_prefix_when_balanced_else_least_loaded():
    policy = CacheAwarePolicy(match_threshold=0.5, balance_threshold=0.2)
    a, b = replica("a", used=10_000), replica("b", used=20_000)
    rng = random.Random(0)
    first = policy.choose(NewSession("s1", prefix_hashes=(1, 2, 3, 4)), [a, b], rng)
    assert first.id == "a"  # no match anywhere: least loaded
    a.used_tokens = 25_000  # balanced (0.25 vs 0.2): the prefix match wins
    assert policy.choose(NewSession("s2", prefix_hashes=(1, 2, 3, 9)), [a, b], rng).id == "a"
    assert policy.choose(NewSession("s3", prefix_hashes=(7, 8)), [a, b], rng).id == "b"  # no match
    a.used_tokens = 90_000  # unbalanced: least loaded despite the match
    assert policy.choose(NewSession("s4", prefix_hashes=(1, 2, 3, 4)), [a, b], rng).id == "b"


def test_make_policy_rejects_unknown():
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("nope")
