"""The router's relayed stream ends its call's in-flight count and closes the upstream however the
response ends, including a client gone before the headers went out (the relay never started)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from starlette.requests import ClientDisconnect

from burstrl.router.relay import RelayResponse

SCOPE = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "method": "POST", "path": "/"}


def run(events: list[str], send_fails_at: int | None) -> list[dict]:
    sent: list[dict] = []

    async def body() -> AsyncIterator[bytes]:
        events.append("started")
        yield b"data: a\n\n"
        yield b"data: [DONE]\n\n"

    async def cleanup() -> None:
        events.append("cleanup")

    async def send(message: dict) -> None:
        if send_fails_at is not None and len(sent) == send_fails_at:
            raise OSError("client gone")
        sent.append(message)

    async def receive() -> dict:
        return {"type": "http.disconnect"}

    asyncio.run(RelayResponse(body(), cleanup, media_type="text/event-stream")(SCOPE, receive, send))
    return sent


def test_whole_stream_cleans_up_once() -> None:
    events: list[str] = []
    sent = run(events, send_fails_at=None)
    assert [m["type"] for m in sent][0] == "http.response.start" and events == ["started", "cleanup"]


def test_client_gone_before_headers_still_cleans_up() -> None:
    """The regression: the generator never ran, so its own `finally` could not end the count."""
    events: list[str] = []
    with pytest.raises(ClientDisconnect):
        run(events, send_fails_at=0)
    assert events == ["cleanup"]


def test_client_gone_mid_stream_cleans_up() -> None:
    events: list[str] = []
    with pytest.raises(ClientDisconnect):
        run(events, send_fails_at=2)
    assert events == ["started", "cleanup"]
