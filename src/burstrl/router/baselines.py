"""Baseline placement policies, as production routers and load balancers implement them.

Why here, beside the default: a router policy is only worth its complexity if it beats the simple
ones that real deployments use, given the same load signals. Every baseline reads what a
production router reads: its own count of in-flight requests (SGLang's router, Dynamo, llm-d),
live sessions per replica, or static weights; none of them reads LRU occupancy (a warm replica's
cache is always near full, so it says nothing about load).
"""

from __future__ import annotations

import random
from collections import OrderedDict

from burstrl.router.policies import NewSession, ReplicaView, eligible


def live_sessions(replica: ReplicaView) -> int:
    """Sessions live at the last scrape plus new ones sent since."""
    fresh = sum(1 for s in replica.recent_assignments if s.id not in replica.live_sessions)
    return len(replica.live_sessions) + fresh


class WeightedRandomPolicy:
    """A replica drawn with probability proportional to its weight (baseline)."""

    name = "weighted_random"

    def choose(self, session: NewSession, replicas: list[ReplicaView], rng: random.Random) -> ReplicaView:
        pool = eligible(session, replicas)
        return rng.choices(pool, weights=[r.weight for r in pool])[0]


class SmoothWeightedRoundRobinPolicy:
    """nginx's smooth weighted round-robin: weight-proportional and evenly interleaved (baseline).

    Each pick adds every replica's weight to its running credit, takes the replica with the most
    credit and charges it the total weight, so a weight-8 replica gets 8 of every 9 picks against
    a weight-1 one, never 8 in a row.
    """

    name = "smooth_wrr"

    def __init__(self) -> None:
        self.credit: dict[str, float] = {}

    def choose(self, session: NewSession, replicas: list[ReplicaView], rng: random.Random) -> ReplicaView:
        pool = eligible(session, replicas)
        for r in pool:
            self.credit[r.id] = self.credit.get(r.id, 0.0) + r.weight
        chosen = max(pool, key=lambda r: self.credit[r.id])
        self.credit[chosen.id] -= sum(r.weight for r in pool)
        return chosen


class LeastSessionsPolicy:
    """Fewest live sessions per unit of weight, ties at random (baseline)."""

    name = "least_sessions"

    def choose(self, session: NewSession, replicas: list[ReplicaView], rng: random.Random) -> ReplicaView:
        pool = eligible(session, replicas)
        return min(pool, key=lambda r: (live_sessions(r) / r.weight, rng.random()))


class LeastRequestsPolicy:
    """Fewest in-flight requests per unit of weight, ties at random (baseline: least-request LB)."""

    name = "least_requests"

    def choose(self, session: NewSession, replicas: list[ReplicaView], rng: random.Random) -> ReplicaView:
        pool = eligible(session, replicas)
        return min(pool, key=lambda r: (r.in_flight / r.weight, rng.random()))


class CacheAwarePolicy:
    """SGLang's cache-aware router, reimplemented from its documented algorithm (baseline).

    Load is the router's own in-flight request count per replica (unweighted, as in SGLang). When
    the fleet is imbalanced (max - min > `balance_abs` and max > `balance_rel` * min) the least
    loaded replica wins. Otherwise the replica whose approximate tree (what the router sent there)
    matches most of the prompt wins if the match covers more than `cache_threshold`; else the one
    with the smallest tree (most free cache, by the router's guess). Trees are LRU-trimmed to
    `max_tree_blocks` every `eviction_every` placements. A tree node is a chained block hash (it
    names its whole prefix), so a tree is an LRU-ordered set, deepest blocks oldest.
    """

    name = "cache_aware"

    def __init__(self, cache_threshold: float = 0.3, balance_abs: int = 64, balance_rel: float = 1.5,
                 max_tree_blocks: int = 1 << 20, eviction_every: int = 1000) -> None:
        self.cache_threshold, self.balance_abs, self.balance_rel = cache_threshold, balance_abs, balance_rel
        self.max_tree_blocks, self.eviction_every = max_tree_blocks, eviction_every
        self.trees: dict[str, OrderedDict[int, None]] = {}
        self.placements = 0

    def match_length(self, replica_id: str, hashes: tuple[int, ...]) -> int:
        tree = self.trees.get(replica_id, {})
        n = 0
        for h in hashes:
            if h not in tree:
                break
            n += 1
        return n

    def insert(self, replica_id: str, hashes: tuple[int, ...]) -> None:
        tree = self.trees.setdefault(replica_id, OrderedDict())
        for h in reversed(hashes):  # the root ends most recent, so LRU trims leaves first
            tree[h] = None
            tree.move_to_end(h)

    def evict(self) -> None:
        for tree in self.trees.values():
            while len(tree) > self.max_tree_blocks:
                tree.popitem(last=False)

    def imbalanced(self, pool: list[ReplicaView]) -> bool:
        loads = [r.in_flight for r in pool]
        return max(loads) - min(loads) > self.balance_abs and max(loads) > self.balance_rel * min(loads)

    def choose(self, session: NewSession, replicas: list[ReplicaView], rng: random.Random) -> ReplicaView:
        pool = eligible(session, replicas)
        hashes = session.prefix_hashes
        if self.imbalanced(pool):
            chosen = min(pool, key=lambda r: (r.in_flight, rng.random()))
        else:
            matches = {r.id: self.match_length(r.id, hashes) for r in pool}
            best = max(pool, key=lambda r: (matches[r.id], -r.in_flight, rng.random()))
            if hashes and matches[best.id] / len(hashes) > self.cache_threshold:
                chosen = best
            else:
                chosen = min(pool, key=lambda r: (len(self.trees.get(r.id, ())), r.in_flight, rng.random()))
        self.insert(chosen.id, hashes)
        self.placements += 1
        if self.placements % self.eviction_every == 0:
            self.evict()
        return chosen
