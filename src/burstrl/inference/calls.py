"""How a finished engine call reaches its session, its capture and its waiting handler.

Written once for every engine (`inference.backend`): whichever engine computed the tokens, the
session keeps the same history, the capture records the same fields and the handler is woken the
same way, so what a trainer reads cannot depend on the engine behind the replica.
"""

from __future__ import annotations

import time

from burstrl.inference.capture import CallRecord, new_record
from burstrl.inference.request import EngineCounters, Request
from burstrl.inference.sessions import SessionTable


def settle_session(req: Request, text: str) -> None:
    """A call that ended normally becomes its session's latest call (what the next call must extend)."""
    if req.text is None:
        req.text = text
    session = req.session
    session.messages, session.tools, session.cache_salt = req.messages, req.tools, req.cache_salt
    session.prompt_ids = req.prompt_ids
    session.completion_ids = req.completion_ids
    session.completion_text = req.text


def report_done(req: Request, reason: str, sessions: SessionTable, counters: EngineCounters, capture: bool) -> None:
    """End the call: count it, capture it (a failed call is never captured), free its session, wake its handler."""
    req.finish_reason = reason
    req.t_end = time.monotonic()
    c = counters.requests
    c[reason] = c.get(reason, 0) + 1
    session = req.session
    if capture and not session.ephemeral and req.error is None:
        sessions.capture(session, record_of(req))
    sessions.end(session)
    req.on_done(req)


def record_of(req: Request) -> CallRecord:
    """The capture record of a finished call: exact ids and the logprobs of the distribution sampled from."""
    start = req.t_start or req.t_end
    timings = {
        "queued_s": start - req.t_submit,
        "ttft_s": (req.t_first or req.t_end) - req.t_submit,
        "total_s": req.t_end - req.t_submit,
    }
    return new_record(
        req.id, req.version, req.prompt_ids, req.completion_ids, req.logprobs,
        finish_reason=req.finish_reason or "", cached_tokens=req.cached_tokens,
        timings=timings, created=time.time(),
    )
