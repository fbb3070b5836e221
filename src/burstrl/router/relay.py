"""Relaying a replica's answer to the caller, with caps: the router never holds an unbounded answer.

Why caps (issue 36): the router read a non-streaming answer whole before passing it on (a 200 MB
body took it from ~91 to ~710 MB), and it buffered a stream until a blank line ended the event (an
event without one was buffered whole: 48 MB cost half a minute of CPU in repeated copies). Now a
non-streaming answer is read up to `max_answer_bytes` and refused past it with a 502 that names the
cap; a stream goes on event by event, each event at most `max_event_bytes`, and one past it ends the
stream with an error event naming the cap. Both are counted (`answers_refused`). The replica is not
dropped for it: a long answer is the caller's request's doing as often as the replica's.

Why whole events on a stream: a replica that dies mid-stream leaves a cut event and no `[DONE]`;
passing the cut part on, or just ending, would make a half answer look complete. Instead the cut
event is dropped and a final `data: {"error": ...}` (what OpenAI clients raise on) follows; the
replica is dropped, so the session's retry goes to another replica.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

import httpx
from fastapi.responses import Response, StreamingResponse

from burstrl.config import RouteConfig
from burstrl.deadline import CallFailed, achunks, aopen
from burstrl.protocol.http import error_body
from burstrl.router.registry import Registry, RouteError

log = logging.getLogger(__name__)
EVENT_END = re.compile(rb"\r\n\r\n|\n\n")  # what ends a server-sent event


class RouterState(Protocol):
    """What a relay needs of the router (`server.Router`): its caps, client, registry and lock."""

    cfg: RouteConfig
    registry: Registry
    lock: asyncio.Lock

    def http(self) -> httpx.AsyncClient: ...


async def forward(router: RouterState, replica: str, path: str, raw: bytes, headers: dict[str, str],
                  stream: bool) -> Response:
    """Send one call to `replica` and answer with what it answers (capped); a stream as a `RelayResponse`.

    Deadlines (`burstrl.deadline`): the headers within `request_timeout_s`, however slowly they drip; a
    non-streaming body within what is left of it; a stream's chunks at most `stream_gap_s` apart. Every
    failure is a `CallFailed` (the caller maps its kind to a retry, a drop or a 504).
    """
    client, deadline = router.http(), router.cfg.request_timeout_s
    request = client.build_request("POST", replica + path, content=raw,
                                   headers={**headers, "accept-encoding": "identity"})
    end = time.monotonic() + deadline
    upstream = await aopen(client, request, header_deadline=deadline)
    media_type = upstream.headers.get("content-type", "text/event-stream" if stream else "application/json")
    if not stream:
        try:
            body = await read_capped(router, replica, upstream, end - time.monotonic())
        finally:
            await upstream.aclose()
        return Response(body, status_code=upstream.status_code, media_type=media_type)

    async def cleanup() -> None:
        router.registry.call_ended(replica)
        await upstream.aclose()

    return RelayResponse(relay(router, replica, upstream), cleanup, status_code=upstream.status_code,
                         media_type=media_type)


async def read_capped(router: RouterState, replica: str, upstream: httpx.Response, deadline: float) -> bytes:
    """A non-streaming answer's body within `deadline` seconds, or a 502 naming `max_answer_bytes` as soon as
    it is known to pass it."""
    cap = router.cfg.max_answer_bytes
    length = upstream.headers.get("content-length", "")
    body = bytearray()
    if not (length.isdigit() and int(length) > cap):
        async for chunk in achunks(upstream, gap=max(deadline, 0.0), deadline=deadline):
            body += chunk
            if len(body) > cap:
                break
        else:
            return bytes(body)
    router.registry.counters.answers_refused += 1
    raise RouteError(502, f"replica {replica} answered more than max_answer_bytes ({cap} bytes); the answer "
                     "is refused, not relayed", "server_error")


class RelayResponse(StreamingResponse):
    """A relayed stream whose cleanup (the call's in-flight count, the upstream connection) runs
    however the response ends.

    Why not the relay generator's `finally`: a client gone before the headers are sent makes
    Starlette's first `send` raise, so the generator is never iterated and an un-started generator
    runs no `finally`: each such client leaked an in-flight count (skewing placement) and an
    upstream connection from the pool, while the replica went on generating for nobody.
    """

    def __init__(self, content: AsyncIterator[bytes], cleanup: Callable[[], Awaitable[None]], **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self._cleanup = cleanup

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._cleanup()


async def relay(router: RouterState, replica: str, upstream: httpx.Response) -> AsyncIterator[bytes]:
    """Pass a replica's SSE stream on as its events complete, each at most `max_event_bytes`; a broken
    stream or an event over the cap ends in an error event."""
    cap, pending = router.cfg.max_event_bytes, bytearray()
    try:
        async for chunk in achunks(upstream, gap=router.cfg.stream_gap_s):
            start = max(0, len(pending) - 3)  # a separator may straddle the chunk boundary
            pending += chunk
            cut = max(_end_after(pending, b"\n\n", start), _end_after(pending, b"\r\n\r\n", start))
            if _over_cap(pending, cut, cap):
                router.registry.counters.answers_refused += 1
                router.registry.counters.errors += 1
                yield sse_error(502, f"replica {replica} sent a stream event over max_event_bytes ({cap} bytes); "
                                "the rest of the answer is refused")
                return
            if cut:
                yield bytes(pending[:cut])
                del pending[:cut]
        if pending:
            yield bytes(pending)
    except CallFailed as exc:
        router.registry.counters.errors += 1
        if exc.timed_out:
            yield sse_error(504, f"replica {replica} timed out mid-stream ({exc.reason}); the partial answer is void")
            return
        log.warning("stream from %s broke (%s); replica dropped", replica, exc.reason)
        await drop(router, replica)
        yield sse_error(503, f"replica {replica} failed mid-stream ({exc.reason}); the partial "
                        "answer is void. Retrying is safe: the replica is dropped and the session's next "
                        "call goes to another replica")


async def drop(router: RouterState, url: str) -> None:
    """A replica whose connection failed leaves rotation now; its sessions re-home on their next call."""
    async with router.lock:
        router.registry.mark_dead(url)


def _over_cap(pending: bytearray, cut: int, cap: int) -> bool:
    """Whether an event is longer than `cap`: a whole one before `cut` (checked only when they are longer
    together) or the unfinished one after it."""
    if len(pending) - cut > cap:
        return True
    return cut > cap and max(map(len, EVENT_END.split(bytes(pending[:cut])))) > cap


def _end_after(data: bytearray, separator: bytes, start: int) -> int:
    """Where the data after the last `separator` (found at or after `start`) begins; 0 if none."""
    at = data.rfind(separator, start)
    return at + len(separator) if at >= 0 else 0


def sse_error(status: int, message: str) -> bytes:
    return f"data: {json.dumps(error_body(status, message, 'server_error'))}\n\n".encode()
