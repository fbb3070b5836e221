"""Sessions and in-replica capture: what every call of a rollout sampled, recorded by the replica.

Why inside the replica: the trainer needs the exact token ids and behaviour logprobs of each call.
A harness that re-tokenizes text or forgets to ask for logprobs silently corrupts training, so the
replica records every call of a session whether or not the client asked, and serves the record at
`GET /v1/traces/{session_id}` until the owner releases it (`DELETE`, or after `session_ttl_s` idle or
`session_max_life_s` since it began, whichever comes first). Records are deltas under caps
(`inference.capture`).

A session is pinned to the model version it started on, runs one call at a time, and remembers its
last conversation so the next chat call can reuse the sampled ids verbatim (token continuity).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

from burstrl.inference.capture import REPLICA_CAP, SESSION_CAP, CallRecord, CaptureLimits, SessionCapture
from burstrl.inference.tools import ToolSpec
from burstrl.protocol.tenants import SCOPED_SESSION_ID


class SessionError(Exception):
    """A call conflicts with its session's state; `status` is the HTTP code to answer with."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class ReplicaSession:
    """State of one rollout on this replica."""

    id: str
    version: str
    ephemeral: bool = False  # a call without a session id: not kept after it finishes
    busy: bool = False
    last_used: float = field(default_factory=time.monotonic)
    created: float = field(default_factory=time.monotonic)
    cache_salt: str | None = None  # the last call's (vLLM's field): scopes prefix sharing and the router's index
    kv_tokens: int = 0  # tokens of this session's KV held now (idle cache or running row)
    # token continuity: the last call's conversation and its exact ids
    messages: list[dict[str, Any]] | None = None
    tools: ToolSpec | None = None  # the last call's tools: a continued call must have the same
    prompt_ids: list[int] = field(default_factory=list)
    completion_ids: list[int] = field(default_factory=list)
    completion_text: str = ""
    capture: SessionCapture = field(default_factory=SessionCapture)

    @property
    def calls(self) -> list[CallRecord]:
        return self.capture.calls

    def history(self) -> list[int]:
        """The ids of the last call served: its prompt and completion (what a next call extends)."""
        return self.prompt_ids + self.completion_ids


class SessionTable:
    """All live sessions; thread-safe (HTTP handlers and the engine thread both use it)."""

    def __init__(self, ttl_s: float, max_life_s: float = float("inf"),
                 capture: CaptureLimits | None = None) -> None:
        self.ttl_s, self.max_life_s = ttl_s, max_life_s
        self.limits = capture or CaptureLimits(session_tokens=1 << 62, total_tokens=1 << 62)
        self._sessions: dict[str, ReplicaSession] = {}
        self._lock = threading.Lock()
        self.expired = 0
        self.captured_tokens = 0  # ids held by all live sessions' records
        self.captured_calls = 0
        self.dropped_calls = 0
        self.diverged_calls = 0

    def begin(self, session_id: str | None, version: str, request_id: str) -> ReplicaSession:
        """Start a call: create or look up the session, check its version, mark it busy."""
        if session_id is None:
            return ReplicaSession(id=f"ephemeral-{request_id}", version=version, ephemeral=True, busy=True)
        if not SCOPED_SESSION_ID.fullmatch(session_id):  # a client's id, or `<tenant>~<id>` (server.py)
            raise SessionError(400, "session_id must be 1-128 characters of [A-Za-z0-9._:@/-]")
        with self._lock:
            session = self._sessions.get(session_id)
            if session is None:
                now = time.monotonic()
                session = ReplicaSession(id=session_id, version=version, last_used=now, created=now)
                self._sessions[session_id] = session
            elif session.version != version:
                raise SessionError(409, f"session {session_id!r} is pinned to {session.version!r}, "
                                        f"not {version!r}")
            if session.busy:
                raise SessionError(409, f"session {session_id!r} already has a call running")
            session.busy = True
            session.last_used = time.monotonic()
            return session

    def end(self, session: ReplicaSession) -> None:
        with self._lock:
            session.busy = False
            session.last_used = time.monotonic()

    def capture(self, session: ReplicaSession, record: CallRecord) -> None:
        """Keep `record` (whole prompt) as a delta in `session`'s capture, or drop it past a cap."""
        with self._lock:
            cap, whole = session.capture, record.stored_tokens
            if cap.dropped_calls:
                reason = cap.dropped_reason or SESSION_CAP
            else:
                cap.delta(record)
                reason = self._over_cap(cap, record.stored_tokens)
            if reason is not None:
                cap.drop(whole, reason)
                self.dropped_calls += 1
                return
            cap.calls.append(record)
            cap.tokens += record.stored_tokens
            cap.diverged_calls += record.diverged
            self.diverged_calls += record.diverged
            self.captured_tokens += record.stored_tokens
            self.captured_calls += 1

    def _over_cap(self, cap: SessionCapture, tokens: int) -> str | None:
        if cap.tokens + tokens > self.limits.session_tokens:
            return SESSION_CAP
        if self.captured_tokens + tokens > self.limits.total_tokens:
            return REPLICA_CAP
        return None

    def _forget(self, session: ReplicaSession) -> None:
        """Drop `session` from the table and its records from the total (the lock is held)."""
        del self._sessions[session.id]
        self.captured_tokens -= session.capture.tokens

    def get(self, session_id: str) -> ReplicaSession | None:
        with self._lock:
            return self._sessions.get(session_id)

    def release(self, session_id: str) -> ReplicaSession:
        """Drop a session (its owner is done with it); refuse while a call runs."""
        with self._lock:
            session = self._sessions.get(session_id)
            if session is None:
                raise SessionError(404, f"unknown session {session_id!r}")
            if session.busy:
                raise SessionError(409, f"session {session_id!r} has a call running")
            self._forget(session)
            return session

    def expire(self) -> list[ReplicaSession]:
        """Remove sessions idle longer than the TTL or alive longer than their lifetime (a session that
        keeps calling must not hold its records forever); returns them so their caches can be dropped."""
        now = time.monotonic()
        with self._lock:
            old = [s for s in self._sessions.values() if not s.busy and
                   (now - s.last_used > self.ttl_s or now - s.created > self.max_life_s)]
            for s in old:
                self._forget(s)
            self.expired += len(old)
            return old

    def snapshot(self) -> list[ReplicaSession]:
        with self._lock:
            return list(self._sessions.values())

    def versions_in_use(self) -> dict[str, int]:
        with self._lock:
            counts: dict[str, int] = {}
            for s in self._sessions.values():
                counts[s.version] = counts.get(s.version, 0) + 1
            return counts
