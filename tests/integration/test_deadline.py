"""`burstrl.deadline` against a real loopback server that drips, stalls or answers too much (issue 49).

Why a raw socket server: the failure is httpx's per-read timeout, which a peer defeats by sending one
byte per read; only a real socket shows whether a call ends by its deadline. Each case asserts an upper
bound on the time taken, generous for a busy machine but far below how long the peer would drip.
"""

from __future__ import annotations

import asyncio
import socket
import socketserver
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from burstrl.deadline import (
    CallFailed,
    achunks,
    afetch,
    aopen,
    chunks,
    fetch,
    open_stream,
    sync_client,
)

DRIP_S = 0.2  # a byte (or chunk) every DRIP_S: each read returns well within any read timeout
DRIP_FOR = 20  # bytes dripped at most (~4 s): far past every deadline below
DEADLINE = 0.6
SLACK = 1.5  # seconds a busy machine may add to a deadline


def _send_slowly(sock: socket.socket, data: bytes, pause: float = DRIP_S) -> None:
    for i in range(len(data)):
        sock.sendall(data[i:i + 1])
        time.sleep(pause)


class _Handler(socketserver.BaseRequestHandler):
    """Answers by the path's first part (the rest is the caller's own path): ok, big, drip-headers, drip-long,
    drip-body, stall (a chunk then nothing), steady (slow chunks)."""

    def handle(self) -> None:
        sock: socket.socket = self.request
        data = b""
        while b"\r\n\r\n" not in data:
            more = sock.recv(65536)
            if not more:
                return
            data += more
        mode = data.split(b" ", 2)[1].decode().strip("/").split("/")[0]  # /drip-body/v1/assign: drip-body
        try:
            getattr(self, "answer_" + mode.replace("-", "_"))(sock)
        except OSError:
            pass  # the client gave up: that is the point

    def answer_ok(self, sock: socket.socket) -> None:
        sock.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhello")

    def answer_big(self, sock: socket.socket) -> None:
        sock.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 1000\r\n\r\n" + b"x" * 1000)

    def answer_big_chunked(self, sock: socket.socket) -> None:
        sock.sendall(b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\n" + b"x" * 1000)

    def answer_drip_headers(self, sock: socket.socket) -> None:
        _send_slowly(sock, (b"HTTP/1.1 200 OK\r\nx-pad: " + b"a" * DRIP_FOR)[:DRIP_FOR])

    def answer_drip_long(self, sock: socket.socket) -> None:
        """Headers dripped for three times as long (for deadlines of a few seconds)."""
        _send_slowly(sock, (b"HTTP/1.1 200 OK\r\nx-pad: " + b"a" * 3 * DRIP_FOR)[:3 * DRIP_FOR])

    def answer_drip_body(self, sock: socket.socket) -> None:
        sock.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % DRIP_FOR)
        _send_slowly(sock, b"y" * DRIP_FOR)

    def answer_stall(self, sock: socket.socket) -> None:
        sock.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nfirst")
        time.sleep(DRIP_FOR * DRIP_S)

    def answer_steady(self, sock: socket.socket) -> None:
        """Ten chunks, DRIP_S apart: longer in all than the gap bound, never stalled past it."""
        sock.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\n")
        _send_slowly(sock, b"z" * 10)


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True


@pytest.fixture(scope="module")
def base() -> Iterator[str]:
    server = _Server(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- async ---------------------------------------------------------------------------------------


async def _afetch(url: str, **kwargs: object) -> tuple[float, object]:
    start = time.monotonic()
    async with httpx.AsyncClient(timeout=30) as client:
        try:
            result: object = await afetch(client, "GET", url, **kwargs)  # type: ignore[arg-type]
        except CallFailed as exc:
            result = exc
    return time.monotonic() - start, result


@pytest.mark.parametrize("path", ["/drip-headers", "/drip-body"])
def test_afetch_ends_a_drip_by_its_deadline(base: str, path: str) -> None:
    took, result = asyncio.run(_afetch(base + path, deadline=DEADLINE))
    assert isinstance(result, CallFailed) and result.timed_out, result
    assert took < DEADLINE + SLACK


def test_afetch_answers_and_caps(base: str) -> None:
    _, reply = asyncio.run(_afetch(base + "/ok", deadline=5))
    assert not isinstance(reply, CallFailed) and reply.status == 200 and reply.body == b"hello"  # type: ignore[union-attr]
    for path in ("/big", "/big-chunked"):
        _, result = asyncio.run(_afetch(base + path, deadline=5, max_bytes=100))
        assert isinstance(result, CallFailed) and result.too_large and not result.timed_out, result


def test_afetch_maps_a_refused_connection(base: str) -> None:
    _, result = asyncio.run(_afetch(f"http://127.0.0.1:{_free_port()}/", deadline=5))
    assert isinstance(result, CallFailed) and result.never_sent and "ConnectError" in result.reason


async def _astream(url: str, header_deadline: float, gap: float) -> tuple[float, bytes | CallFailed]:
    start, body = time.monotonic(), b""
    async with httpx.AsyncClient(timeout=30) as client:
        try:
            response = await aopen(client, client.build_request("GET", url), header_deadline=header_deadline)
            try:
                async for chunk in achunks(response, gap=gap):
                    body += chunk
            finally:
                await response.aclose()
        except CallFailed as exc:
            return time.monotonic() - start, exc
    return time.monotonic() - start, body


def test_astream_bounds_headers_and_gaps_not_length(base: str) -> None:
    took, result = asyncio.run(_astream(base + "/drip-headers", header_deadline=DEADLINE, gap=30))
    assert isinstance(result, CallFailed) and result.timed_out and took < DEADLINE + SLACK
    took, result = asyncio.run(_astream(base + "/stall", header_deadline=5, gap=DEADLINE))
    assert isinstance(result, CallFailed) and result.timed_out and took < DEADLINE + SLACK
    _, result = asyncio.run(_astream(base + "/steady", header_deadline=5, gap=5 * DRIP_S + 1))
    assert result == b"z" * 10  # two seconds in all, never a gap past the bound


# --- sync ----------------------------------------------------------------------------------------


def _fetch(url: str, **kwargs: object) -> tuple[float, object]:
    start = time.monotonic()
    with sync_client(timeout=30) as client:
        try:
            result: object = fetch(client, "GET", url, **kwargs)  # type: ignore[arg-type]
        except CallFailed as exc:
            result = exc
    return time.monotonic() - start, result


@pytest.mark.parametrize("path", ["/drip-headers", "/drip-body"])
def test_fetch_ends_a_drip_by_its_deadline(base: str, path: str) -> None:
    took, result = _fetch(base + path, deadline=DEADLINE)
    assert isinstance(result, CallFailed) and result.timed_out, result
    assert took < DEADLINE + SLACK


def test_fetch_answers_caps_and_maps(base: str) -> None:
    _, reply = _fetch(base + "/ok", deadline=5)
    assert not isinstance(reply, CallFailed) and reply.body == b"hello"  # type: ignore[union-attr]
    _, result = _fetch(base + "/big-chunked", deadline=5, max_bytes=100)
    assert isinstance(result, CallFailed) and result.too_large
    _, result = _fetch(f"http://127.0.0.1:{_free_port()}/", deadline=5)
    assert isinstance(result, CallFailed) and result.never_sent


def test_fetch_reuses_a_connection_under_a_new_deadline(base: str) -> None:
    """A pooled connection is bounded too: the deadline is on the socket's reads, not on its connect."""
    with sync_client(timeout=30) as client:
        assert fetch(client, "GET", base + "/ok", deadline=5).status == 200
        start = time.monotonic()
        with pytest.raises(CallFailed):
            fetch(client, "GET", base + "/drip-body", deadline=DEADLINE)
        assert time.monotonic() - start < DEADLINE + SLACK


def test_fetch_refuses_an_unbounded_client(base: str) -> None:
    with httpx.Client() as client, pytest.raises(TypeError, match="sync_client"):
        fetch(client, "GET", base + "/ok", deadline=5)


def test_sync_stream_bounds_headers_and_gaps(base: str) -> None:
    with sync_client(timeout=30) as client:
        start = time.monotonic()
        with pytest.raises(CallFailed) as failed:
            open_stream(client, client.build_request("GET", base + "/drip-headers"), header_deadline=DEADLINE)
        assert failed.value.timed_out and time.monotonic() - start < DEADLINE + SLACK
        response = open_stream(client, client.build_request("GET", base + "/stall"), header_deadline=5)
        start = time.monotonic()
        with pytest.raises(CallFailed) as failed:
            list(chunks(response, gap=DEADLINE))
        response.close()
        assert failed.value.timed_out and time.monotonic() - start < DEADLINE + SLACK
        response = open_stream(client, client.build_request("GET", base + "/steady"), header_deadline=5)
        assert b"".join(chunks(response, gap=5 * DRIP_S + 1)) == b"z" * 10
        response.close()
