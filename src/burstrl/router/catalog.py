"""Every placement policy by name: the router server and the simulator build theirs here."""

from __future__ import annotations

from burstrl.router.baselines import (
    CacheAwarePolicy,
    LeastRequestsPolicy,
    LeastSessionsPolicy,
    SmoothWeightedRoundRobinPolicy,
    WeightedRandomPolicy,
)
from burstrl.router.kvaware import KvAwarePolicy
from burstrl.router.policies import HeadroomPolicy, RandomPolicy, RoundRobinPolicy, RoutingPolicy, SizeModel

DEFAULT_POLICY = "kv"
POLICY_NAMES = ("kv", "headroom", "random", "round_robin", "weighted_random", "smooth_wrr", "least_sessions",
                "least_requests", "cache_aware")
BASELINES = POLICY_NAMES[1:]


def make_policy(name: str, k: int = 2, sizes: SizeModel | None = None) -> RoutingPolicy:
    """A fresh policy by name (fresh state: round-robin counters, prefix trees)."""
    if name == "kv":
        return KvAwarePolicy(k=k, sizes=sizes)
    if name == "headroom":
        return HeadroomPolicy(k=k, sizes=sizes)
    simple = {"random": RandomPolicy, "round_robin": RoundRobinPolicy, "weighted_random": WeightedRandomPolicy,
              "smooth_wrr": SmoothWeightedRoundRobinPolicy, "least_sessions": LeastSessionsPolicy,
              "least_requests": LeastRequestsPolicy, "cache_aware": CacheAwarePolicy}
    if name not in simple:
        raise ValueError(f"unknown policy {name!r}; choose from {', '.join(POLICY_NAMES)}")
    return simple[name]()
