"""Outgoing HTTP calls with an overall deadline, and one error type for every way they fail.

Why (issue 49): httpx's timeouts are per read, so a peer that answers one byte a second never times
out: a scrape, a health check or a relayed call to it waits as long as it drips, and whatever waits on
that call (a control loop, a lock, the shared executor) waits too. Every outgoing call of the router,
orchestrator and adapters goes through here instead, so no peer's answer can hold its caller past a
deadline the caller chose:

- `afetch` / `fetch`: a whole call (connect, request, response headers and body) within `deadline`
  seconds, the body at most `max_bytes`; the answer as a `Reply` (any status: the caller judges it).
- `aopen` + `achunks` (async) and `open_stream` + `chunks` (sync): a streamed answer whose headers
  come within `header_deadline` and whose body chunks come at most `gap` seconds apart (optionally
  all within `deadline`): a long generation is fine, a stalled one is cut.
- every failure (timeout, refused or reset connection, protocol error, an answer over `max_bytes`)
  raises `CallFailed`, whose `kind` (refused, broken, timeout, too_large, invalid) is what a caller's policy
  needs (retry elsewhere, drop the peer, answer 504); callers catch one type.

Async calls are bounded by cancellation (`asyncio.timeout`), so any `httpx.AsyncClient` works. A sync
call cannot be cancelled, so its bound is in the sockets: `sync_client` makes a client whose every
read, write and connect waits at most until the call's deadline; `fetch` refuses other clients
(a plain `httpx.Client` would silently be unbounded again).
"""

from __future__ import annotations

import asyncio
import contextvars
import time
import weakref
from collections.abc import AsyncIterator, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import httpcore
import httpx

# The monotonic time by which the current sync call's socket operations must end (None: unbounded).
_DEADLINE: contextvars.ContextVar[float | None] = contextvars.ContextVar("burstrl_http_deadline", default=None)
_BOUNDED: weakref.WeakSet[httpx.Client] = weakref.WeakSet()  # clients made by `sync_client`


class CallFailed(Exception):
    """An outgoing HTTP call that got no usable answer, with `kind` saying how, for the caller's policy:

    - "refused": no connection was made (refused, unreachable, connect timeout): the call never reached
      the peer, so it is safe to send again, elsewhere or later;
    - "broken": the connection broke or the answer was not HTTP: the peer may have run the call;
    - "timeout": the call passed its deadline (or a stream its gap between chunks);
    - "too_large": the answer passed `max_bytes`;
    - "invalid": this side could not make or read the call (a bad URL, a header h11 refuses): neither
      the peer's fault nor worth a retry;
    - "status": the peer answered with an error status (only from `Reply.check`, for callers that want it).

    `url` names the peer so a caller's log and metric can say whom.
    """

    KINDS = ("refused", "broken", "timeout", "too_large", "invalid", "status")

    def __init__(self, url: str, reason: str, kind: str = "broken") -> None:
        assert kind in self.KINDS, kind
        super().__init__(f"{url}: {reason}")
        self.url, self.reason, self.kind = url, reason, kind

    @property
    def timed_out(self) -> bool:
        return self.kind == "timeout"

    @property
    def too_large(self) -> bool:
        return self.kind == "too_large"

    @property
    def never_sent(self) -> bool:
        """The call never reached the peer (safe to retry)."""
        return self.kind == "refused"


@dataclass(frozen=True)
class Reply:
    """A whole answer: its status, headers and body (decoded as `httpx.Response.content` is, at most the
    call's `max_bytes` after decoding: a small compressed body cannot grow past the cap)."""

    status: int
    headers: httpx.Headers
    body: bytes
    url: str = ""

    def check(self) -> Reply:
        """This reply if its status is under 400, else a `CallFailed` of kind "status" naming it."""
        if self.status >= 400:
            detail = self.body[:300].decode(errors="replace")
            raise CallFailed(self.url, f"HTTP {self.status}: {detail}", kind="status")
        return self

    def json(self) -> Any:
        """The body as JSON; a body that is not JSON raises ValueError (the caller's bad answer, not a transport failure)."""
        import json

        return json.loads(self.body)


# --- async --------------------------------------------------------------------------------------


async def afetch(client: httpx.AsyncClient, method: str, url: str, *, deadline: float,
                 max_bytes: int | None = None, **kwargs: Any) -> Reply:
    """One whole call within `deadline` seconds (connect to last body byte); `kwargs` go to `client.stream`."""
    try:
        async with asyncio.timeout(deadline):
            async with client.stream(method, url, **kwargs) as response:
                body = await _aread(response, url, max_bytes)
                return Reply(response.status_code, response.headers, body, url)
    except TimeoutError:
        raise CallFailed(url, f"no whole answer within the {deadline:g} s deadline", kind="timeout") from None
    except httpx.HTTPError as exc:
        raise _failed(url, exc) from None


async def aopen(client: httpx.AsyncClient, request: httpx.Request, *, header_deadline: float) -> httpx.Response:
    """Send `request` and return its response once the headers are in (within `header_deadline`), body unread.

    The caller owns the response: read it with `achunks` and close it (`aclose`) however it ends.
    """
    url = str(request.url)
    try:
        async with asyncio.timeout(header_deadline):
            return await client.send(request, stream=True)
    except TimeoutError:
        raise CallFailed(url, f"no answer headers within the {header_deadline:g} s deadline", kind="timeout") from None
    except httpx.HTTPError as exc:
        raise _failed(url, exc) from None


async def achunks(response: httpx.Response, *, gap: float, deadline: float | None = None) -> AsyncIterator[bytes]:
    """The raw body of an open response, chunk by chunk, each within `gap` seconds of the last (and all
    within `deadline` seconds from now, if given); a stall or a broken stream raises `CallFailed`."""
    url, end = str(response.request.url), None if deadline is None else time.monotonic() + deadline
    chunks = response.aiter_raw()
    while True:
        wait = gap if end is None else min(gap, end - time.monotonic())
        try:
            async with asyncio.timeout(max(wait, 0.0)):
                chunk = await anext(chunks)
        except StopAsyncIteration:
            return
        except TimeoutError:
            raise CallFailed(url, f"stream stalled: no data within {wait:g} s", kind="timeout") from None
        except httpx.HTTPError as exc:
            raise _failed(url, exc) from None
        yield chunk


async def _aread(response: httpx.Response, url: str, max_bytes: int | None) -> bytes:
    """The body, refused as soon as it (or its declared length) passes `max_bytes`."""
    _check_length(response, url, max_bytes)
    body = bytearray()
    async for chunk in response.aiter_bytes():
        body += chunk
        if max_bytes is not None and len(body) > max_bytes:
            raise _too_large(url, max_bytes)
    return bytes(body)


# --- sync ---------------------------------------------------------------------------------------


def sync_client(**kwargs: Any) -> httpx.Client:
    """An `httpx.Client` whose sockets honour `fetch`'s deadlines; `kwargs` go to `httpx.Client`.

    `transport`, `mounts`, `proxy` and `trust_env` are refused and proxies from the environment are not
    used: the bound lives in this client's own transport, and any other transport (a proxy's) would
    be unbounded again.
    """
    for name in ("transport", "mounts", "proxy", "trust_env"):
        if name in kwargs:
            raise TypeError(f"sync_client makes its own transport; {name!r} is not supported")
    transport_args = {k: kwargs[k] for k in ("verify", "limits", "http1", "http2") if k in kwargs}
    transport = httpx.HTTPTransport(trust_env=False, **transport_args)
    pool = transport._pool  # httpx gives no other way to choose the network backend
    pool._network_backend = _DeadlineBackend(pool._network_backend)
    client = httpx.Client(transport=transport, trust_env=False, **kwargs)
    _BOUNDED.add(client)
    return client


def fetch(client: httpx.Client, method: str, url: str, *, deadline: float,
          max_bytes: int | None = None, **kwargs: Any) -> Reply:
    """`afetch` for sync code: one whole call within `deadline` seconds; `client` from `sync_client`."""
    _require_bounded(client)
    token = _DEADLINE.set(time.monotonic() + deadline)
    try:
        with client.stream(method, url, **kwargs) as response:
            _check_length(response, url, max_bytes)
            body = bytearray()
            for chunk in response.iter_bytes():
                body += chunk
                if max_bytes is not None and len(body) > max_bytes:
                    raise _too_large(url, max_bytes)
            return Reply(response.status_code, response.headers, bytes(body), url)
    except httpx.HTTPError as exc:
        raise _failed(url, exc, deadline) from None
    finally:
        _DEADLINE.reset(token)


def open_stream(client: httpx.Client, request: httpx.Request, *, header_deadline: float) -> httpx.Response:
    """`aopen` for sync code: the response once its headers are in; the caller reads it with `chunks`
    and closes it."""
    _require_bounded(client)
    token = _DEADLINE.set(time.monotonic() + header_deadline)
    try:
        return client.send(request, stream=True)
    except httpx.HTTPError as exc:
        raise _failed(str(request.url), exc, header_deadline) from None
    finally:
        _DEADLINE.reset(token)


def chunks(response: httpx.Response, *, gap: float, deadline: float | None = None) -> Iterator[bytes]:
    """`achunks` for sync code (a response from `open_stream`)."""
    url, end = str(response.request.url), None if deadline is None else time.monotonic() + deadline
    raw = response.iter_raw()
    while True:
        limit = time.monotonic() + gap if end is None else min(time.monotonic() + gap, end)
        token = _DEADLINE.set(limit)
        try:
            chunk = next(raw)
        except StopIteration:
            return
        except httpx.HTTPError as exc:
            raise _failed(url, exc, gap) from None
        finally:
            _DEADLINE.reset(token)
        yield chunk


def _require_bounded(client: httpx.Client) -> None:
    if client not in _BOUNDED:
        raise TypeError("a sync call with a deadline needs a client from burstrl.deadline.sync_client()")


class _DeadlineStream(httpcore.NetworkStream):
    """A socket whose every read and write waits at most until the current call's deadline."""

    def __init__(self, inner: httpcore.NetworkStream) -> None:
        self._inner = inner

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return self._inner.read(max_bytes, _clamp(timeout))

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self._inner.write(buffer, _clamp(timeout, write=True))

    def close(self) -> None:
        self._inner.close()

    def start_tls(self, ssl_context: Any, server_hostname: str | None = None,
                  timeout: float | None = None) -> httpcore.NetworkStream:
        return _DeadlineStream(self._inner.start_tls(ssl_context, server_hostname, _clamp(timeout)))

    def get_extra_info(self, info: str) -> Any:
        return self._inner.get_extra_info(info)


class _DeadlineBackend(httpcore.NetworkBackend):
    """The default backend, its streams wrapped in `_DeadlineStream` and its connects clamped too."""

    def __init__(self, inner: httpcore.NetworkBackend) -> None:
        self._inner = inner

    def connect_tcp(self, host: str, port: int, timeout: float | None = None, local_address: str | None = None,
                    socket_options: Iterable[Any] | None = None) -> httpcore.NetworkStream:
        return _DeadlineStream(self._inner.connect_tcp(host, port, _clamp(timeout, connect=True),
                                                       local_address, socket_options))

    def connect_unix_socket(self, path: str, timeout: float | None = None,
                            socket_options: Iterable[Any] | None = None) -> httpcore.NetworkStream:
        return _DeadlineStream(self._inner.connect_unix_socket(path, _clamp(timeout, connect=True), socket_options))

    def sleep(self, seconds: float) -> None:
        self._inner.sleep(seconds)


def _clamp(timeout: float | None, write: bool = False, connect: bool = False) -> float | None:
    """`timeout`, cut to what is left of the current call's deadline; none left raises the matching timeout."""
    end = _DEADLINE.get()
    if end is None:
        return timeout
    left = end - time.monotonic()
    if left <= 0:
        kind = httpcore.ConnectTimeout if connect else httpcore.WriteTimeout if write else httpcore.ReadTimeout
        raise kind("deadline passed")
    return left if timeout is None else min(timeout, left)


# --- shared -------------------------------------------------------------------------------------


def _check_length(response: httpx.Response, url: str, max_bytes: int | None) -> None:
    length = response.headers.get("content-length", "")
    if max_bytes is not None and length.isdigit() and int(length) > max_bytes:
        raise _too_large(url, max_bytes)


def _too_large(url: str, max_bytes: int) -> CallFailed:
    return CallFailed(url, f"answer over {max_bytes} bytes", kind="too_large")


def _failed(url: str, exc: httpx.HTTPError, deadline: float | None = None) -> CallFailed:
    """The one error for a transport failure; a timeout names the deadline it passed."""
    if isinstance(exc, httpx.ConnectTimeout | httpx.ConnectError):
        return CallFailed(url, f"no connection ({type(exc).__name__}: {exc})", kind="refused")
    if isinstance(exc, httpx.TimeoutException):
        within = f" within the {deadline:g} s deadline" if deadline is not None else ""
        return CallFailed(url, f"no answer{within} ({type(exc).__name__})", kind="timeout")
    broken = isinstance(exc, httpx.NetworkError | httpx.RemoteProtocolError | httpx.ProxyError)
    return CallFailed(url, f"{type(exc).__name__}: {exc}", kind="broken" if broken else "invalid")
