"""Placement policies on constructed replica states: choices, projection math, version gating."""

import random

import pytest

from burstrl.router.baselines import (
    CacheAwarePolicy,
    LeastRequestsPolicy,
    LeastSessionsPolicy,
    SmoothWeightedRoundRobinPolicy,
    WeightedRandomPolicy,
)
from burstrl.router.catalog import POLICY_NAMES, make_policy
from burstrl.router.kvaware import KvAwarePolicy, overlap_blocks
from burstrl.router.policies import (
    HeadroomPolicy,
    NewSession,
    NoReplicaError,
    RandomPolicy,
    ReplicaView,
    RoundRobinPolicy,
    SizeModel,
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


def test_a_replica_whose_sliding_layers_keep_their_window_projects_less_kv_per_long_session():
    """Gemma 3's KV: 5 of 6 layer groups hold at most window + margin (640) of a session, so a
    30k-token session costs 30k/6 + 640*5/6 of the capacity's tokens there, not 30k: the router's
    headroom, overflow and relief checks must read a windowed replica's reports in that unit, or
    the saving never reaches the fleet (it would look full at a fifth of its load)."""
    m = SizeModel(prior_tokens=10_000)
    full = replica("full", capacity=100_000, live={"x": 2000, "y": 30_000})
    windowed = replica("windowed", capacity=100_000, live={"x": 2000, "y": 30_000})
    windowed.kv_window = (640, 5 / 6)
    assert windowed.kv_cost(30_000) == pytest.approx(30_000 / 6 + 640 * 5 / 6)
    assert windowed.kv_cost(500) == pytest.approx(500) and full.kv_cost(30_000) == 30_000  # short: all of it
    assert projected_headroom(full, NewSession("new"), m) == 100_000 - 10_000 - 30_000 - 10_000
    want = 100_000 - sum(windowed.kv_cost(t) for t in (10_000, 30_000, 10_000))
    assert projected_headroom(windowed, NewSession("new"), m) == pytest.approx(want)
    assert HeadroomPolicy(k=2, sizes=m).choose(NewSession("new"), [full, windowed], random.Random(0)) is windowed
    assert windowed.live_kv() == pytest.approx(windowed.kv_cost(2000) + windowed.kv_cost(30_000)) == pytest.approx(6400)
    assert full.live_kv() == 32_000
    kv = KvAwarePolicy(sizes=m)
    full.capacity_tokens = windowed.capacity_tokens = 33_000  # context above relieve_above (0.9) of the budget
    small = NewSession("x", expected_tokens=2000)
    assert kv.pressed(small, full)  # its home is nearly full: the small session is moved before an eviction
    assert not kv.pressed(small, windowed)  # the same context is a fifth of this home's KV budget


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
    for name in POLICY_NAMES:
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


def test_a_replica_whose_versions_are_not_read_yet_holds_no_version_back():
    """The first replica of a new pool (an on-demand pool scaled 0 -> 1) registers healthy before its
    first scrape: until then it serves nothing known, and must not make `latest` unresolvable."""
    views = [replica("r", pool="reserved", versions=("base", "policy-v3")),
             replica("o", pool="on_demand", versions=())]
    assert newest_routable_version(views) == "policy-v3"
    views[1].versions = {"base"}  # read: it serves only base so far, and the pools' common newest is base
    assert newest_routable_version(views) == "base"
    assert newest_routable_version([replica("x", versions=())]) is None


def test_random_and_round_robin():
    views = [replica("a"), replica("b"), replica("c")]
    rr = RoundRobinPolicy()
    assert [rr.choose(NewSession("s"), views, random.Random(0)).id for _ in range(4)] == ["a", "b", "c", "a"]
    rng = random.Random(0)
    assert {RandomPolicy().choose(NewSession("s"), views, rng).id for _ in range(50)} == {"a", "b", "c"}


def test_weighted_random_and_smooth_wrr_follow_weights():
    big, small = replica("big", weight=8), replica("small", weight=1)
    rng = random.Random(0)
    picks = [WeightedRandomPolicy().choose(NewSession("s"), [big, small], rng).id for _ in range(4500)]
    assert 3800 <= picks.count("big") <= 4200  # 8/9 of 4500 = 4000
    wrr = SmoothWeightedRoundRobinPolicy()
    a, b, c = replica("a", weight=5), replica("b", weight=1), replica("c", weight=1)
    seq = [wrr.choose(NewSession("s"), [a, b, c], rng).id for _ in range(7)]
    assert seq == ["a", "a", "b", "a", "c", "a", "a"]  # nginx's smooth interleaving for 5:1:1


def test_least_sessions_and_least_requests_per_weight():
    big = replica("big", weight=8, live={f"b{i}": 1 for i in range(10)})
    small = replica("small", weight=1, live={"s0": 1, "s1": 1})
    rng = random.Random(0)
    assert LeastSessionsPolicy().choose(NewSession("n"), [big, small], rng).id == "big"  # 10/8 < 2/1
    for i in range(7):
        record_assignment(big, NewSession(f"new{i}"))
    assert LeastSessionsPolicy().choose(NewSession("n"), [big, small], rng).id == "small"  # 17/8 > 2
    big.in_flight, small.in_flight = 9, 1
    assert LeastRequestsPolicy().choose(NewSession("n"), [big, small], rng).id == "small"  # 9/8 > 1/1
    big.in_flight = 7
    assert LeastRequestsPolicy().choose(NewSession("n"), [big, small], rng).id == "big"


def test_cache_aware_is_sglangs_algorithm():
    policy = CacheAwarePolicy(cache_threshold=0.5, balance_abs=4, balance_rel=1.5)
    a, b = replica("a"), replica("b")
    rng = random.Random(0)
    first = policy.choose(NewSession("s1", prefix_hashes=(1, 2, 3, 4)), [a, b], rng)
    other = b if first is a else a
    # no match above the threshold: the smallest tree (the one that got nothing yet)
    assert policy.choose(NewSession("s2", prefix_hashes=(7, 8)), [a, b], rng) is other
    # balanced: the best match wins when it covers more than the threshold
    assert policy.choose(NewSession("s3", prefix_hashes=(1, 2, 3, 9)), [a, b], rng) is first
    # imbalanced by both the absolute and the relative test: least in-flight despite the match
    first.in_flight, other.in_flight = 10, 2
    assert policy.choose(NewSession("s5", prefix_hashes=(1, 2, 3, 4)), [a, b], rng) is other
    first.in_flight, other.in_flight = 10, 7  # diff 3 <= 4: balanced, the longer match wins again
    assert policy.choose(NewSession("s6", prefix_hashes=(1, 2, 3, 9, 10)), [a, b], rng) is first


def test_cache_aware_trees_are_lru_trimmed_leaves_first():
    policy = CacheAwarePolicy(max_tree_blocks=3, eviction_every=1, cache_threshold=0.0)
    a = replica("a")
    policy.choose(NewSession("s1", prefix_hashes=(1, 2, 3)), [a], random.Random(0))
    policy.choose(NewSession("s2", prefix_hashes=(1, 9)), [a], random.Random(0))
    tree = policy.trees["a"]
    assert len(tree) == 3 and 3 not in tree  # the oldest leaf went; the shared root stayed
    assert policy.match_length("a", (1, 2, 7)) == 2 and policy.match_length("a", (1, 9)) == 2


def test_kv_follows_cached_prefix_until_its_load_outweighs_it():
    sizes = SizeModel(prior_tokens=10_000)
    policy = KvAwarePolicy(k=1, sizes=sizes)
    warm, cold = replica("warm", capacity=100_000), replica("cold", capacity=100_000)
    warm.cached_blocks = frozenset({11, 12, 13})
    s = NewSession("n", expected_tokens=4000, prefix_hashes=(11, 12, 13, 14), block_tokens=1000)
    assert overlap_blocks(warm, s.prefix_hashes) == 3 and overlap_blocks(cold, s.prefix_hashes) == 0
    for seed in range(10):  # the warm replica is always a candidate, whatever K samples
        assert policy.choose(s, [warm, cold], random.Random(seed)) is warm
    # 3 sessions more (30k tokens of headroom, x 0.03 = 900) do not outweigh 3000 cached tokens ...
    warm.live_sessions = {f"x{i}": 10_000 for i in range(3)}
    assert policy.choose(s, [warm, cold], random.Random(0)) is warm
    # ... 12 more do (3600 > 3000), even though both replicas would then be projected over budget
    cold.live_sessions = {f"y{i}": 10_000 for i in range(9)}
    warm.live_sessions = {f"x{i}": 10_000 for i in range(21)}
    assert policy.choose(s, [warm, cold], random.Random(0)) is cold


def test_kv_prefers_a_cached_prefix_over_the_only_unloaded_replica_when_all_overflow():
    """Regression (issue 19): a charge on projected overflow made every busy replica look alike
    and sent prompts away from their cached prefix; only the headroom difference counts now."""
    policy = KvAwarePolicy(k=1, sizes=SizeModel(prior_tokens=30_000))
    warm, cold = replica("warm", capacity=100_000), replica("cold", capacity=100_000)
    warm.cached_blocks = frozenset(range(1, 21))
    warm.live_sessions = {f"x{i}": 1 for i in range(5)}  # 150k projected: over budget
    cold.live_sessions = {f"y{i}": 1 for i in range(4)}  # 120k projected: over budget too
    s = NewSession("n", expected_tokens=20_000, prefix_hashes=tuple(range(1, 21)), block_tokens=1000)
    assert policy.choose(s, [warm, cold], random.Random(0)) is warm


def test_kv_counts_recent_placements_as_cached_and_finds_the_roomiest():
    policy = KvAwarePolicy(k=1, sizes=SizeModel(prior_tokens=10_000))
    a = replica("a")
    record_assignment(a, NewSession("first", prefix_hashes=(5, 6)))
    s = NewSession("n", expected_tokens=2000, prefix_hashes=(5, 6), block_tokens=1000)
    assert overlap_blocks(a, s.prefix_hashes) == 2
    views = [replica(f"r{i}", live={f"s{i}{j}": 10_000 for j in range(5)}) for i in range(30)] + [replica("empty")]
    for seed in range(5):  # one roomy replica among 31 is always found, K = 1 notwithstanding
        assert policy.choose(NewSession(f"x{seed}"), views, random.Random(seed)).id == "empty"


def test_make_policy_rejects_unknown():
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("nope")
