"""The OpenEnv adapter's transport against servers that attack it below the JSON (issue 49, items 6 and 7).

The server is written on raw sockets (one thread per connection, on loopback), so it can do what no
WebSocket or HTTP library would: split one message into a million one-byte fragments, or send
`/schema`'s headers one byte at a time. The path prefix of the URL picks the behaviour
(`http://127.0.0.1:PORT/<mode>`), as in tests/unit/test_openenv_env.py.

Invariants: every failure of the server's transport ends the attempt by the README's rules (an
`InfraError` before the model acted, the model's failure with a reason after), never another exception
out of `rollout`; the memory and frames one message costs are bounded, not only its size; one slow
server never holds the event loop's shared thread pool, and a failed `/schema` is not fetched again by
every waiting attempt.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import json
import math
import socket
import struct
import threading
import time
import tracemalloc
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from burstrl.envs.base import InfraError
from burstrl.envs.ecosystem import openenv_env
from burstrl.envs.ecosystem.openenv_env import OpenEnvEnv, OpenEnvOptions
from tests.waiting import wait_for

SCHEMA = {"type": "object", "required": ["answer"], "properties": {"answer": {"type": "integer"}}}
WS_GUID = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
OBS = json.dumps({"type": "observation", "data": {"observation": {"q": "2 + 3?"}, "reward": 0, "done": False}})
DRIP_S = 0.25  # one byte of /schema's headers every DRIP_S seconds
HEADERS = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}"  # 40 bytes: a 10 s drip


def one_byte_fragments(text: str) -> bytes:
    """`text` as one WebSocket text message of len(text) frames of one byte each (server frames: unmasked)."""
    payload = text.encode()
    n = len(payload)
    wire = bytearray(3 * n)
    wire[0::3] = b"\x00" * n  # continuation, not final
    wire[1::3] = b"\x01" * n  # one byte of payload, no mask
    wire[2::3] = payload
    wire[0] = 0x01  # the first frame: text, not final
    wire[3 * (n - 1)] = 0x80  # the last: continuation, final
    return bytes(wire)


# A 900 KB observation: under the 1 MiB max_frame_bytes, as 900,000 fragments (2.7 MB on the wire).
FRAGMENTED = one_byte_fragments(json.dumps({"type": "observation", "data": {
    "observation": {"q": "x" * 900_000}, "reward": 0, "done": False}}))


def read_frame(conn: socket.socket) -> bytes:
    """One (masked) client frame's payload."""
    head = recv_exact(conn, 2)
    size = head[1] & 0x7F
    if size == 126:
        size = struct.unpack("!H", recv_exact(conn, 2))[0]
    elif size == 127:
        size = struct.unpack("!Q", recv_exact(conn, 8))[0]
    mask = recv_exact(conn, 4)
    data = recv_exact(conn, size)
    return bytes(b ^ mask[i % 4] for i, b in enumerate(data))


def recv_exact(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            raise ConnectionError("the client hung up")
        data += chunk
    return data


def text_frame(text: str) -> bytes:
    payload = text.encode()
    assert len(payload) < 65536
    return (b"\x81\x7e" + struct.pack("!H", len(payload)) if len(payload) > 125
            else bytes([0x81, len(payload)])) + payload


class RawServer:
    """A loopback OpenEnv server on raw sockets; `requests[(mode, what)]` counts what it was asked."""

    def __init__(self) -> None:
        self.requests: Counter[tuple[str, str]] = Counter()
        self.sock = socket.create_server(("127.0.0.1", 0), backlog=256)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.stopped = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        self.stopped.set()
        self.sock.close()

    def _accept(self) -> None:
        while not self.stopped.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):
            head = b""
            while b"\r\n\r\n" not in head:
                chunk = conn.recv(4096)
                if not chunk:
                    return
                head += chunk
            lines = head.decode("latin-1").split("\r\n")
            mode, _, what = lines[0].split()[1].strip("/").rpartition("/")
            self.requests[(mode, what)] += 1
            headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
            if what == "ws":
                self._episode(conn, mode, headers["sec-websocket-key"])
            elif mode.startswith("drip"):
                self._drip(conn)
            else:
                body = json.dumps({"action": SCHEMA}).encode()
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
                             b"Connection: close\r\n\r\n%s" % (len(body), body))

    def _drip(self, conn: socket.socket) -> None:
        for i in range(len(HEADERS)):
            if self.stopped.wait(DRIP_S):
                return
            conn.sendall(HEADERS[i:i + 1])

    def _episode(self, conn: socket.socket, mode: str, key: str) -> None:
        accept = base64.b64encode(hashlib.sha1((key + WS_GUID).encode()).digest()).decode()
        conn.sendall(("HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                      f"Sec-WebSocket-Accept: {accept}\r\n\r\n").encode())
        read_frame(conn)  # reset
        if mode == "fragstep":
            conn.sendall(text_frame(OBS))
            read_frame(conn)  # the model's action
        if mode == "trickle":  # a message that never ends, a fragment every millisecond: cut by the timeout
            conn.sendall(b"\x01\x01{")
            while not self.stopped.wait(0.001):
                conn.sendall(b"\x00\x01 ")
        conn.sendall(FRAGMENTED)
        while conn.recv(65536):  # until the client hangs up
            pass


@pytest.fixture(scope="module")
def server() -> Any:
    s = RawServer()
    yield s
    s.close()


class Replies:
    """A ChatClient that always answers 5."""

    calls = 0

    async def chat(self, messages: list[dict[str, str]], max_tokens: int | None = None) -> str:
        self.calls += 1
        return '{"answer": 5}'


def adapter(url: str, **options: Any) -> OpenEnvEnv:
    cls = type("Bound", (OpenEnvEnv,), {"spec": url, "name": f"openenv:{url}"})
    return cls(OpenEnvOptions(**options))


def play_measured(env: OpenEnvEnv) -> tuple[Any, int, float]:
    """One episode: its outcome (or the exception it raised), the peak traced memory, and the seconds taken."""
    async def one() -> Any:
        return await env.rollout(Replies(), env.make_tasks(1, 0)[0])

    httpx.Client(trust_env=False).close()  # its first TLS context costs seconds and MBs under tracemalloc
    tracemalloc.start()
    start = time.monotonic()
    try:
        result: Any = asyncio.run(one())
    except Exception as exc:  # noqa: BLE001  (what escaped is what is checked)
        result = exc
    finally:
        elapsed = time.monotonic() - start
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return result, peak, elapsed


# ---- item 7: a message as very many one-byte fragments ----
def test_a_message_of_a_million_fragments_at_reset_is_an_infra_error_in_bounded_memory(server: RawServer) -> None:
    result, peak, elapsed = play_measured(adapter(f"{server.url}/frag", timeout_s=2))
    assert isinstance(result, InfraError), f"{type(result).__name__}: {result}"
    assert "frames" in str(result)
    assert peak < 16 << 20, f"one message cost {peak >> 20} MiB"
    assert elapsed < 10


def test_a_message_of_a_million_fragments_after_the_action_is_the_models_failure(server: RawServer) -> None:
    result, peak, elapsed = play_measured(adapter(f"{server.url}/fragstep", timeout_s=2))
    assert not isinstance(result, BaseException), f"{type(result).__name__}: {result}"
    assert result.reward == 0.0 and result.parts["valid"] == 0.0
    assert result.info["reason"].startswith("env_failed_after_action:") and "frames" in result.info["reason"]
    assert peak < 16 << 20, f"one message cost {peak >> 20} MiB"
    assert elapsed < 10


def test_a_message_cut_by_the_timeout_mid_fragments_is_an_infra_error(server: RawServer) -> None:
    """websockets' assembler once raised AssertionError when a timeout cancelled it between fragments."""
    for _ in range(3):
        result, _, elapsed = play_measured(adapter(f"{server.url}/trickle", timeout_s=0.3))
        assert isinstance(result, InfraError), f"{type(result).__name__}: {result}"
        assert elapsed < 10


# ---- item 6: /schema's headers dripped, many attempts in flight ----
async def attempts_beside_the_shared_executor(env: OpenEnvEnv, n: int) -> tuple[list[Any], float, float]:
    """`n` attempts at once, and beside them one `to_thread` call after another (what store writes and
    other environments' grading do): the attempts' results, the slowest to_thread call, the seconds taken."""
    start = time.monotonic()
    attempts = [asyncio.create_task(env.rollout(Replies(), t)) for t in env.make_tasks(n, 0)]
    slowest = 0.0
    while not all(a.done() for a in attempts) and time.monotonic() - start < 15:
        asked = time.monotonic()
        probe = asyncio.ensure_future(asyncio.to_thread(time.monotonic))
        if not (await asyncio.wait({probe}, timeout=5))[0]:
            probe.cancel()
            slowest = math.inf  # held behind the fetch (the attempts are then cancelled)
            break
        slowest = max(slowest, time.monotonic() - asked)
        await asyncio.wait(attempts, timeout=0.05)  # the next probe once one ends or 50 ms passed
    for a in attempts:
        a.cancel()
    results = await asyncio.gather(*attempts, return_exceptions=True)
    return results, slowest, time.monotonic() - start


def run_loop(coro: Any) -> Any:
    """asyncio.run without waiting for the loop's executor at the end (before the fix, its threads were
    each held by a dripping fetch: the test would wait minutes instead of failing)."""
    loop, executor = asyncio.new_event_loop(), ThreadPoolExecutor(max_workers=6)  # 6: asyncio's on 2 cores
    loop.set_default_executor(executor)
    try:
        return loop.run_until_complete(coro)
    finally:
        executor.shutdown(wait=False, cancel_futures=True)
        loop.close()


def test_a_dripping_schema_holds_neither_the_shared_executor_nor_every_attempt(server: RawServer) -> None:
    env = adapter(f"{server.url}/drip", timeout_s=1, max_sessions=64)
    results, slowest, elapsed = run_loop(attempts_beside_the_shared_executor(env, 64))
    assert slowest < 0.5, f"a to_thread call beside the fetch waited {slowest:.1f} s"
    assert elapsed < 5, f"the fetch with a 1 s deadline held the attempts {elapsed:.1f} s"
    assert all(isinstance(r, InfraError) and "schema" in str(r) for r in results), {repr(r)[:200] for r in results}
    assert server.requests[("drip", "schema")] == 1

    results, slowest, elapsed = run_loop(attempts_beside_the_shared_executor(env, 8))  # remembered
    assert all(isinstance(r, InfraError) and "schema" in str(r) for r in results)
    assert elapsed < 1 and server.requests[("drip", "schema")] == 1


def test_a_failed_schema_is_fetched_again_once_its_memory_expires(server: RawServer,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(openenv_env, "RETRY_PREPARE_S", 0.2)
    env = adapter(f"{server.url}/drip2", timeout_s=0.3)
    run_loop(attempts_beside_the_shared_executor(env, 4))
    assert server.requests[("drip2", "schema")] == 1

    def asked_again() -> bool:
        run_loop(attempts_beside_the_shared_executor(env, 1))
        return server.requests[("drip2", "schema")] == 2

    wait_for(asked_again, 30, "a second GET /schema once the failure is 0.2 s old")


def test_check_of_a_dripping_server_ends_within_its_deadline(server: RawServer) -> None:
    """`check` (before a run starts) asks /health and /schema the same way: cut at `timeout_s`, not at the drip's end."""
    start = time.monotonic()
    with pytest.raises(ValueError, match="health") as refused:
        type(adapter(f"{server.url}/drip3")).check(OpenEnvOptions(timeout_s=0.5))
    elapsed = time.monotonic() - start
    assert elapsed < 5, f"check took {elapsed:.1f} s against a 0.5 s deadline"
    assert "deadline" in str(refused.value)
