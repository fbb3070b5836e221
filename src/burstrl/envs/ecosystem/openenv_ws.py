"""The OpenEnv wire protocol, spoken without openenv: JSON frames over a WebSocket at `/ws`, plus
`/health` and `/schema` over HTTP.

Why not openenv's own client: any `openenv.core` client or server import pulls in gradio (about 5
CPU-s per process), and the protocol is small (docs/ecosystem-api.md 5.2): one connection is one
environment instance; the client sends `{"type": "reset", "data": {...}}`, `{"type": "step", "data":
<action>}` and `{"type": "close"}`, and the server answers each request (not `close`) with exactly
one frame, `{"type": "observation", "data": {"observation": {...}, "reward": x, "done": b}}` or
`{"type": "error", "data": {"message": ..., "code": ...}}`. HTTP `/reset` and `/step` are stateless
(each builds a fresh environment), so episodes need the socket.

Everything the server sends is hostile input: messages are bounded in size (`max_size`, the socket is
closed past it), in frames (`MAX_FRAMES`: the memory one message costs, not only its bytes) and in
time (each answer within `timeout_s`), and must have the documented shape. Every failure of the
transport, whatever the library raises, is an `InfraError` (the attempt re-runs, or after the
model's action is scored as its failure); the server refusing or failing on the model's action is
`ActionRejected` (the model's failure, scored).
"""

from __future__ import annotations

import asyncio
import json
import math
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from websockets.asyncio.client import ClientConnection, connect
from websockets.client import ClientProtocol
from websockets.exceptions import ConnectionClosed, ProtocolError
from websockets.frames import OP_BINARY, OP_CONT, OP_TEXT, Frame
from websockets.sync.client import ClientConnection as SyncClientConnection

from burstrl.deadline import CallFailed, fetch, sync_client
from burstrl.envs.base import InfraError

SCHEMES = {"http": "ws", "https": "wss", "ws": "http", "wss": "https"}
# Error codes of a step that the action caused: invalid for the action model, or the env raised on it.
ACTION_ERRORS = ("VALIDATION_ERROR", "EXECUTION_ERROR")
MAX_QUEUE = 4  # frames buffered unread; the server answers one per request, so more is a bad server
TEXT_LIMIT = 300  # characters of a server's error text kept in an exception
# Frames one message may take (its fragments and any control frames between them). websockets parses
# every frame a read brings (up to 256 KiB: ~87,000 one-byte fragments) into a ~200-byte object and
# keeps them all until the message is whole; its `max_size` counts payload bytes only, so a 900 KB
# message in one-byte fragments cost ~190 MB. A server's framework sends a message as one frame.
MAX_FRAMES = 1024
DATA_OPCODES = (OP_TEXT, OP_BINARY, OP_CONT)


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
    """GET `url` and parse its JSON body, read up to `max_bytes` and within `timeout_s` overall
    (`burstrl.deadline`: connect to last byte, so a server that drips its headers is cut too).

    ValueError names the failure (unreachable, not 200, too big, too slow, not JSON). Proxies from
    the environment are ignored: the server is reached directly.
    """
    try:
        with sync_client(timeout=timeout_s) as http:
            reply = fetch(http, "GET", url, deadline=timeout_s, max_bytes=max_bytes)
    except CallFailed as exc:
        reason = f"the answer is over {max_bytes} bytes" if exc.too_large else exc.reason
        raise ValueError(f"GET {url}: {short(reason)}") from None
    if reply.status != 200:
        raise ValueError(f"GET {url}: HTTP {reply.status}")
    try:
        return json.loads(reply.body)
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
                          max_size=max_bytes, create_connection=BoundedSyncConnection) as ws:
            ws.send(json.dumps({"type": "close"}))
    except Exception as exc:  # noqa: BLE001  (any failure of the transport is the server's: see EnvSocket._ask)
        raise ValueError(f"{ep.ws}: no OpenEnv WebSocket endpoint ({type(exc).__name__}: {short(exc)})") from None


class FrameBudget:
    """Stands in for a connection's `recv_frame`: fails the connection once a message takes more than
    `limit` frames. In the protocol, not after it, so the parser stops at the frame that passes the
    limit instead of building every frame of the read first."""

    def __init__(self, recv_frame: Any, limit: int = MAX_FRAMES) -> None:
        self.recv_frame, self.limit, self.count = recv_frame, limit, 0
        self.exceeded = False

    def __call__(self, frame: Frame) -> None:
        self.count += 1
        if self.count > self.limit:  # the parser turns this into a failed connection (close code 1002)
            self.exceeded = True
            raise ProtocolError(f"the server sent more than {self.limit} frames in one message")
        self.recv_frame(frame)
        if frame.fin and frame.opcode in DATA_OPCODES:
            self.count = 0  # a whole message: the next one starts afresh


def bound_frames(protocol: ClientProtocol) -> FrameBudget:
    """Put a FrameBudget in front of `protocol`'s frame handling (the parser calls self.recv_frame)."""
    budget = protocol.recv_frame = FrameBudget(protocol.recv_frame)  # type: ignore[method-assign]
    return budget


class BoundedConnection(ClientConnection):
    """An asyncio client connection whose messages are bounded in frames (`MAX_FRAMES`)."""

    def __init__(self, protocol: ClientProtocol, **kwargs: Any) -> None:
        self.budget = bound_frames(protocol)
        super().__init__(protocol, **kwargs)

    def data_received(self, data: bytes) -> None:
        """Past the budget, drop the connection at once: websockets would wait `close_timeout` for the
        server to answer its close frame before a pending `recv` learns the connection failed."""
        super().data_received(data)
        if self.budget.exceeded:
            self.transport.abort()


class BoundedSyncConnection(SyncClientConnection):
    """The same bound for the threaded client of `probe` (which reads nothing but the closing handshake)."""

    def __init__(self, sock: Any, protocol: ClientProtocol, **kwargs: Any) -> None:
        bound_frames(protocol)
        super().__init__(sock, protocol, **kwargs)


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
                               max_size=max_frame_bytes, max_queue=MAX_QUEUE, create_connection=BoundedConnection)
        except Exception as exc:  # noqa: BLE001  (see _ask)
            raise InfraError(f"cannot open {url}: {type(exc).__name__}: {short(exc)}") from None
        return cls(ws, timeout_s)

    async def reset(self, data: dict[str, Any]) -> StepResult:
        return parse_frame(await self._ask({"type": "reset", "data": data}, "reset"), "reset")

    async def step(self, action: dict[str, Any]) -> StepResult:
        return parse_frame(await self._ask({"type": "step", "data": action}, "step"), "step")

    async def _ask(self, message: dict[str, Any], during: str) -> Any:
        """Send one request and read its one answer within `timeout_s` (InfraError otherwise).

        Every exception of the transport is an InfraError, not only the ones websockets documents: a
        server can drive the library into states it asserts against (a fragmented message cut by the
        timeout once raised "cannot reset() while queue isn't empty"), and an exception out of
        `rollout` would read as a bug of the orchestrator and stop the run.
        """
        if self.broken:
            raise InfraError(f"{during}: the connection already failed")
        self.broken = True  # until the answer is in
        text = json.dumps(message, allow_nan=False)  # the adapter's own data: a failure here is a bug
        try:
            raw = await asyncio.wait_for(self._exchange(text), self.timeout_s)
        except asyncio.TimeoutError:
            raise InfraError(f"{during}: no answer from the server within {self.timeout_s:g} s") from None
        except Exception as exc:  # noqa: BLE001
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
        """Say `close` (the server then drops the session) and wait for the closing handshake, bounded.

        A failed connection is dropped at once: its stream may be out of step (a message cut by a
        timeout) and a server that misbehaved gets no `close_timeout` more of the attempt's time.
        """
        if self.broken:
            self.ws.transport.abort()
            return
        try:
            await asyncio.wait_for(self.ws.send(json.dumps({"type": "close"})), self.timeout_s)
            await self.ws.close()  # bounded by close_timeout
        except Exception:  # noqa: BLE001  (nothing more is read from this connection)
            self.ws.transport.abort()
        except BaseException:  # cancelled: drop the connection all the same
            self.ws.transport.abort()
            raise

    async def __aenter__(self) -> EnvSocket:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
