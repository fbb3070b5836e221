"""Fair shares and quotas of new sessions among the tenants of one router (issue 51).

Why admission and not placement: a session that is placed holds its replica's KV until it ends,
so capacity is given out when a session starts. With `router.max_sessions_per_replica` > 0 the
fleet has that many session places per healthy (not draining) replica; a new session that finds
them all in use waits, in its tenant's FIFO queue, for one to free (a session released by a trace
DELETE or forgotten by the registry's pruning, a replica added). A freed place goes to the waiting
tenant with the fewest live sessions per unit of weight, ties to the oldest waiter: the rule of
the simulator's `tenant_sim.pick_fair`, so the simulated shares are the router's. Nothing is
reserved: a tenant alone takes every place (idle share goes to whoever has work), and a tenant
below its share is admitted before one above it however many that one has waiting.

A quota (`router.tenants.<name>.max_sessions`) caps a tenant's live plus waiting sessions: beyond
it a new session gets a 429 at once, so a flood cannot fill the queues either. A KV quota
(`router.tenants.<name>.max_kv_tokens`) caps the KV tokens its live plus waiting sessions are
projected to hold at their final sizes, the figure placement uses (router/kv_quota.py says why final
and not current sizes): a new session whose projection would take its tenant past it gets a 429 at
once. Both are checked when a session starts; a live session growing past its projection is not cut
off (its calls pass), but its tenant starts no new one until the total is back under the cap.

What counts: live sessions are the registry's homes in the tenant's namespace (`<tenant>~<sid>`;
without tenancy every session is tenant '') on a healthy replica, plus sessions admitted and not
yet placed: a replica that dies or leaves rotation releases its sessions' places at once. A call of
a session the router already placed (or a sample `<sid>/i` of one) always goes through; a call
without a session id is neither counted nor queued (the router remembers nothing of it, so it
holds no place). Everything here runs on the event loop, between awaits: no lock is needed.
Off (no per-replica places and no quota) every call goes through untouched.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import Counter, deque
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from burstrl.config import RouteConfig
from burstrl.protocol.tenants import owner
from burstrl.router.kv_quota import homed_kv, new_session_kv, refusal_message
from burstrl.router.policies import kind_of
from burstrl.router.registry import Registry, RouteError

POLL_S = 0.05  # how often a waiter looks for a freed place and for its client having hung up
FLEET_TENANT = ""  # the namespace of sessions without tenancy


@dataclass(eq=False)
class Waiter:
    """A new session waiting for a place: its key, tenant, arrival time, and the grant."""

    key: str
    tenant: str
    arrival_s: float
    kv: float = 0.0  # its projected final size (tokens), held against its tenant's KV quota while it waits
    granted: asyncio.Event = field(default_factory=asyncio.Event)


def pick_tenant(queues: dict[str, deque[Waiter]], live: Counter[str], weight: Callable[[str], float]) -> str | None:
    """The tenant whose head waiter gets the next place (`tenant_sim.pick_fair`): fewest live sessions
    per unit of weight among the waiting, ties to the longest-waiting head; None when nobody waits."""
    waiting = [t for t, q in queues.items() if q]
    if not waiting:
        return None
    return min(waiting, key=lambda t: (live[t] / weight(t), queues[t][0].arrival_s, t))


class Shares:
    """Admission of new sessions: quotas, places, per-tenant queues and the fair pick."""

    def __init__(self, cfg: RouteConfig, registry: Registry, clock: Callable[[], float] = time.monotonic,
                 poll_s: float = POLL_S) -> None:
        self.limits = cfg.tenants
        self.per_replica = cfg.max_sessions_per_replica
        self.timeout_s = cfg.admission_timeout_s
        self.registry, self.clock, self.poll_s = registry, clock, poll_s
        self.queues: dict[str, deque[Waiter]] = {}
        self.pending: dict[str, str] = {}  # admitted, not yet homed (its placement runs): key -> tenant
        self.pending_kv: dict[str, float] = {}  # of those: key -> projected final size at admission
        self._last_dispatch = -math.inf

    @property
    def enabled(self) -> bool:
        """Whether admission control is configured at all (places, or any tenant's quota)."""
        return self.per_replica > 0 or any(t.max_sessions or t.max_kv_tokens for t in self.limits.values())

    def weight(self, tenant: str) -> float:
        limits = self.limits.get(tenant)
        return limits.weight if limits is not None else 1.0

    def cap(self, tenant: str) -> int:
        limits = self.limits.get(tenant)
        return limits.max_sessions if limits is not None else 0

    def kv_cap(self, tenant: str) -> int:
        limits = self.limits.get(tenant)
        return limits.max_kv_tokens if limits is not None else 0

    def healthy_urls(self) -> set[str]:
        """The healthy replicas' URLs: the one rule, for `live` and `kv_held` alike, of where a homed
        session still holds a place (draining ones included: their sessions still run there)."""
        return {url for url, view in self.registry.replicas.items() if view.healthy}

    def kv_held(self, tenant: str) -> float:
        """Projected final KV tokens of `tenant`'s sessions: homed on a healthy replica (`kv_quota.homed_kv`),
        admitted and not yet homed there, and waiting for a place; those on a dead replica weigh nothing."""
        total, homed = homed_kv(self.registry, tenant, self.healthy_urls())
        total += sum(self.pending_kv.get(key, 0.0) for key, who in self.pending.items()
                     if who == tenant and key not in homed)
        return total + sum(w.kv for w in self.queues.get(tenant, ()))

    def places(self) -> float:
        """Session places of the fleet now: per-replica places x healthy, undrained replicas (inf: no cap)."""
        if self.per_replica <= 0:
            return math.inf
        healthy = sum(1 for v in self.registry.replicas.values() if v.healthy and not v.draining)
        return self.per_replica * healthy

    def live(self) -> Counter[str]:
        """Live sessions per tenant: homes in its namespace on a healthy replica, plus admitted ones
        not yet homed. A session whose replica died (removed: its home is `URL#dropped`) or left
        rotation (unhealthy) holds no place from then on, not until pruning forgets it: it runs
        nowhere, its replica's places left the count with it, and its tenant must not be held below
        its share (or its quota) by it. If it calls again it is re-homed and counted where it lands."""
        homes, up = self.registry.homes, self.healthy_urls()
        counts = Counter(owner(key) or FLEET_TENANT for key, url in homes.items() if url in up)
        for key, tenant in self.pending.items():
            if homes.get(key) not in up:
                counts[tenant] += 1
        return counts

    def waiting(self) -> int:
        return sum(len(q) for q in self.queues.values())

    def stats(self) -> dict[str, float | int]:
        """The admission figures of `/v1/stats` (counts only: no tenant names)."""
        places = self.places()
        return {"enabled": self.enabled, "places": -1 if places == math.inf else int(places),
                "live": sum(self.live().values()) if self.enabled else len(self.registry.homes),
                "waiting": self.waiting()}

    def _known(self, key: str) -> bool:
        """A session the router already placed (or is placing), or a sample `<sid>/i` of one."""
        if key in self.registry.homes or key in self.pending:
            return True
        parent, _, index = key.rpartition("/")
        return index.isdigit() and parent in self.registry.homes

    @asynccontextmanager
    async def admission(self, tenant: str | None, key: str | None, gone: Callable[[], Awaitable[bool]],
                        kind: str = "default", expected_tokens: int = 0) -> AsyncIterator[None]:
        """Around a call's placement: waits for (or refuses) a place if `key` is a new session.

        `kind` and `expected_tokens` are what placement sizes the session by (its task kind, and the
        `/v1/assign` hint or the first call's token-in prompt plus max_tokens): the KV quota weighs
        it by the same projection. The place is held as pending until the body ends; by then the
        session is homed (and counted there) or its placement failed (and the place is free again).
        """
        if not self.enabled or key is None or self._known(key):
            yield
            return
        await self.admit(key, tenant or FLEET_TENANT, gone, kind, expected_tokens)
        try:
            yield
        finally:
            self._release(key)
            self.dispatch(force=True)

    def _release(self, key: str) -> None:
        self.pending.pop(key, None)
        self.pending_kv.pop(key, None)

    async def admit(self, key: str, tenant: str, gone: Callable[[], Awaitable[bool]],
                    kind: str = "default", expected_tokens: int = 0) -> None:
        """Give `key` a place now, or queue it until the fair pick gives it one; 429 over a quota, 503 late."""
        counters = self.registry.counters
        live = self.live()
        cap = self.cap(tenant)
        if cap and live[tenant] + len(self.queues.get(tenant, ())) >= cap:
            counters.admission_quota_refusals += 1
            name = tenant or '""'
            raise RouteError(429, f"tenant quota reached: {cap} sessions live or waiting "
                             f"(router.tenants.{name}.max_sessions = {cap}); "
                             "end a session or try again later", "rate_limit_error")
        kv, kv_cap = 0.0, self.kv_cap(tenant)
        if kv_cap:
            kv, held = new_session_kv(self.registry, kind_of(tenant, kind), expected_tokens), self.kv_held(tenant)
            if held + kv > kv_cap:
                counters.admission_kv_quota_refusals += 1
                raise RouteError(429, refusal_message(tenant, kv_cap, held, kv), "rate_limit_error")
        if not self.waiting() and sum(live.values()) < self.places():
            self._grant(key, tenant, kv)
            return
        waiter = Waiter(key, tenant, self.clock(), kv)
        self.queues.setdefault(tenant, deque()).append(waiter)
        counters.admission_waits += 1
        try:
            await self._wait(waiter, gone)
        except BaseException as exc:
            if isinstance(exc, asyncio.CancelledError):
                counters.admission_abandoned += 1
            self._withdraw(waiter)
            raise

    async def _wait(self, waiter: Waiter, gone: Callable[[], Awaitable[bool]]) -> None:
        """Wait for the grant, looking every `poll_s` for a freed place, the deadline and a hung-up client."""
        deadline = waiter.arrival_s + self.timeout_s
        while True:
            self.dispatch()
            if waiter.granted.is_set():
                return
            left = deadline - self.clock()
            if left <= 0:
                self.registry.counters.admission_timeouts += 1
                raise RouteError(503, f"no session place freed within router.admission_timeout_s = "
                                 f"{self.timeout_s:g} s: all {self.stats()['places']} places "
                                 f"(router.max_sessions_per_replica = {self.per_replica} x healthy replicas) "
                                 "are in use; try again later", "server_error")
            if await gone():
                self.registry.counters.admission_abandoned += 1
                raise RouteError(499, "the client hung up while its new session waited for a place")
            try:
                async with asyncio.timeout(min(self.poll_s, left)):
                    await waiter.granted.wait()
            except TimeoutError:
                pass

    def _withdraw(self, waiter: Waiter) -> None:
        """A waiter that gives up (client gone, deadline, cancelled) leaves its queue, or frees its grant."""
        queue = self.queues.get(waiter.tenant)
        if queue is not None and waiter in queue:
            queue.remove(waiter)
            if not queue:
                del self.queues[waiter.tenant]
        elif waiter.granted.is_set():
            self._release(waiter.key)
        self.dispatch(force=True)

    def _grant(self, key: str, tenant: str, kv: float = 0.0) -> None:
        self.pending[key] = tenant
        if kv:
            self.pending_kv[key] = kv
        self.registry.counters.admitted += 1

    def dispatch(self, force: bool = False) -> None:
        """Give every free place to the fair pick's head waiter. Unforced calls (every waiter's tick)
        run at most once per half `poll_s`, since each counts the registry's homes."""
        now = self.clock()
        if not self.queues or (not force and now - self._last_dispatch < self.poll_s / 2):
            return
        self._last_dispatch = now
        live = self.live()
        free = self.places() - sum(live.values())
        while free > 0:
            tenant = pick_tenant(self.queues, live, self.weight)
            if tenant is None:
                return
            waiter = self.queues[tenant].popleft()
            if not self.queues[tenant]:
                del self.queues[tenant]
            self._grant(waiter.key, tenant, waiter.kv)
            waiter.granted.set()
            live[tenant] += 1
            free -= 1
