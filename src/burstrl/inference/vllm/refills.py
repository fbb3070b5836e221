"""Evictions, re-fills and thrash of a replica on vLLM, read from each call's cached tokens.

vLLM has no per-session caches and reports no evictions: its prefix cache is keyed by content and
frees blocks LRU. But each call says how many prompt tokens it found cached, and the replica knows
the session's previous call: a call that extends its session's history and finds fewer tokens
cached than vLLM kept of that history (its full blocks) was partly evicted and re-fills them. The
router's thrashing monitor needs these counts (`/v1/loads`), defined as the own engine does
(`inference.kvcache.SessionCache`): a re-fill is a call prefilling history it had cached, and
thrash is a session evicted again within `window_s` of its last re-fill.
"""

from __future__ import annotations

import time

from burstrl.inference.request import Request


class RefillTracker:
    """Counts from the calls' cached tokens; owned by the engine's loop thread, read from any thread."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self.evictions = 0  # calls that found part of their session's history gone
        self.refills = 0
        self.refilled_tokens = 0  # history tokens prefilled again
        self.thrash = 0
        self._refilled_at: dict[str, float] = {}  # session -> its last re-fill (live sessions only)

    def observe(self, req: Request, block_size: int, now: float | None = None) -> None:
        """`req` ended with vLLM's cached-token count; its session still holds the previous call."""
        session = req.session
        history = session.history()
        if session.ephemeral or not history or req.prompt_ids[:len(history)] != history:
            return  # a first call, or one that does not extend the history: nothing was owed to it
        kept = (len(history) - 1) // block_size * block_size  # full blocks of the KV vLLM computed
        if req.cached_tokens >= kept:
            return
        now = time.monotonic() if now is None else now
        self.evictions += 1
        self.refills += 1
        self.refilled_tokens += kept - req.cached_tokens
        last = self._refilled_at.get(session.id)
        if last is not None and now - last < self.window_s:
            self.thrash += 1
        self._refilled_at[session.id] = now

    def forget(self, session_id: str) -> None:
        """The session is gone (released or expired): its last re-fill no longer matters."""
        self._refilled_at.pop(session_id, None)
