"""The OpenEnv wire protocol, spoken without openenv: JSON frames over a WebSocket at `/ws`, plus
`/health` and `/schema` over HTTP.

Why not openenv's own client: any `openenv.core` client or server import pulls in gradio (about 5
CPU-s per process), and the protocol is small (docs/ecosystem-api.md 5.2): one connection is one
environment instance; the client sends `{"type": "reset", "data": {...}}`, `{"type": "step", "data":
<action>}` and `{"type": "close"}`, and the server answers each request (not `close`) with exactly
one frame, `{"type": "observation", "data": {"observation": {...}, "reward": x, "done": b}}` or
`{"type": "error", "data": {"message": ..., "code": ...}}`. HTTP `/reset` and `/step` are stateless
(each builds a fresh environment), so episodes need the socket.

Everything the server sends is hostile input: frames are bounded in size (`max_size`, the socket is
closed past it) and in time (each answer within `timeout_s`), and must have the documented shape.
A fault of the server or the connection is an `InfraError` (the attempt re-runs); the server
refusing or failing on the model's action is `ActionRejected` (the model's failure, scored).
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httpx
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, WebSocketException

from burstrl.envs.base import InfraError

SCHEMES = {"http": "ws", "https": "wss", "ws": "http", "wss": "https"}
# Error codes of a step that the action caused: invalid for the action model, or the env raised on it.
ACTION_ERRORS = ("VALIDATION_ERROR", "EXECUTION_ERROR")
MAX_QUEUE = 4  # frames buffered unread; the server answers one per request, so more is a bad server
TEXT_LIMIT = 300  # characters of a server's error text kept in an exception


class ActionRejected(Exception):
    """The server refused the model's action (not valid for its action model) or failed running it."""


class AtCapacity(InfraError):
    """The server runs as many sessions as it allows (CAPACITY_REACHED): wait and connect again."""


@dataclass(frozen=True)
class Endpoint:
    """Where a server is: `http` for /health and /schema, `ws` for episodes."""

    http: str
    ws: str


@dataclass
class StepResult:
    """One observation frame: the observation's fields, the step's reward (None as 0.0), and done."""

    observation: dict[str, Any]
    reward: float
    done: bool


def is_url(spec: str) -> bool:
    return "://" in spec


def endpoint(url: str) -> Endpoint:
    """The server at `url` (http, https, ws or wss; a path prefix is kept, a trailing /ws dropped).

    ValueError names what is wrong with the URL.
    """
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in SCHEMES:
        raise ValueError(f"{url!r}: the URL must start with http://, https://, ws:// or wss://")
    if not parts.hostname:
        raise ValueError(f"{url!r}: no host in the URL")
    try:
        parts.port  # noqa: B018  (parsed lazily: a bad port raises here)
    except ValueError:
        raise ValueError(f"{url!r}: bad port") from None
    if parts.query or parts.fragment:
        raise ValueError(f"{url!r}: the URL must not carry a query or fragment")
    path = parts.path.rstrip("/")
    path = path[:-3] if path.endswith("/ws") else path
    http, ws = (scheme, SCHEMES[scheme]) if scheme.startswith("http") else (SCHEMES[scheme], scheme)
    return Endpoint(http=f"{http}://{parts.netloc}{path}", ws=f"{ws}://{parts.netloc}{path}/ws")


def short(text: Any) -> str:
    """A server-provided text, bounded, for messages and reasons."""
    s = str(text)
    return s if len(s) <= TEXT_LIMIT else s[:TEXT_LIMIT] + "..."


def get_json(url: str, timeout_s: float, max_bytes: int) -> Any:
    """GET `url` and parse its JSON body, read up to `max_bytes` and within `timeout_s` overall.

    ValueError names the failure (unreachable, not 200, too big, too slow, not JSON). Proxies from
    the environment are ignored: the server is reached directly.
    """
    deadline = time.monotonic() + timeout_s
    body = bytearray()
    try:
        with httpx.Client(timeout=timeout_s, trust_env=False) as http, http.stream("GET", url) as r:
            if r.status_code != 200:
                raise ValueError(f"GET {url}: HTTP {r.status_code}")
            for chunk in r.iter_bytes():
                body += chunk
                if len(body) > max_bytes:
                    raise ValueError(f"GET {url}: the answer is over {max_bytes} bytes")
                if time.monotonic() > deadline:
                    raise ValueError(f"GET {url}: no whole answer within {timeout_s:g} s")
    except httpx.HTTPError as exc:
        raise ValueError(f"GET {url}: {type(exc).__name__}: {short(exc)}") from None
    try:
        return json.loads(body)
    except (ValueError, RecursionError):
        raise ValueError(f"GET {url}: the answer is not JSON") from None


def fetch_action_schema(ep: Endpoint, timeout_s: float, max_bytes: int) -> dict[str, Any]:
    """The action's JSON schema from `GET /schema` (its `action` entry); ValueError otherwise."""
    schema = get_json(f"{ep.http}/schema", timeout_s, max_bytes)
    action = schema.get("action") if isinstance(schema, dict) else None
    if not isinstance(action, dict):
        raise ValueError(f"GET {ep.http}/schema: no action schema in the answer")
    return action


def probe(ep: Endpoint, timeout_s: float, max_bytes: int) -> None:
    """ValueError unless the server answers /health and /schema and accepts a WebSocket at /ws.

    The socket is opened and closed at once (the server builds an environment for it and drops it).
    """
    from websockets.sync.client import connect as connect_sync

    get_json(f"{ep.http}/health", timeout_s, max_bytes)
    fetch_action_schema(ep, timeout_s, max_bytes)
    try:
        with connect_sync(ep.ws, open_timeout=timeout_s, close_timeout=timeout_s, compression=None, proxy=None,
                          max_size=max_bytes) as ws:
            ws.send(json.dumps({"type": "close"}))
    except (OSError, TimeoutError, WebSocketException) as exc:
        raise ValueError(f"{ep.ws}: no OpenEnv WebSocket endpoint ({type(exc).__name__}: {short(exc)})") from None


def parse_frame(raw: Any, during: str) -> StepResult:
    """The observation in a server frame, checked. Error frames raise: `ActionRejected` for a step's
    VALIDATION_ERROR or EXECUTION_ERROR, `AtCapacity` for CAPACITY_REACHED, `InfraError` otherwise,
    as does any frame of another shape."""
    if not isinstance(raw, str):
        raise InfraError(f"{during}: the server sent a binary frame")
    try:
        frame = json.loads(raw)
    except (ValueError, RecursionError):
        raise InfraError(f"{during}: the server sent a frame that is not JSON: {short(raw)}") from None
    kind = frame.get("type") if isinstance(frame, dict) else None
    data = frame.get("data") if isinstance(frame, dict) else None
    if not isinstance(data, dict):
        raise InfraError(f"{during}: the server sent a frame without a data object: {short(raw)}")
    if kind == "error":
        raise _error(data, during)
    if kind != "observation":
        raise InfraError(f"{during}: the server sent a {short(kind)!r} frame, not an observation")
    return _observation(data, during)


def _error(data: dict[str, Any], during: str) -> Exception:
    code, message = short(data.get("code")), short(data.get("message"))
    if during == "step" and code in ACTION_ERRORS:
        errors = data.get("errors")
        detail = "; ".join(short(e.get("msg")) + f" at {short(e.get('loc'))}" for e in errors[:3]
                           if isinstance(e, dict)) if isinstance(errors, list) else ""
        what = "invalid action" if code == "VALIDATION_ERROR" else "the environment failed on the action"
        return ActionRejected(short(f"{what}: {detail or message}"))
    if code == "CAPACITY_REACHED":
        return AtCapacity(f"{during}: the server is at capacity ({message})")
    return InfraError(f"{during}: server error {code}: {message}")


def _observation(data: dict[str, Any], during: str) -> StepResult:
    observation, reward, done = data.get("observation", {}), data.get("reward"), data.get("done", False)
    if not isinstance(observation, dict):
        raise InfraError(f"{during}: the observation is a {type(observation).__name__}, not an object")
    if reward is None:
        reward = 0.0
    if not isinstance(reward, (int, float)) or not math.isfinite(_as_float(reward)):
        raise InfraError(f"{during}: the reward {short(reward)!r} is not a finite number")
    if not isinstance(done, bool):
        raise InfraError(f"{during}: done is {short(done)!r}, not a boolean")
    return StepResult(observation=observation, reward=float(reward), done=done)


def _as_float(number: float) -> float:
    """`number` as a float; an integer too big for one (JSON allows any) is infinite."""
    try:
        return float(number)
    except OverflowError:
        return math.inf


class EnvSocket:
    """One episode's connection: `reset`, then `step`s, then `close` (always, e.g. `async with`)."""

    def __init__(self, ws: ClientConnection, timeout_s: float) -> None:
        self.ws, self.timeout_s = ws, timeout_s
        self.broken = False  # a request failed: the stream may be out of step, so say nothing more

    @classmethod
    async def open(cls, url: str, timeout_s: float, max_frame_bytes: int) -> EnvSocket:
        """Connect (InfraError if the server cannot be reached or refuses the WebSocket).

        No compression: permessage-deflate cost 10x the whole exchange on loopback (50-90 ms vs ~5 ms
        an episode, docs/ecosystem-api.md 5.5); and no proxies from the environment.
        """
        try:
            ws = await connect(url, compression=None, proxy=None, open_timeout=timeout_s, close_timeout=timeout_s,
                               max_size=max_frame_bytes, max_queue=MAX_QUEUE)
        except (OSError, asyncio.TimeoutError, WebSocketException) as exc:
            raise InfraError(f"cannot open {url}: {type(exc).__name__}: {short(exc)}") from None
        return cls(ws, timeout_s)

    async def reset(self, data: dict[str, Any]) -> StepResult:
        return parse_frame(await self._ask({"type": "reset", "data": data}, "reset"), "reset")

    async def step(self, action: dict[str, Any]) -> StepResult:
        return parse_frame(await self._ask({"type": "step", "data": action}, "step"), "step")

    async def _ask(self, message: dict[str, Any], during: str) -> Any:
        """Send one request and read its one answer within `timeout_s` (InfraError otherwise)."""
        if self.broken:
            raise InfraError(f"{during}: the connection already failed")
        self.broken = True  # until the answer is in
        try:
            raw = await asyncio.wait_for(self._exchange(json.dumps(message, allow_nan=False)), self.timeout_s)
        except asyncio.TimeoutError:
            raise InfraError(f"{during}: no answer from the server within {self.timeout_s:g} s") from None
        except (OSError, WebSocketException) as exc:
            raise InfraError(f"{during}: the connection failed ({type(exc).__name__}: {short(exc)})") from None
        self.broken = False
        return raw

    async def _exchange(self, text: str) -> Any:
        try:
            await self.ws.send(text)
        except ConnectionClosed:
            pass  # a server that refuses a session (at capacity) says why, then closes: read that
        return await self.ws.recv()

    async def close(self) -> None:
        """Say `close` (the server then drops the session) and wait for the closing handshake, bounded;
        a failed connection is just closed."""
        try:
            if not self.broken:
                await asyncio.wait_for(self.ws.send(json.dumps({"type": "close"})), self.timeout_s)
        except (OSError, asyncio.TimeoutError, WebSocketException):
            pass
        finally:
            await self.ws.close()  # bounded by close_timeout; never raises on a dead peer

    async def __aenter__(self) -> EnvSocket:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
