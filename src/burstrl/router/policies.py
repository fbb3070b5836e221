"""Placement policies: pick the replica for a new session from a (slightly stale) view of the fleet.

Why one interface `choose(session, replicas, rng) -> ReplicaView`: the router server and the
simulator both hold a list of `ReplicaView`s (refreshed by periodic load scrapes) and must be able
to swap policies to compare them on the same trace. A policy never mutates the views; the caller
records the placement with `record_assignment` (until the next scrape clears it), which is what
keeps a policy from herding every new session onto the replica that looked emptiest at the last
scrape. This module holds the interface, the session size model and `headroom`; the baselines are
in `baselines.py`, the default (`kv`) in `kvaware.py`, and `catalog.make_policy` builds one by name.
"""

from __future__ import annotations

import bisect
import random
import statistics
from collections import Counter, defaultdict, deque
from collections.abc import Callable, Container
from dataclasses import dataclass, field
from typing import Protocol

from burstrl.protocol.tenants import owner, scoped
from burstrl.protocol.versions import version_key

POOLS = ("reserved", "on_demand")


class NoReplicaError(Exception):
    """No healthy replica serves the version a session is pinned to."""


@dataclass
class NewSession:
    """What a policy knows about a new session (the body of `POST /v1/assign`)."""

    id: str
    kind: str = "default"
    version: str = "v0"
    expected_tokens: int = 0  # caller's hint (a lower bound on the final size); 0 = unknown
    prefix_hashes: tuple[int, ...] = ()  # chained block hashes of the first prompt (prefix-aware policies)
    block_tokens: int = 0  # tokens per prefix block (0: unknown, prefix overlap is not scored)


@dataclass
class ReplicaView:
    """One replica as the router last saw it; `recent_assignments` is what it sent since."""

    id: str
    pool: str = "reserved"
    weight: float = 1.0  # size: 8 for an 8-GPU reserved replica, 1 for one on-demand GPU
    capacity_tokens: int = 0  # KV budget
    used_tokens: int = 0  # from the last load scrape
    live_sessions: dict[str, int] = field(default_factory=dict)  # session id -> current tokens
    session_kinds: dict[str, str] = field(default_factory=dict)  # session id -> task kind
    versions: set[str] = field(default_factory=set)
    healthy: bool = True
    draining: bool = False  # being removed: keeps its sessions, gets no new ones
    bad_reason: str = ""  # why its last scrape answer was not trusted (out of rotation until a sane one)
    recent_assignments: list[NewSession] = field(default_factory=list)
    assigned: int = 0  # placements recorded here, ever (a scrape keeps those made after it was sent)
    held_over: list[int] = field(default_factory=list)  # scrapes each leading recent_assignment stayed unshown
    # Load as production routers read it: calls the router sent and has not seen answered (its own
    # count, exact), running+waiting requests the replica reported at the last scrape, and the
    # chained block hashes of its prefix cache (the replica's summary; empty if it sends none).
    in_flight: int = 0
    running_requests: int = 0
    cached_blocks: Container[int] = field(default_factory=frozenset, repr=False)
    # (live_sessions, session_kinds, size model generation, size model, projected total): scrapes replace
    # those dicts (never mutate them), so a placement between scrapes reuses the sum.
    live_projection: tuple | None = field(default=None, repr=False, compare=False)
    # (window tokens, share of the KV in sliding-window layers) as the replica reported it: those
    # layers hold at most the window of a session, so its KV grows slower than its context
    kv_window: tuple[int, float] | None = None

    def kv_cost(self, tokens: float) -> float:
        """KV memory of a session of `tokens` context here, in the unit of `capacity_tokens` (tokens
        in every layer): the tokens themselves, unless sliding layers keep only their window."""
        if self.kv_window is None:
            return tokens
        window, share = self.kv_window
        return tokens * (1.0 - share) + min(tokens, window) * share

    def live_kv(self) -> float:
        """KV memory of the live sessions' current context (what the replica reports holding)."""
        return sum(self.kv_cost(t) for t in self.live_sessions.values())


def record_assignment(replica: ReplicaView, session: NewSession) -> None:
    """Remember a placement until the next scrape, so later choices see its projected size."""
    replica.recent_assignments.append(session)
    replica.assigned += 1


def newest_routable_version(replicas: list[ReplicaView], pools: tuple[str, ...] | None = None,
                            among: Callable[[str], bool] | None = None) -> str | None:
    """Newest version that at least one healthy replica of each pool serves (None if none does).

    Why every pool: new sessions must be placeable anywhere, and a version only on the reserved
    pool would pile the new sessions there while on-demand replicas are still loading it.
    `pools` defaults to the pools that have a healthy replica; `among` keeps only the versions it
    accepts (a tenant's own and `base`: `router.tenancy`). A replica whose versions are not read yet
    (just registered: every replica serves at least `base` once read) does not count: the first
    replica of a new pool would otherwise make every version unroutable until its first scrape.
    """
    healthy = [r for r in replicas if r.healthy and r.versions]
    wanted = pools if pools is not None else tuple(sorted({r.pool for r in healthy}))
    if not wanted:
        return None
    per_pool = [set().union(*[r.versions for r in healthy if r.pool == pool]) for pool in wanted]
    common = {v for v in set.intersection(*per_pool) if among is None or among(v)}
    return max(common, key=version_key) if common else None


def eligible(session: NewSession, replicas: list[ReplicaView]) -> list[ReplicaView]:
    """Healthy, non-draining replicas that serve the session's version; raises when there is none."""
    ok = [r for r in replicas if r.healthy and not r.draining and session.version in r.versions]
    if not ok:
        raise NoReplicaError(f"no healthy replica serves version {session.version!r} (session {session.id!r})")
    return ok


def kind_of(tenant: str | None, kind: str) -> str:
    """The size model's name for a tenant's task kind (`run-a~swe`); the fleet's own kinds as given."""
    return scoped(tenant or None, kind)


class SizeModel:
    """Projects the final size (tokens) of a session from finished sessions of the same kind.

    Why: a session's current size says little about the KV it will need (agent contexts grow with
    every tool call), and headroom must be judged on what sessions will become. The estimate per
    kind is a quantile (default p90, conservative) or the mean of the last `window` finished
    sizes; while a kind has fewer than `min_samples` it is blended linearly with `prior_tokens`.
    A live session is projected from the finished ones that grew past its current size (a session
    already at 40k tokens will likely end well above the kind's p90), never below its size now.
    Kinds come from callers, so at most `max_kinds` are tracked; later ones are sized as `default`.
    On a shared fleet a tenant's kinds are its own (`tenant~kind`, `kind_of`): one tenant's session
    sizes never move another's projections (which its KV quota and placement read), and each tenant
    has its own `max_kinds` budget and its own `tenant~default`, so a flood of kind names from one
    tenant leaves every other tenant's kinds as they were.
    """

    def __init__(self, prior_tokens: int = 8192, stat: str = "quantile", quantile: float = 0.9,
                 min_samples: int = 8, window: int = 1000, max_kinds: int = 256) -> None:
        if stat not in ("quantile", "mean"):
            raise ValueError(f"stat must be 'quantile' or 'mean', not {stat!r}")
        self.prior_tokens = prior_tokens
        self.stat = stat
        self.quantile = quantile
        self.min_samples = min_samples
        self.window = window
        self.max_kinds = max_kinds
        self._admitted: set[str] = {"default"}
        self._known: Counter[str | None] = Counter({None: 1})  # admitted kinds per owner (the fleet: None)
        self._order: dict[str, deque[int]] = defaultdict(deque)  # arrival order, for the window
        self._sorted: dict[str, list[int]] = defaultdict(list)
        self._cache: dict[str, float] = {}
        self.generation = 0  # bumped by every observation: projections made before are stale

    def admit(self, kind: str) -> str:
        """The kind a session is sized as: its own while its owner (a tenant, or the fleet) has fewer
        than `max_kinds` known, else its owner's `default`."""
        if kind in self._admitted:
            return kind
        tenant = owner(kind)
        fallback = "default" if tenant is None else scoped(tenant, "default")
        if self._known[tenant] < self.max_kinds:
            self._admitted.add(kind)
            self._known[tenant] += 1
            return kind
        self._admitted.add(fallback)
        return fallback

    def kinds(self) -> set[str]:
        """Kinds with finished sizes recorded."""
        return set(self._sorted)

    def observe(self, kind: str, final_tokens: int) -> None:
        """Record the final size of a finished session."""
        kind = self.admit(kind)
        order, ordered = self._order[kind], self._sorted[kind]
        order.append(final_tokens)
        bisect.insort(ordered, final_tokens)
        if len(order) > self.window:
            del ordered[bisect.bisect_left(ordered, order.popleft())]
        self._cache.pop(kind, None)
        self.generation += 1

    def _stat(self, ordered: list[int]) -> float:
        if self.stat == "mean":
            return statistics.fmean(ordered)
        return float(ordered[min(len(ordered) - 1, int(self.quantile * len(ordered)))])

    def expected(self, kind: str) -> float:
        """Expected final size of a new session of this kind."""
        if kind not in self._cache:
            ordered = self._sorted.get(kind)
            if not ordered:
                self._cache[kind] = float(self.prior_tokens)
            else:
                w = min(1.0, len(ordered) / self.min_samples)
                self._cache[kind] = (1 - w) * self.prior_tokens + w * self._stat(ordered)
        return self._cache[kind]

    def project(self, kind: str, current_tokens: int) -> float:
        """Projected final size of a live session: conditioned on its size now, never below it."""
        value = max(float(current_tokens), self.expected(kind))
        ordered = self._sorted.get(kind)
        if ordered and len(ordered) >= self.min_samples and current_tokens > 0:
            start = bisect.bisect_right(ordered, current_tokens)
            if start < len(ordered):
                value = max(value, self._stat_from(ordered, start))
        return value

    def _stat_from(self, ordered: list[int], start: int) -> float:
        """`_stat(ordered[start:])` without the copy: projection runs for every live session per placement."""
        if self.stat == "mean":
            return statistics.fmean(ordered[start:])
        n = len(ordered) - start
        return float(ordered[start + min(n - 1, int(self.quantile * n))])

    def project_new(self, session: NewSession) -> float:
        """Projected final size of a new session: the model's estimate, or the caller's hint if larger."""
        return max(float(session.expected_tokens), self.expected(session.kind))


class RoutingPolicy(Protocol):
    name: str

    def choose(self, session: NewSession, replicas: list[ReplicaView], rng: random.Random) -> ReplicaView: ...


def projected_headroom(replica: ReplicaView, session: NewSession, sizes: SizeModel) -> float:
    """Capacity minus the KV of the projected final sizes of its live sessions, recent assignments and this one."""
    total = live_projection(replica, sizes)
    for recent in replica.recent_assignments:
        if recent.id not in replica.live_sessions:
            total += replica.kv_cost(sizes.project_new(recent))
    return replica.capacity_tokens - total - replica.kv_cost(sizes.project_new(session))


def live_projection(replica: ReplicaView, sizes: SizeModel) -> float:
    """KV of the projected final sizes of the replica's live sessions, cached until the next scrape.

    Why cached: it is O(live sessions) and every placement needs it for K replicas, while it only
    changes when a scrape replaces the live sessions or a finished session moves the size model.
    """
    cached = replica.live_projection
    if (cached is not None and cached[0] is replica.live_sessions and cached[1] is replica.session_kinds
            and cached[2] == sizes.generation and cached[3] is sizes and cached[4] == replica.kv_window):
        return cached[5]
    kinds = replica.session_kinds
    total = sum(replica.kv_cost(sizes.project(kinds.get(sid, "default"), tokens))
                for sid, tokens in replica.live_sessions.items())
    replica.live_projection = (replica.live_sessions, kinds, sizes.generation, sizes, replica.kv_window, total)
    return total


class HeadroomPolicy:
    """Best of K sampled replicas by projected KV headroom per unit of replica size.

    Why weighted: an 8-GPU replica has 8x the KV and 8x the compute of one on-demand GPU, so it
    should take 8x the sessions. Replicas are sampled in proportion to their weight (uniform
    sampling would offer a few big replicas as rarely as each small one) and scored by headroom
    divided by weight, so load spreads in proportion to size. Power-of-K keeps the choice cheap
    and robust to stale load figures.
    """

    name = "headroom"

    def __init__(self, k: int = 2, sizes: SizeModel | None = None) -> None:
        if k < 1:
            raise ValueError("k must be >= 1")
        self.k = k
        self.sizes = sizes if sizes is not None else SizeModel()

    def score(self, replica: ReplicaView, session: NewSession) -> float:
        return projected_headroom(replica, session, self.sizes) / max(replica.weight, 1e-9)

    def choose(self, session: NewSession, replicas: list[ReplicaView], rng: random.Random) -> ReplicaView:
        pool = eligible(session, replicas)
        sample = weighted_sample(pool, min(self.k, len(pool)), rng)
        return max(sample, key=lambda r: self.score(r, session))


def weighted_sample(replicas: list[ReplicaView], k: int, rng: random.Random) -> list[ReplicaView]:
    """k distinct replicas drawn with probability proportional to weight (Efraimidis-Spirakis keys)."""
    keyed = [(rng.random() ** (1.0 / max(r.weight, 1e-9)), i) for i, r in enumerate(replicas)]
    keyed.sort(reverse=True)
    return [replicas[i] for _, i in keyed[:k]]


class RandomPolicy:
    """Uniformly random eligible replica (baseline)."""

    name = "random"

    def choose(self, session: NewSession, replicas: list[ReplicaView], rng: random.Random) -> ReplicaView:
        return rng.choice(eligible(session, replicas))


class RoundRobinPolicy:
    """Eligible replicas in turn (baseline)."""

    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def choose(self, session: NewSession, replicas: list[ReplicaView], rng: random.Random) -> ReplicaView:
        pool = eligible(session, replicas)
        chosen = pool[self._next % len(pool)]
        self._next += 1
        return chosen
