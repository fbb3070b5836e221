"""The router's view of the fleet: registered replicas, session homes, and placement.

Why a separate, network-free module: every decision the router makes (which replica a call goes
to, when a session is re-homed, which error a caller gets) is a function of this state, so it can
be tested without sockets. The HTTP server (`server.py`) only scrapes replicas, feeds the results
in here, and forwards calls to the URL this module picks.

Errors carry the HTTP status the caller should get: a bad replica URL is 400, a model that no
replica serves is 404, a session whose version no healthy replica serves any more is 503.
"""

from __future__ import annotations

import random
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any
from urllib.parse import urlsplit

from burstrl.protocol.tenants import owner
from burstrl.router.catalog import DEFAULT_POLICY, make_policy
from burstrl.router.loads import block_summary, keep_recent
from burstrl.router.policies import (
    POOLS,
    NewSession,
    NoReplicaError,
    ReplicaView,
    RoutingPolicy,
    SizeModel,
    kind_of,
    live_projection,
    newest_routable_version,
    projected_headroom,
    record_assignment,
)

LATEST = "latest"  # the model name that asks the router to pick the version
# A session no replica has reported live for this long is forgotten: as long as a replica keeps
# an idle session (its default `session_ttl_s`), so a live session is never dropped for idling.
SESSION_GRACE_S = 1800.0
MAX_SESSIONS = 1_000_000
DROPPED = "#dropped"  # marks the home of a session whose replica was dropped (`remove`)
MAX_CAPACITY_TOKENS = 1 << 53  # beyond this a capacity is not a KV budget, and float math on it overflows


class RouteError(Exception):
    """A routing failure with the HTTP status and OpenAI error type to answer with."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind


def validate_url(url: str) -> str:
    """A replica URL must be plain http(s) with a host: a `file://` or `gopher://` URL is refused.

    Why: the router sends requests to whatever is registered, so a registration is a way to make
    it fetch arbitrary schemes; only http(s) is ever a replica.
    """
    if not isinstance(url, str) or not url:
        raise RouteError(400, "replica url is required")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise RouteError(400, f"replica url must be http(s), got scheme {parts.scheme!r}")
    if not parts.hostname:
        raise RouteError(400, f"replica url {url!r} has no host")
    if parts.query or parts.fragment or parts.username or parts.password:
        raise RouteError(400, f"replica url {url!r} must not carry credentials, a query or a fragment")
    return url.rstrip("/")


@dataclass
class RouterCounters:
    requests: int = 0
    errors: int = 0
    rehomes: int = 0
    rehomes_overflow: int = 0  # of `rehomes`: moved off a home over its KV budget that had evicted them
    rehomes_pressure: int = 0  # of `rehomes`: small sessions moved off a nearly full home before it evicted
    replicas_dropped: int = 0
    replicas_unanswered: int = 0  # times a replica left rotation for unanswered scrapes (it stays scraped)
    sessions_pruned: int = 0  # forgotten without a DELETE: finished, expired, or over `max_sessions`
    trace_release_failures: int = 0  # a DELETE could not release the part of a capture left on an old home
    scrapes_rejected: int = 0  # scrape answers not trusted (bad shape, size or numbers): replica marked bad
    scrape_errors: int = 0  # exceptions in the scrape loops (logged; the loops go on)
    replicas_readded: int = 0  # `--replicas` replicas registered again when they answered after a drop
    answers_refused: int = 0  # relayed answers over `max_answer_bytes` or with an event over `max_event_bytes`
    admitted: int = 0  # new sessions given a place by admission control (router/shares.py; 0 while it is off)
    admission_waits: int = 0  # of those and the rest: new sessions that had to queue for a place
    admission_quota_refusals: int = 0  # 429s: a tenant at its `max_sessions`
    admission_kv_quota_refusals: int = 0  # 429s: a new session projected past its tenant's `max_kv_tokens`
    admission_timeouts: int = 0  # 503s: no place within `admission_timeout_s`
    admission_abandoned: int = 0  # waiters whose client hung up (or was cancelled) before a place


class Registry:
    """Replicas by URL (the view's id is its URL), session homes, the policy and counters.

    A replica that is dropped (dead or deregistered) disappears from `replicas`; the sessions that
    lived there keep their stale home until their next call, which re-homes them. That is the
    "cache miss, not a lost rollout" the design asks for.

    The session maps (`homes`, `pinned`, `kinds`, `seen`) are bounded: `prune` forgets sessions
    that no replica has reported live and nobody has called for `grace_s` (finished or expired),
    and `max_sessions` caps them, oldest first. Why: the router never hears that most rollouts
    ended, and a router that runs for days must not grow with every session it ever placed.
    """

    def __init__(self, policy: str = DEFAULT_POLICY, k: int = 2, health_failures: int = 2, seed: int | None = None,
                 version_pools: tuple[str, ...] = (), max_sessions: int = MAX_SESSIONS,
                 grace_s: float = SESSION_GRACE_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.sizes = SizeModel()
        self.version_pools = version_pools or None  # pools that must serve a version before it is "latest"
        self.policy: RoutingPolicy = make_policy(policy, k=k, sizes=self.sizes)
        self.rng = random.Random(seed)
        self.health_failures = health_failures
        self.replicas: dict[str, ReplicaView] = {}
        self.homes: dict[str, str] = {}  # session id -> replica url
        self.past_homes: dict[str, list[str]] = {}  # session id -> replicas it moved off, in order
        self.failures: dict[str, int] = {}  # consecutive failed scrapes per replica
        self.cache_hit_rate: dict[str, float] = {}
        self.cache_counts: dict[str, dict[str, int]] = {}  # replica -> thrash, evictions, hit/query tokens
        self.live_versions: dict[str, dict[str, str]] = {}  # replica -> live session id -> version
        self.evicted: dict[str, set[str]] = {}  # replica -> idle live sessions whose cache it dropped
        self.pinned: dict[str, str] = {}  # session id -> the version it started on
        self.kinds: dict[str, str] = {}  # session id -> task kind (sizes it in the size model)
        self.seen: OrderedDict[str, float] = OrderedDict()  # session id -> last call or live report, oldest first
        self.max_sessions, self.grace_s, self.clock = max_sessions, grace_s, clock
        self.counters = RouterCounters()

    # --- membership -------------------------------------------------------------------------

    def add(self, url: str, pool: str = "reserved", weight: float = 1.0, capacity_tokens: int = 0) -> ReplicaView:
        """Register (or re-register, keeping nothing stale) a replica; it is routable once scraped."""
        url = validate_url(url)
        if pool not in POOLS:
            raise RouteError(400, f"pool must be one of {', '.join(POOLS)}, got {pool!r}")
        if not weight > 0:
            raise RouteError(400, "weight must be > 0")
        if not 0 <= capacity_tokens <= MAX_CAPACITY_TOKENS:
            raise RouteError(400, f"capacity_tokens must be in [0, {MAX_CAPACITY_TOKENS}]")
        view = ReplicaView(id=url, pool=pool, weight=float(weight), capacity_tokens=int(capacity_tokens))
        self.replicas[url] = view
        self.failures[url] = 0
        return view

    def remove(self, url: str) -> bool:
        """Drop a replica (drain or death); its sessions re-home on their next call.

        They re-home even if the replica is registered again before that call (a `--replicas` replica
        comes back when it answers a scrape): a caller was told its retry goes to another replica, and
        a replica that was dropped may have restarted without their caches and captures. Their home
        becomes `URL#dropped` (`DROPPED`), which no replica URL can be (fragments are refused), and its
        re-homing avoids that replica; O(sessions), once a drop.
        """
        url = url.rstrip("/")
        self.failures.pop(url, None)
        self.cache_hit_rate.pop(url, None)
        self.cache_counts.pop(url, None)
        self.live_versions.pop(url, None)
        self.evicted.pop(url, None)
        if url not in self.replicas:
            return False
        for sid, home in self.homes.items():
            if home == url:
                self.homes[sid] = url + DROPPED
        del self.replicas[url]
        return True

    def mark_dead(self, url: str) -> None:
        """A connection to the replica failed: stop routing there at once, counted."""
        if self.remove(url):
            self.counters.replicas_dropped += 1

    # --- scrapes ----------------------------------------------------------------------------

    def scrape_mark(self, url: str) -> tuple[ReplicaView, int] | None:
        """Taken when a scrape is sent: which of the replica's placements its answer may reflect."""
        view = self.replicas.get(url)
        return (view, view.assigned) if view is not None else None

    def apply_scrape(self, url: str, loads: dict[str, Any], models: dict[str, Any],
                     mark: tuple[ReplicaView, int] | None = None) -> None:
        """Fill a replica's view from its `/v1/loads` and `/v1/models` answers.

        Sessions that were live at the last scrape and are gone now have finished: their last
        size feeds the size model, so headroom projections learn from real sessions. Placements
        recorded after the scrape was sent (`mark`, from `scrape_mark`) stay recent: the answer
        may predate their calls, and forgetting them would let the next choice herd onto the
        same replica or miss the prefix just sent there. An earlier placement the answer does not
        show yet (session not listed, or its prompt's last block not in the block summary: the
        call was still queued or prefilling) stays up to `loads.HOLD_SCRAPES` scrapes more
        (`held_over`), then goes.
        """
        view = self.replicas.get(url)
        if view is None:
            return
        # A session's size is its context, not what is cached now: an evicted session reports 0
        # cached tokens, and counting it as 0 would make a thrashing replica look the emptiest.
        # A session that moved on overflow stays listed by its old home (which keeps its capture
        # until it is released): it is live where it lives now, and leaving here is not finishing.
        live = {s["session_id"]: max(int(s.get("tokens", 0)), int(s.get("context_tokens", 0)))
                for s in loads.get("sessions", []) if self.homes.get(s["session_id"], url) == url}
        for sid, tokens in view.live_sessions.items():
            if sid not in live and tokens > 0 and self.homes.get(sid, url) == url:
                self.sizes.observe(view.session_kinds.get(sid) or kind_of(owner(sid), "default"), tokens)
        view.live_sessions = live
        view.session_kinds = {sid: self.kinds[sid] for sid in live if sid in self.kinds}
        self._touch(live)
        view.used_tokens = int(loads.get("num_used_tokens", 0))
        view.kv_window = loads.get("kv_window")  # checked by answers.check_loads (None: full-attention KV)
        capacity = int(loads.get("max_total_num_tokens", 0))
        if capacity > 0:
            view.capacity_tokens = capacity
        view.versions = {m["id"] for m in models.get("data", [])} | set(loads.get("versions", []))
        view.cached_blocks = block_summary(loads)
        keep_recent(view, mark)
        view.healthy, view.bad_reason = True, ""
        self.failures[url] = 0
        self.cache_hit_rate[url] = float(loads.get("cache_hit_rate", 0.0))
        self.cache_counts[url] = {name: int(loads.get(name, 0)) for name in
                                  ("thrash", "evictions", "prefix_cache_hit_tokens", "prefix_cache_queries_tokens")}
        self.live_versions[url] = {s["session_id"]: str(s.get("version", "")) for s in loads.get("sessions", [])}
        self.evicted[url] = {s["session_id"] for s in loads.get("sessions", [])
                             if not s.get("busy") and int(s.get("tokens", 0)) == 0 and int(s.get("context_tokens", 0)) > 0}
        waiting = int(loads.get("num_running_reqs", 0)) + int(loads.get("num_waiting_reqs", 0))
        view.running_requests = waiting

    def scrape_failed(self, url: str, status: int | None = None) -> bool:
        """Count a failed scrape; True when the replica leaves rotation with this one.

        `status` is the HTTP status of a replica that answered (None: timeout, no connection, or an
        answer that was not a load report). A 503 is the replica saying it cannot serve (its engine
        died): dropped at once. Anything else may be a busy or briefly cut off replica: after
        `health_failures` failures in a row it stops getting sessions but stays registered and
        scraped, and its next answered scrape (`apply_scrape`) puts it back. Why not drop it: nothing
        registers a replica again, so a router starved for two scrape timeouts (a loaded machine)
        lost every replica it had and the run stalled; one the launcher knows is dead it deregisters.
        """
        view = self.replicas.get(url)
        if view is None:
            return False
        self.failures[url] = self.failures.get(url, 0) + 1
        if status == 503:
            view.healthy = False
            self.mark_dead(url)
            return True
        if self.failures[url] == self.health_failures:
            view.healthy = False
            self.counters.replicas_unanswered += 1
            return True
        return False

    def reject(self, url: str, reason: str) -> bool:
        """A scrape answer not to be trusted (`answers.BadAnswer`): the replica leaves rotation now with the
        reason, keeps its registration and is scraped on; a sane answer (`apply_scrape`) puts it back.
        True when this changed its state (for one log line, not one per scrape)."""
        view = self.replicas.get(url)
        if view is None:
            return False
        self.counters.scrapes_rejected += 1
        changed = view.healthy or view.bad_reason != reason
        view.healthy, view.bad_reason = False, reason
        return changed

    # --- placement --------------------------------------------------------------------------

    def models(self) -> set[str]:
        """Every version some healthy replica serves."""
        return set().union(*[r.versions for r in self.replicas.values() if r.healthy])

    def resolve(self, session_id: str | None, version: str | None,
                among: Callable[[str], bool] | None = None) -> str:
        """The concrete version a call runs on.

        `latest` (or no version) means the session's pinned version when the session is known,
        else the newest version at least one healthy replica of every pool serves: a version only
        some pools have would crowd new sessions onto those pools. Naming a version other than the
        pinned one is a 409, as on a replica, rather than a silent switch of weights mid-rollout.
        `among` limits `latest` to the versions it accepts (a tenant's: `router.tenancy`).
        """
        if session_id and session_id not in self.homes:
            self._adopt_sample(session_id)
        pinned = self.pinned.get(session_id) if session_id else None
        if version is None or version in ("", LATEST):
            if pinned is not None:
                return pinned
            newest = newest_routable_version(list(self.replicas.values()), self.version_pools, among)
            if newest is None:
                raise RouteError(503, "no version is served by a healthy replica of every pool", "server_error")
            return newest
        if pinned is not None and version != pinned:
            raise RouteError(409, f"session {session_id!r} is pinned to {pinned!r}, not {version!r}", "conflict_error")
        return version

    def place(self, session_id: str | None, version: str, expected_tokens: int = 0, kind: str = "default",
              prefix_hashes: tuple[int, ...] = (), block_tokens: int = 0) -> ReplicaView:
        """The replica for one call (or one `/v1/assign`) of `session_id` on `version`.

        A session stays where it lives while that replica is healthy and serves the version, unless
        the policy re-homes (`kv`) and the home both dropped the session's cache and is over its KV
        budget: then it moves if the policy finds a replica that costs less than staying (the home
        may still hold the call's prompt, e.g. a GRPO sibling's first prompt); or, before any of
        that, a nearly full home sheds a small session (the policy's `relieve`). The old home keeps
        the capture of the calls it served (`trace_homes` lists it), so the move goes only to a
        replica the session never lived on (concatenating its homes' captures is then the
        session's, in order); with no such replica it stays. A session whose home is gone is
        re-homed (counted) and gets 503 if nothing serves its version; a new session on a version
        nobody serves is 404 (bad input, not an outage). A call without a session is placed by the
        policy too (`prefix_hashes` are its prompt's blocks), and not remembered.
        """
        if session_id and session_id not in self.homes:
            self._adopt_sample(session_id)
        # a session keeps its first kind; a tenant's session (key `tenant~id`) is sized among its own
        kind = self.kinds.get(session_id, kind_of(owner(session_id), kind)) if session_id else kind
        session = NewSession(id=session_id or "", kind=self.sizes.admit(kind), version=version,
                             expected_tokens=expected_tokens, prefix_hashes=prefix_hashes, block_tokens=block_tokens)
        home = self.homes.get(session_id) if session_id else None
        if home is not None:
            self._touch((session_id,))
            view = self.replicas.get(home)
            if view is not None and view.healthy and version in view.versions:
                if self._overflowed(view, session_id):
                    return self._move(session, view, overflow=True)
                if self._pressed(view, session):
                    return self._move(session, view, overflow=False)
                return view
            self.homes.pop(session_id, None)
            self.counters.rehomes += 1
            return self._assign(session, avoid=home.removesuffix(DROPPED))
        if version not in self.models():
            raise RouteError(404, f"model {version!r} not found; served: {sorted(self.models())}",
                             "not_found_error")
        if not session_id:
            return self._choose(session)
        return self._assign(session)

    def _adopt_sample(self, session_id: str) -> None:
        """Sample i of a call with `n` > 1 (`<sid>/i`) lives where `<sid>` does: that replica holds its
        capture and the KV of its prompt and completion, so its next call continues there."""
        parent, _, index = session_id.rpartition("/")
        if not index.isdigit() or parent not in self.homes:
            return
        self.homes[session_id] = self.homes[parent]
        if parent in self.pinned:
            self.pinned[session_id] = self.pinned[parent]
        if parent in self.kinds:
            self.kinds[session_id] = self.kinds[parent]

    def _move(self, session: NewSession, home: ReplicaView, overflow: bool) -> ReplicaView:
        """Move a session off its home (that evicted it while overflowing: `rehome`; nearly full:
        `relieve`) to a replica it never lived on, if the policy picks one; else it stays."""
        past = self.past_homes.get(session.id, [])
        others = [v for v in self.replicas.values() if v.id != home.id and v.id not in past]
        try:
            pick = self.policy.rehome if overflow else self.policy.relieve  # type: ignore[attr-defined]
            view = pick(session, home, others, self.rng)
        except NoReplicaError:
            return home
        if view is None or view is home:
            return home
        record_assignment(view, session)
        self.past_homes[session.id] = [*past, home.id]
        self.homes[session.id] = view.id
        self.counters.rehomes += 1
        if overflow:
            self.counters.rehomes_overflow += 1
        else:
            self.counters.rehomes_pressure += 1
        return view

    def trace_homes(self, session_id: str) -> list[str]:
        """The replicas holding the session's capture, in the order it lived there (its home last).

        503 if one it moved off is gone: that part of the capture is lost with it. Sample i of a call
        with `n` > 1 (`<sid>/i`, captured by the replica as a session of its own) is where `<sid>` is.
        """
        parent, _, index = session_id.rpartition("/")
        if session_id not in self.homes and parent in self.homes and index.isdigit():
            return self.trace_homes(parent)
        home = self.home_of(session_id).id
        past = [url for url in self.past_homes.get(session_id, []) if url != home]
        for url in past:
            view = self.replicas.get(url)
            if view is None or not view.healthy:
                raise RouteError(503, f"session {session_id!r}: part of its capture was on {url}, which is gone",
                                 "server_error")
        return [*past, home]

    def may_move(self, session_id: str) -> bool:
        """Whether the session's next call may move it (the policy re-homes and its home evicted it):
        only then do its prompt's blocks count for placement (the router hashes them)."""
        home = self.homes.get(session_id)
        return (getattr(self.policy, "rehomes", False) and home is not None
                and session_id in self.evicted.get(home, ()))

    def _overflowed(self, view: ReplicaView, session_id: str) -> bool:
        """The home (`view`) evicted the (idle) session and its live sessions project past its KV budget."""
        return (self.may_move(session_id) and view.capacity_tokens > 0
                and live_projection(view, self.sizes) > view.capacity_tokens)

    def _pressed(self, view: ReplicaView, session: NewSession) -> bool:
        """The policy sheds small sessions (`kv`) and this one should leave its nearly full home."""
        pressed = getattr(self.policy, "pressed", None)
        return pressed is not None and pressed(session, view)

    def _choose(self, session: NewSession, avoid: str = "") -> ReplicaView:
        """The policy's pick, away from `avoid` (the home a session is re-homed from) unless only it serves."""
        others = [v for v in self.replicas.values() if v.id != avoid]
        try:
            view = self.policy.choose(session, others, self.rng)
        except NoReplicaError as exc:
            if len(others) < len(self.replicas):
                return self._choose(session)
            raise RouteError(503, str(exc), "server_error") from None
        record_assignment(view, session)
        return view

    def call_started(self, url: str) -> None:
        """The router sent a call to `url`: one more in flight there until `call_ended`."""
        view = self.replicas.get(url)
        if view is not None:
            view.in_flight += 1

    def call_ended(self, url: str) -> None:
        view = self.replicas.get(url)
        if view is not None and view.in_flight > 0:
            view.in_flight -= 1

    def _assign(self, session: NewSession, avoid: str = "") -> ReplicaView:
        view = self._choose(session, avoid)
        self.homes[session.id] = view.id
        self.pinned[session.id] = session.version
        self.kinds[session.id] = session.kind
        self._touch((session.id,))
        while len(self.seen) > self.max_sessions:  # the cap: the longest-unseen session goes first
            self._prune_one()
        return view

    def home_of(self, session_id: str) -> ReplicaView:
        """The live replica a known session lives on: 404 if the router never saw it, 503 if its home is gone."""
        home = self.homes.get(session_id)
        if home is None:
            raise RouteError(404, f"unknown session {session_id!r}", "not_found_error")
        view = self.replicas.get(home)
        if view is None or not view.healthy:
            raise RouteError(503, f"session {session_id!r} lived on {home}, which is gone", "server_error")
        return view

    def forget(self, session_id: str) -> None:
        """A finished session: drop its home and pin, so the maps do not grow for the whole run."""
        self.homes.pop(session_id, None)
        self.past_homes.pop(session_id, None)
        self.pinned.pop(session_id, None)
        self.kinds.pop(session_id, None)
        self.seen.pop(session_id, None)

    # --- pruning ----------------------------------------------------------------------------

    def _touch(self, session_ids: Any) -> None:
        """The sessions were called or reported live now: they are the last to be pruned."""
        now = self.clock()
        for sid in session_ids:
            if sid in self.homes:
                self.seen[sid] = now
                self.seen.move_to_end(sid)

    def _prune_one(self) -> None:
        sid, _ = self.seen.popitem(last=False)
        self.forget(sid)
        self.counters.sessions_pruned += 1

    def prune(self) -> int:
        """Forget sessions unseen for `grace_s` (finished, expired, or homed on a dead replica); how many.

        Cost is the number pruned: `seen` is ordered by last sighting, so the scan stops at the
        first session seen recently.
        """
        cutoff, pruned = self.clock() - self.grace_s, 0
        while self.seen and next(iter(self.seen.values())) < cutoff:
            self._prune_one()
            pruned += 1
        return pruned

    def map_sizes(self) -> dict[str, int]:
        """Entries in every per-session map (the soak checks they stay flat)."""
        views = self.replicas.values()
        return {"homes": len(self.homes), "past_homes": len(self.past_homes), "pinned": len(self.pinned),
                "kinds": len(self.kinds),
                "seen": len(self.seen), "session_kinds": sum(len(v.session_kinds) for v in views),
                "live_sessions": sum(len(v.live_sessions) for v in views),
                "recent_assignments": sum(len(v.recent_assignments) for v in views),
                "live_versions": sum(len(s) for s in self.live_versions.values()),
                "size_model_kinds": len(self.sizes.kinds())}

    # --- reporting --------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Per-replica load and placement figures plus totals (the `/v1/stats` body)."""
        probe = NewSession(id="")
        per_replica = []
        homed = Counter(self.homes.values())
        for view in self.replicas.values():
            counts = self.cache_counts.get(view.id, {})
            headroom = projected_headroom(view, probe, self.sizes) + self.sizes.project_new(probe)
            per_replica.append({
                "url": view.id, "pool": view.pool, "weight": view.weight, "healthy": view.healthy,
                "sessions": homed[view.id],
                "live_sessions": len(view.live_sessions), "used_tokens": view.used_tokens,
                "capacity_tokens": view.capacity_tokens, "projected_headroom": headroom,
                "versions": sorted(view.versions), "cache_hit_rate": self.cache_hit_rate.get(view.id, 0.0),
                "thrash": counts.get("thrash", 0), "evictions": counts.get("evictions", 0),
                "bad_reason": view.bad_reason,
            })
        spread = self.version_spread()
        return {"replicas": per_replica, "versions": {"live_sessions": spread, "in_use": len(spread),
                                                      "latest": newest_routable_version(list(self.replicas.values()))},
                "totals": {"replicas": len(per_replica), "sessions": len(self.homes), **asdict(self.counters),
                           "thrash": sum(r["thrash"] for r in per_replica),
                           "evictions": sum(r["evictions"] for r in per_replica),
                           "cache_hit_rate": self.fleet_hit_rate()}}

    def version_spread(self) -> dict[str, int]:
        """Live sessions per version across the fleet (as the replicas last reported them).

        Why from the replicas and not from `pinned`: only the replicas know which sessions are
        still live; the router never hears that a rollout ended.
        """
        spread: Counter[str] = Counter()
        for sessions in self.live_versions.values():
            spread.update(v for v in sessions.values() if v)
        return dict(sorted(spread.items()))

    def fleet_hit_rate(self) -> float:
        """Cached tokens over queried tokens summed over the replicas (not a mean of their rates)."""
        hits = sum(c.get("prefix_cache_hit_tokens", 0) for c in self.cache_counts.values())
        queries = sum(c.get("prefix_cache_queries_tokens", 0) for c in self.cache_counts.values())
        return hits / queries if queries else 0.0
