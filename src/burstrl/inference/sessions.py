"""Sessions and in-replica capture: what every call of a rollout sampled, recorded by the replica.

Why inside the replica: the trainer needs the exact token ids and behaviour logprobs of each call.
A harness that re-tokenizes text or forgets to ask for logprobs silently corrupts training, so the
replica records every call of a session whether or not the client asked, and serves the record at
`GET /v1/traces/{session_id}` until the owner releases it (`DELETE`, or after `session_ttl_s` idle).

A session is pinned to the model version it started on, runs one call at a time, and remembers its
last conversation so the next chat call can reuse the sampled ids verbatim (token continuity).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

from burstrl.protocol.http import SESSION_ID


class SessionError(Exception):
    """A call conflicts with its session's state; `status` is the HTTP code to answer with."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class CallRecord:
    """One captured call: exactly what was fed and sampled, under which version."""

    request_id: str
    version: str
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    cached_tokens: int
    timings: dict[str, float]
    created: float

    def to_json(self) -> dict[str, Any]:
        return self.__dict__.copy()


@dataclass
class ReplicaSession:
    """State of one rollout on this replica."""

    id: str
    version: str
    ephemeral: bool = False  # a call without a session id: not kept after it finishes
    busy: bool = False
    last_used: float = field(default_factory=time.monotonic)
    kv_tokens: int = 0  # tokens of this session's KV held now (idle cache or running row)
    # token continuity: the last call's conversation and its exact ids
    messages: list[dict[str, Any]] | None = None
    prompt_ids: list[int] = field(default_factory=list)
    completion_ids: list[int] = field(default_factory=list)
    completion_text: str = ""
    calls: list[CallRecord] = field(default_factory=list)


class SessionTable:
    """All live sessions; thread-safe (HTTP handlers and the engine thread both use it)."""

    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self._sessions: dict[str, ReplicaSession] = {}
        self._lock = threading.Lock()
        self.expired = 0

    def begin(self, session_id: str | None, version: str, request_id: str) -> ReplicaSession:
        """Start a call: create or look up the session, check its version, mark it busy."""
        if session_id is None:
            return ReplicaSession(id=f"ephemeral-{request_id}", version=version, ephemeral=True, busy=True)
        if not SESSION_ID.fullmatch(session_id):
            raise SessionError(400, "session_id must be 1-128 characters of [A-Za-z0-9._:@/-]")
        with self._lock:
            session = self._sessions.get(session_id)
            if session is None:
                session = self._sessions[session_id] = ReplicaSession(id=session_id, version=version)
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
            return self._sessions.pop(session_id)

    def expire(self) -> list[ReplicaSession]:
        """Remove sessions idle longer than the TTL; returns them so their caches can be dropped."""
        now = time.monotonic()
        with self._lock:
            old = [s for s in self._sessions.values() if not s.busy and now - s.last_used > self.ttl_s]
            for s in old:
                del self._sessions[s.id]
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
