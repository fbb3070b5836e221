"""Capture stored as deltas, with caps: what a session's calls recorded, in memory linear in its length.

Why deltas: an agent rollout's call k re-sends calls 1..k-1 as its prompt, so storing every prompt
whole costs O(turns^2) (400 one-token calls stored 1.6M ids). Token continuity makes call k's prompt
start with call k-1's prompt and completion, so a record keeps only `prefix_tokens` (how many leading
tokens it shares with the previous record's prompt + completion) and the ids after them. A call whose
prompt does not extend the previous one (an edited history, a continuity break, another client on the
same session id) still shares its longest common prefix; it is marked `diverged`, so the trainer and
the metrics see a session whose history changed under it.

Why caps: deltas bound an honest session by its context, not a hostile or runaway one. Each session's
stored tokens are capped (`engine.capture_max_session_tokens`) and so are all sessions' together
(`engine.capture_max_total_tokens`). Past a cap the call is still served but not recorded, and every
later call of that session is dropped too (a record is only useful with all before it); the trace says
how many calls and tokens were dropped and which cap dropped them, so a truncated rollout is never
mistaken for a whole one. Ids are kept in `array`s (4 bytes per id, 8 per logprob) instead of lists of
Python objects (~36 bytes per id).

The wire keeps the delta shape (`GET /v1/traces/{id}`); `burstrl.protocol.capture.expand_calls` rebuilds
whole prompts, and `?full=true` asks the replica to send them whole.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from typing import Any

from burstrl.protocol.capture import REPLICA_CAP, SESSION_CAP, expand_calls

__all__ = ["REPLICA_CAP", "SESSION_CAP", "CallRecord", "CaptureLimits", "SessionCapture", "new_record"]


@dataclass
class CallRecord:
    """One captured call: what was fed (past the shared prefix) and sampled, under which version."""

    request_id: str
    version: str
    prefix_tokens: int  # leading prompt tokens equal to the previous record's prompt + completion
    prompt_ids: array  # the prompt after those prefix_tokens
    completion_ids: array
    logprobs: array  # of each completion id, under the distribution it was sampled from
    finish_reason: str
    cached_tokens: int
    timings: dict[str, float]
    created: float
    diverged: bool = False  # the prompt does not extend the previous record's prompt + completion

    @property
    def stored_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)

    def to_json(self) -> dict[str, Any]:
        """The wire shape (a delta: `protocol.capture.expand_calls` rebuilds the whole prompt)."""
        return {k: v.tolist() if isinstance(v, array) else v for k, v in self.__dict__.items()}


def new_record(request_id: str, version: str, prompt_ids: list[int], completion_ids: list[int],
               logprobs: list[float], **rest: Any) -> CallRecord:
    """A record holding the whole prompt (prefix 0); `SessionCapture.add` turns it into a delta."""
    return CallRecord(request_id=request_id, version=version, prefix_tokens=0, prompt_ids=array("i", prompt_ids),
                      completion_ids=array("i", completion_ids), logprobs=array("d", logprobs), **rest)


def common_prefix(a: array, b: array) -> int:
    """Length of the longest common prefix of two id arrays (C-speed when one extends the other)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo] and a[:hi] != b[:hi]: bisect on slice equality
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


@dataclass
class CaptureLimits:
    session_tokens: int  # most ids one session's records may hold
    total_tokens: int  # most ids all sessions' records may hold together


@dataclass
class SessionCapture:
    """One session's records, the ids the next delta is taken against, and what was dropped."""

    calls: list[CallRecord] = field(default_factory=list)
    tail: array = field(default_factory=lambda: array("i"))  # the last record's prompt + completion
    tokens: int = 0
    diverged_calls: int = 0
    dropped_calls: int = 0
    dropped_tokens: int = 0
    dropped_reason: str | None = None

    def delta(self, record: CallRecord) -> None:
        """Rewrite a whole-prompt `record` as a delta against the tail, and move the tail on."""
        prompt = record.prompt_ids
        shared = common_prefix(self.tail, prompt)
        record.diverged = bool(self.calls) and shared < len(self.tail)
        record.prefix_tokens = shared
        record.prompt_ids = prompt[shared:]
        self.tail = prompt + record.completion_ids

    def drop(self, tokens: int, reason: str) -> None:
        """Count a call of `tokens` ids (its whole prompt and completion) as dropped; the session records
        nothing more (a later record's delta would have no base)."""
        self.dropped_calls += 1
        self.dropped_tokens += tokens
        self.dropped_reason = self.dropped_reason or reason

    def summary(self) -> dict[str, Any]:
        """What the trace reports beside its calls."""
        return {"stored_tokens": self.tokens, "diverged_calls": self.diverged_calls,
                "dropped_calls": self.dropped_calls, "dropped_tokens": self.dropped_tokens,
                "dropped_reason": self.dropped_reason}

    def calls_json(self, full: bool) -> list[dict[str, Any]]:
        """The records on the wire: deltas, or (`full`) each with its whole prompt rebuilt, as any
        reader of the deltas rebuilds it."""
        calls = [c.to_json() for c in self.calls]
        return expand_calls(calls) if full else calls
