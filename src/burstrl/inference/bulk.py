"""The replica's bulk listener: adapter shards at socket speed, on a port of their own.

Why not the main HTTP server: uvicorn hands a request body to the app in small ASGI messages
through the event loop, ~310 MB/s for a shard with hashing (docs/benchmarks.md), and the bytes
compete with generation for that loop. Here each connection gets a plain thread that reads the
body with `readinto` into one preallocated buffer, 1 MiB at a time, hashing each chunk as it
arrives (sha256 and socket reads release the GIL), and stages it in the registry: no per-chunk
Python objects, no JSON, no event loop.

The protocol is the same HTTP/1.1 request as the main server's shard route (keep-alive, so a
sender reuses one connection): `PUT /v1/adapters/{name}/shards/{i}?of={n}` with the admin bearer
token, `Content-Length` and optionally `X-Shard-SHA256`; answers are JSON, errors in OpenAI's shape.
Senders find the port with `GET /v1/adapters/bulk` on the main server. With TLS configured the
listener serves TLS with the same certificate. Everything else (the manifest, the commit) stays on
the main server.

Faults a hostile or broken sender can cause are bounded: the token is checked and the shard
refused (bad name, index, size, staging full) before any body byte is read; a body shorter than
its length, or one that stalls for `idle_timeout_s`, is dropped with the connection; at most
`max_connections` connections are served at once (more are closed at once, and counted).
"""

from __future__ import annotations

import hashlib
import json
import re
import socket
import socketserver
import ssl
import threading
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from burstrl.inference.adapters import AdapterRegistry
from burstrl.protocol.adapters import UploadError
from burstrl.protocol.http import bearer_matches

CHUNK = 1 << 20
SHARD_PATH = re.compile(r"/v1/adapters/([^/]+)/shards/([0-9]{1,6})")


@dataclass
class BulkCounters:
    """What the listener refused or dropped (a replica exports them as metrics)."""

    shards: int = 0
    refused: int = 0
    truncated: int = 0
    over_capacity: int = 0


class BulkReceiver:
    """A threaded listener taking adapter shards into `registry`; `close()` stops it (the owner's job)."""

    def __init__(self, registry: AdapterRegistry, token: str, host: str = "127.0.0.1", port: int = 0,
                 max_shard_bytes: int = 2 << 30, ssl_context: ssl.SSLContext | None = None,
                 max_connections: int = 32, idle_timeout_s: float = 60.0,
                 on_refused: Callable[[], None] | None = None) -> None:
        self.registry, self.token, self.max_shard_bytes = registry, token, max_shard_bytes
        self.idle_timeout_s = idle_timeout_s
        self.on_refused = on_refused or (lambda: None)
        self.counters = BulkCounters()
        self.tls = ssl_context is not None
        self._server = _BulkServer((host, port), _BulkShardHandler, self, max_connections)
        if ssl_context is not None:  # handshake in the connection's thread, never in accept()
            self._server.socket = ssl_context.wrap_socket(self._server.socket, server_side=True,
                                                          do_handshake_on_connect=False)
        self.port: int = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="bulk-listener", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop accepting and close the socket; connections in flight end with their request."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()

    def refused(self) -> None:
        self.counters.refused += 1
        self.on_refused()


class _BulkServer(ThreadingHTTPServer):
    daemon_threads = True  # a stalled connection ends at idle_timeout_s; none outlives the process
    block_on_close = False

    def __init__(self, addr: tuple[str, int], handler: type, owner: BulkReceiver, max_connections: int) -> None:
        self.owner = owner
        self.slots = threading.BoundedSemaphore(max_connections)
        if ":" in addr[0]:
            self.address_family = socket.AF_INET6
        super().__init__(addr, handler)

    def server_bind(self) -> None:
        """Bind without HTTPServer's `getfqdn` (a reverse DNS lookup that can hang where DNS is slow)."""
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = str(self.server_address[0]), int(self.server_address[1])

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self.slots.acquire(blocking=False):
            self.owner.counters.over_capacity += 1
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A connection that broke mid-request (reset, TLS garbage) is the sender's problem; no traceback."""


class _BulkShardHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _BulkServer

    def setup(self) -> None:
        self.timeout = self.server.owner.idle_timeout_s  # StreamRequestHandler sets it on the socket
        super().setup()

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the stdlib's signature
        pass

    def do_PUT(self) -> None:  # noqa: N802 - the stdlib's naming
        owner = self.server.owner
        try:
            name, index, of, size = self._check(owner)
        except _BulkRefusal as exc:
            owner.refused()
            self.close_connection = True  # the body (if any) is left unread
            self._answer(exc.status, {"error": {"message": exc.message, "type": exc.kind, "param": None,
                                                "code": exc.status}})
            return
        data = owner.registry.take_buffer(size)
        digest = self._read_body(data)
        if digest is None:
            owner.registry.give_back(data)
            owner.counters.truncated += 1
            owner.refused()
            self.close_connection = True
            return
        try:
            owner.registry.put_shard(name, index, of, data, self.headers.get("x-shard-sha256"), digest=digest)
        except UploadError as exc:
            owner.registry.give_back(data)
            owner.refused()
            self._answer(400, {"error": {"message": str(exc), "type": "invalid_request_error",
                                         "param": None, "code": 400}})
            return
        owner.counters.shards += 1
        self._answer(200, {"name": name, "shard": index, "of": of, "bytes": size})

    def do_GET(self) -> None:  # noqa: N802
        self._not_allowed()

    do_POST = do_DELETE = do_HEAD = do_PATCH = do_GET  # noqa: N815

    def _not_allowed(self) -> None:
        self.server.owner.refused()
        self.close_connection = True
        self._answer(405, {"error": {"message": "the bulk listener takes PUT .../shards/{i} only",
                                     "type": "invalid_request_error", "param": None, "code": 405}})

    def _check(self, owner: BulkReceiver) -> tuple[str, int, int, int]:
        """The shard's name, index, count and size, or a `_BulkRefusal`; no body byte read yet."""
        if not bearer_matches(self.headers, owner.token):
            raise _BulkRefusal(401, "bulk listener: missing or wrong bearer token", "authentication_error")
        url = urlsplit(self.path)
        m = SHARD_PATH.fullmatch(url.path)
        of = parse_qs(url.query).get("of", [""])[0]
        if m is None or not of.isdigit() or len(of) > 6:
            raise _BulkRefusal(404, "expected PUT /v1/adapters/{name}/shards/{i}?of={n}")
        if self.headers.get("transfer-encoding") is not None:
            raise _BulkRefusal(411, "a shard needs Content-Length (no Transfer-Encoding)")
        length = self.headers.get("content-length", "")
        if not length.isdigit():
            raise _BulkRefusal(411, "a shard needs Content-Length")
        size = int(length)
        if size > owner.max_shard_bytes:
            raise _BulkRefusal(413, f"shard of {size} bytes exceeds {owner.max_shard_bytes}")
        name, index = m.group(1), int(m.group(2))
        try:
            owner.registry.check_shard(name, index, int(of), size)
        except UploadError as exc:
            raise _BulkRefusal(400, str(exc)) from None
        return name, index, int(of), size

    def _read_body(self, data: bytearray) -> str | None:
        """Read the body into `data` (its exact size), hashing chunk by chunk: its sha256, None if it ended early."""
        hasher, view, got, size = hashlib.sha256(), memoryview(data), 0, len(data)
        try:
            while got < size:
                n = self.rfile.readinto(view[got:min(size, got + CHUNK)])
                if not n:
                    return None
                hasher.update(view[got:got + n])
                got += n
        except (OSError, ValueError):  # reset, timeout (socket.timeout is an OSError), TLS error
            return None
        return hasher.hexdigest()

    def _answer(self, status: int, body: dict[str, Any]) -> None:
        raw = json.dumps(body).encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            if self.close_connection:
                self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(raw)
        except (OSError, ValueError):
            self.close_connection = True


class _BulkRefusal(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind


def tls_context(certfile: str, keyfile: str) -> ssl.SSLContext | None:
    """The server-side TLS context of the main server's certificate, or None without one."""
    if not certfile:
        return None
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(certfile, keyfile or None)
    return ctx

