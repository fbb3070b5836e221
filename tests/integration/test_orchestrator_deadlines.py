"""The orchestrator's calls to the router end by a deadline, however slowly the router answers (issue 49, item 5).

Against the dripping loopback server of `test_deadline.py`: before, httpx's per-read timeout let a peer
sending a byte per read hold an attempt (its slot, its sandbox) for as long as it dripped.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import httpx
import pytest

from burstrl.orchestrator import client as orchestrator_client
from burstrl.orchestrator.client import ReplicaFailure, SessionClient, assign, fetch_trace, release

from .test_deadline import _Handler, _Server

DEADLINE, SLACK = 0.6, 1.5


@pytest.fixture(scope="module")
def base() -> Iterator[str]:
    import threading

    server = _Server(("127.0.0.1", 0), _Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def _timed(call) -> tuple[float, object]:  # type: ignore[no-untyped-def]
    async def go() -> object:
        async with httpx.AsyncClient(timeout=DEADLINE) as http:
            try:
                return await call(http)
            except ReplicaFailure as exc:
                return exc

    start = time.monotonic()
    result = asyncio.run(go())
    return time.monotonic() - start, result


@pytest.mark.parametrize("path", ["/drip-headers", "/drip-body"])
def test_the_orchestrators_router_calls_end_by_their_deadline(base: str, path: str) -> None:
    """`path` stands for the router: every call the attempt makes gets the dripped answer."""
    calls = {
        "chat": lambda http: SessionClient(http, base + path, "s", "base", 1.0, 8, 0).chat([]),
        "assign": lambda http: assign(http, base + path, "s"),
        "trace": lambda http: fetch_trace(http, base + path, "s", "token"),
    }
    for name, call in calls.items():
        took, result = _timed(call)
        assert isinstance(result, ReplicaFailure), (name, result)
        assert took < DEADLINE + SLACK, (name, took)
    took, result = _timed(lambda http: release(http, base + path, "s", "token"))
    assert result is False and took < DEADLINE + SLACK


@pytest.mark.parametrize("path", ["/drip-headers", "/drip-body"])
def test_an_sdk_call_through_the_session_transport_ends_by_its_deadline(base: str, path: str,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(orchestrator_client, "SDK_DEADLINE_S", DEADLINE)

    async def go() -> tuple[float, BaseException | None, ReplicaFailure | None]:
        async with httpx.AsyncClient(timeout=30) as http:
            session = SessionClient(http, base, "s", "base", 1.0, 8, 0)
            start = time.monotonic()
            async with session.sdk_http() as sdk:
                try:
                    await sdk.post(base + path, json={"messages": []})
                    raised = None
                except httpx.TimeoutException as exc:
                    raised = exc
            return time.monotonic() - start, raised, session.failure

    took, raised, failure = asyncio.run(go())
    assert raised is not None and isinstance(failure, ReplicaFailure)
    assert took < DEADLINE + SLACK
