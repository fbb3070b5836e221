"""The default placement policy: prefix overlap and projected KV load in one cost, power-of-K.

Why one cost: prefix-aware routers (NVIDIA Dynamo's KV router, SGLang's cache-aware router) win
on chat traffic by sending a prompt where its prefix is cached, and lose on agentic traffic, where
first prompts share little and what matters is that a session's growing context is never evicted;
`headroom` (projected session growth) is the opposite. Dynamo scores a replica by the blocks it
would have to prefill (prompt minus cached overlap) plus the blocks it already holds for running
requests; here the second term is `headroom`'s projection (capacity minus the projected final
sizes of its live sessions, this one included), per unit of weight (an 8-GPU replica prefills 8x
faster and holds 8x the KV):

    cost = prompt tokens left to prefill after the cached overlap - load_weight * headroom / weight

One token of projected headroom is worth `load_weight` tokens of prefill. On traffic without
shared prefixes the prefill term is the same on every replica and the choice is `headroom`'s (the
roomiest per weight); on chat traffic a cached prefix wins until its replica is loaded by
prefix / load_weight tokens more than another. An earlier form charged projected overflow (headroom
below zero) again, 4x: the projection is a p90 of final sizes, so on a busy fleet every replica
"overflows" and that charge outweighed any cached prefix (Mooncake uniform fleet at 4x: 0.159 vs
0.192 prefix hit on the tuning half), while on prefix-free traffic it never changed a choice
(headroom per weight ranks the same with or without it). Dynamo's third term, in-flight requests
per weight (1024 tokens each, chosen on the Mooncake tuning half for per-call p99), was tried and
dropped: on the held-out figures it cut p99 in some Mooncake cells and raised it in others, and it
cost session hit rate on the generated trace (docs/benchmarks.md, "Router"; the sixth session's
measurement is in its git history).

Sessions keep their home; `rehome` moves one its overflowing home evicted, and `relieve` moves a
small one off a nearly full home before anything is evicted (both only to replicas it never
lived on: its old homes keep their parts of its capture).

Candidates are K replicas drawn by weight (power-of-K: robust to stale figures) plus the replica
with the longest cached prefix and the one with the most projected headroom per weight, so neither
a long shared prefix nor the one roomy replica of a large fleet is missed by sampling (the scan is
O(replicas) with each replica's projection cached until its next scrape).
The cached prefix is read from the replica's own block summary (`/v1/loads` `prefix_blocks`,
refreshed each scrape, exact) and from the sessions the router sent there since (Dynamo's
approximate index, until the next scrape confirms them).
"""

from __future__ import annotations

import random

from burstrl.router.policies import (
    NewSession,
    ReplicaView,
    SizeModel,
    eligible,
    projected_headroom,
    weighted_sample,
)


def overlap_blocks(replica: ReplicaView, hashes: tuple[int, ...]) -> int:
    """Leading blocks of `hashes` the replica holds (its summary) or was just sent (recent placements)."""
    if not hashes:
        return 0
    cached, recent = replica.cached_blocks, None
    n = 0
    for h in hashes:
        if h not in cached:
            if recent is None:
                recent = {x for s in replica.recent_assignments for x in s.prefix_hashes}
            if h not in recent:
                break
        n += 1
    return n


class KvAwarePolicy:
    """Lowest (prefill left after the cached overlap) - load_weight * projected headroom / weight.

    Prefill is fleet work (GPU-seconds scale with tokens wherever they run), so it is not divided
    by weight; headroom per weight is the balance term. `load_weight` 0.03 was chosen on the first
    half of the Mooncake trace (among 0.003, 0.01, 0.03, 0.1; the fifth session's sweep is in the git
    history of docs/benchmarks.md): 0.003 and 0.01 lost per-request hit rate at 1x, 0.1 lost it with
    inferred sessions.
    """

    name = "kv"
    rehomes = True  # a session evicted from an overflowing home may move (`rehome`; Registry.place, the simulator)

    def __init__(self, k: int = 2, sizes: SizeModel | None = None, load_weight: float = 0.03,
                 relieve_above: float = 0.9, relieve_max: float = 0.1, relieve_to: float = 0.6) -> None:
        if k < 1:
            raise ValueError("k must be >= 1")
        self.k = k
        self.sizes = sizes if sizes is not None else SizeModel()
        self.load_weight = load_weight
        # pressure moves (`relieve`): fractions of a replica's KV budget; relieve_above > 1 turns them off
        self.relieve_above, self.relieve_max, self.relieve_to = relieve_above, relieve_max, relieve_to

    def cost(self, replica: ReplicaView, session: NewSession) -> float:
        headroom = projected_headroom(replica, session, self.sizes)
        hit = overlap_blocks(replica, session.prefix_hashes) * session.block_tokens
        prompt = max(session.expected_tokens, len(session.prefix_hashes) * session.block_tokens)
        return max(0, prompt - hit) - self.load_weight * headroom / max(replica.weight, 1e-9)

    def candidates(self, session: NewSession, pool: list[ReplicaView], rng: random.Random) -> list[ReplicaView]:
        sample = weighted_sample(pool, min(self.k, len(pool)), rng)
        roomiest = max(pool, key=lambda r: projected_headroom(r, session, self.sizes) / max(r.weight, 1e-9))
        if roomiest not in sample:
            sample.append(roomiest)
        if session.prefix_hashes and session.block_tokens:
            overlaps = [(overlap_blocks(r, session.prefix_hashes), rng.random(), r) for r in pool]
            best_overlap, _, best = max(overlaps, key=lambda t: t[:2])
            if best_overlap and best not in sample:
                sample.append(best)
        return sample

    def choose(self, session: NewSession, replicas: list[ReplicaView], rng: random.Random) -> ReplicaView:
        pool = eligible(session, replicas)
        return min(self.candidates(session, pool, rng), key=lambda r: self.cost(r, session))

    def rehome(self, session: NewSession, home: ReplicaView, others: list[ReplicaView],
               rng: random.Random) -> ReplicaView:
        """Where a session its overflowing home evicted goes: the best of `others`, unless staying costs less.

        Why not always move: the home may still hold much of the call's prompt (a GRPO sibling's
        copy of the shared first prompt, which the replica copies across sessions), and a move
        re-prefills all of it elsewhere. So a home that holds more of the prompt than the best other
        replica keeps the session if it costs no more. The home's headroom already counts this
        session as live there, so its projected size is added back first (else it counts twice).
        Without such an overlap the session moves: on the generated agentic trace, letting projected
        headroom alone keep sessions on the home that just evicted them cost hit rate (docs/benchmarks.md,
        "Router"; the seventh session's probe is in git history).
        """
        best = self.choose(session, others, rng)
        hashes = session.prefix_hashes
        if overlap_blocks(home, hashes) <= overlap_blocks(best, hashes):
            return best
        stay = self.cost(home, session) - self.load_weight * home.kv_cost(self.sizes.project_new(session)) / max(
            home.weight, 1e-9)
        return home if stay <= self.cost(best, session) else best

    def pressed(self, session: NewSession, home: ReplicaView) -> bool:
        """Whether the session should leave its nearly full home before the home evicts anything.

        Why: `rehome` acts only after the home evicted an idle session, whose whole context is then
        re-prefilled (and the next overflow evicts another). A home whose live sessions' context
        (not their projection: the figure it reports) is above `relieve_above` of its KV budget
        sheds the session calling now if that session is small (<= `relieve_max` of the budget:
        re-prefilling it elsewhere is the whole price); `relieve` picks where it goes. The
        thresholds were chosen on the generated uniform fleet's tuning seeds 11 and 13 and checked
        on seeds 0-10 and 12 (docs/benchmarks.md, "Router"). Checked on every call
        of a session, before the caller lists the other replicas.
        """
        capacity = home.capacity_tokens
        return (capacity > 0 and home.kv_cost(relief_size(session, home)) <= self.relieve_max * capacity
                and home.live_kv() > self.relieve_above * capacity)

    def relieve(self, session: NewSession, home: ReplicaView, others: list[ReplicaView],
                rng: random.Random) -> ReplicaView | None:
        """Where a `pressed` session goes: the replica `choose` picks among `others`, if that one
        stays below `relieve_to` of its KV budget with it (None: it stays)."""
        if not others:
            return None
        best = self.choose(session, others, rng)
        if best.live_kv() + best.kv_cost(relief_size(session, home)) > self.relieve_to * best.capacity_tokens:
            return None
        return best


def relief_size(session: NewSession, home: ReplicaView) -> int:
    """A session's tokens as far as the router knows: its home's last report, or this call's size if larger."""
    return max(home.live_sessions.get(session.id, 0), session.expected_tokens)
