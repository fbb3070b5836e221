"""The orchestrator's side of the router: one session's chat client, traces, and version pinning.

Why one small module: the environment only sees `SessionClient.chat` (and `complete`); everything an attempt needs
from the fleet (the version a group starts on, the captured calls, their release) goes through the
router over HTTP, and every failure that means "a replica is gone" becomes one exception type the
scheduler retries on.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx

from burstrl.deadline import CallFailed, afetch
from burstrl.envs.base import ReplicaFailure, VersionGone, fleet_failure
from burstrl.protocol.http import SESSION_HEADER, default_ssl_context

__all__ = ["ReplicaFailure", "SessionClient", "VersionGone", "assign", "fetch_trace", "release"]


SDK_DEADLINE_S = 600.0  # an SDK's call through `sdk_http`, headers and body (its per-read timeout was the same)


def _deadline_of(http: httpx.AsyncClient) -> float:
    """The overall deadline of a call on `http`: its read timeout (the run's `request_timeout_s`), now
    for the whole call. Why: httpx's timeouts are per read, so a peer dripping its answer held the
    attempt (and its sandbox, its slot) for as long as it dripped."""
    return http.timeout.read or SDK_DEADLINE_S


async def _send(http: httpx.AsyncClient, method: str, url: str, what: str, **kwargs: Any) -> httpx.Response:
    """One call to the router within `_deadline_of(http)` (`burstrl.deadline.afetch`), its whole answer as an
    `httpx.Response`; any transport failure (a deadline passed included) is a `ReplicaFailure`."""
    try:
        reply = await afetch(http, method, url, deadline=_deadline_of(http), **kwargs)
    except CallFailed as exc:
        raise ReplicaFailure(f"{what}: {exc.reason}") from None
    return httpx.Response(reply.status, content=reply.body, request=httpx.Request(method, url))


def _raise_for(r: httpx.Response, what: str) -> None:
    """What `fleet_failure` calls the fleet's (5xx, 404/409, 408/429) is raised as such; any other
    4xx answers a request of ours, a bug, and is raised as the HTTP error it is."""
    if r.status_code < 400:
        return
    failure = fleet_failure(r.status_code, r.text, what)
    if failure is not None:
        raise failure
    r.raise_for_status()


class SessionClient:
    """A `ChatClient` bound to one session, one model version and the run's sampling settings."""

    def __init__(self, http: httpx.AsyncClient, router: str, session_id: str, model: str,
                 temperature: float, max_tokens: int, seed: int) -> None:
        self.http, self.router, self.session_id, self.model = http, router, session_id, model
        self.temperature, self.max_tokens, self.seed = temperature, max_tokens, seed
        self.calls = 0
        self.failure: ReplicaFailure | None = None

    async def chat(self, messages: list[dict[str, str]], max_tokens: int | None = None) -> str:
        r = await self._call("chat", "/v1/chat/completions", {"messages": messages}, max_tokens)
        return r["choices"][0]["message"]["content"] or ""

    async def complete(self, prompt: str, max_tokens: int | None = None, stop: list[str] | None = None) -> str:
        """A plain completion of `prompt` (no chat template: for base models), in the same session."""
        r = await self._call("completion", "/v1/completions", {"prompt": prompt, **({"stop": stop} if stop else {})},
                             max_tokens)
        return r["choices"][0]["text"] or ""

    def sdk_http(self) -> httpx.AsyncClient:
        """An httpx client for an SDK that calls the router itself (an ecosystem environment's openai
        client, `burstrl.envs.ecosystem`): every generation call it makes is this session's call.

        Why in the transport and not in the SDK's settings: the environment owns the SDK and its
        headers (verifiers sends its own trace id as the session header), so the session id and the
        group's version are forced on each request here, whatever the caller set, and each answered
        call is counted, as `chat` counts its own. A fleet failure (transport error, 5xx, or the
        version gone) is kept in `failure`: the SDK may swallow it into the environment's own error
        handling, and the attempt must then re-run, not be scored (`raise_failure`).
        """
        return httpx.AsyncClient(transport=_SessionTransport(self), timeout=httpx.Timeout(600.0, connect=30.0))

    def raise_failure(self) -> None:
        """Raise the fleet failure an SDK call met (see `sdk_http`), if any."""
        if self.failure is not None:
            raise self.failure

    async def _call(self, what: str, path: str, fields: dict[str, Any], max_tokens: int | None) -> dict[str, Any]:
        """One call of this session (model, sampling, seed and session id bound); its JSON answer."""
        body = {"model": self.model, **fields, "temperature": self.temperature,
                "max_tokens": max_tokens or self.max_tokens, "seed": self.seed + self.calls,
                "session_id": self.session_id}
        r = await _send(self.http, "POST", f"{self.router}{path}", f"{what} call {self.calls + 1}", json=body,
                        headers={SESSION_HEADER: self.session_id})
        _raise_for(r, f"{what} call {self.calls + 1}")
        self.calls += 1
        return r.json()


async def assign(http: httpx.AsyncClient, router: str, session_id: str) -> str:
    """Place a group's first session on the newest routable version; returns that version's name."""
    r = await _send(http, "POST", f"{router}/v1/assign", "assign", json={"session_id": session_id, "version": "latest"})
    _raise_for(r, "assign")
    return r.json()["version"]


async def fetch_trace(http: httpx.AsyncClient, router: str, session_id: str, admin_token: str) -> dict[str, Any]:
    """The session's captured calls, from the replica that served them (via the router).

    The token is the replicas' admin token: traces hold prompts and completions, so a replica
    serves them only to a caller with it (the router passes the header on).
    """
    r = await _send(http, "GET", f"{router}/v1/traces/{session_id}", "trace",
                    headers={"Authorization": f"Bearer {admin_token}"})
    _raise_for(r, "trace")
    return r.json()


async def release(http: httpx.AsyncClient, router: str, session_id: str, admin_token: str) -> bool:
    """Free the session's cache and trace on its replica; a failure only costs memory there (TTL frees it)."""
    try:
        r = await _send(http, "DELETE", f"{router}/v1/traces/{session_id}", "release",
                        headers={"Authorization": f"Bearer {admin_token}"})
    except ReplicaFailure:
        return False
    return r.status_code == 200


GENERATION_PATHS = ("/chat/completions", "/completions", "/inference/v1/generate")


class _SessionTransport(httpx.AsyncBaseTransport):
    """`SessionClient.sdk_http`'s transport: pins generation calls to the session and counts them."""

    def __init__(self, session: SessionClient) -> None:
        self.session, self.inner = session, httpx.AsyncHTTPTransport(verify=default_ssl_context())

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        s = self.session
        generation = request.method == "POST" and request.url.path.endswith(GENERATION_PATHS)
        if generation:
            request = self._pinned(request)
        end = time.monotonic() + SDK_DEADLINE_S
        try:
            try:
                async with asyncio.timeout(SDK_DEADLINE_S):
                    response = await self.inner.handle_async_request(request)
            except TimeoutError:
                raise httpx.ReadTimeout(f"no answer headers within {SDK_DEADLINE_S:g} s", request=request) from None
        except httpx.TransportError as exc:
            s.failure = s.failure or ReplicaFailure(f"call {s.calls + 1}: {type(exc).__name__}: {exc}")
            raise
        response.stream = _BoundedStream(response.stream, end, request, s)
        if generation and response.status_code == 200:
            s.calls += 1
        elif generation and response.status_code >= 400:
            detail = (await response.aread())[:300].decode(errors="replace")  # the router's own error: small
            s.failure = s.failure or fleet_failure(response.status_code, detail, f"call {s.calls + 1}")
        return response

    def _pinned(self, request: httpx.Request) -> httpx.Request:
        """The request with this session's id, version and call seed, whatever the SDK put there."""
        s = self.session
        try:
            body = json.loads(request.content or b"{}")
        except ValueError:
            body = None
        headers = {k: v for k, v in request.headers.items() if k.lower() not in ("content-length", SESSION_HEADER.lower())}
        headers[SESSION_HEADER] = s.session_id
        if "authorization" in s.http.headers:  # a tenant's token (a shared fleet), not the SDK's placeholder key
            headers["authorization"] = s.http.headers["authorization"]
        if not isinstance(body, dict):  # not JSON: the replica answers 400; nothing to pin
            return httpx.Request(request.method, request.url, headers=headers, content=request.content)
        body.update(model=s.model, session_id=s.session_id, seed=s.seed + s.calls)  # as `chat` seeds its calls
        return httpx.Request(request.method, request.url, headers=headers, content=json.dumps(body).encode())

    async def aclose(self) -> None:
        await self.inner.aclose()


class _BoundedStream(httpx.AsyncByteStream):
    """An answer's body that must end by `end` (monotonic), as `burstrl.deadline` bounds the orchestrator's
    own calls: an SDK reading a dripping answer gets an `httpx.ReadTimeout` (a transport error it handles)."""

    def __init__(self, inner: httpx.AsyncByteStream, end: float, request: httpx.Request, session: SessionClient) -> None:
        self.inner, self.end, self.request, self.session = inner, end, request, session

    async def __aiter__(self) -> AsyncIterator[bytes]:
        chunks = self.inner.__aiter__()
        while True:
            try:
                async with asyncio.timeout(max(self.end - time.monotonic(), 0.0)):
                    chunk = await anext(chunks)
            except StopAsyncIteration:
                return
            except TimeoutError:
                s = self.session
                s.failure = s.failure or ReplicaFailure(f"call {s.calls + 1}: answer not whole by its deadline")
                raise httpx.ReadTimeout("answer not whole by its deadline", request=self.request) from None
            yield chunk

    async def aclose(self) -> None:
        await self.inner.aclose()
