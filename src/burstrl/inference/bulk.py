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
Senders find the port with `GET /v1/adapters/bulk` on the main server. With tenancy
(`server.tenant_key`) a tenant's token is accepted too, and its shards are staged under its own
namespace (`<tenant>~<name>`, `protocol.tenants`), as on the main server. With TLS configured the
listener serves TLS with the same certificate. Everything else (the manifest, the commit) stays on
the main server.

Faults a hostile or broken sender can cause are bounded, so that connections without the token
cannot keep an authenticated push out:

- Head deadline: a connection has `header_timeout_s` in all (a total, not per read) for its TLS
  handshake and its request head (request line and headers); past it, it is closed and counted
  (`slow_headers`). A kept-alive connection has as long for each next head, from its last answer.
  The listener thread checks the deadlines every 0.2 s and shuts a late socket down under the
  thread reading it (a byte dripped now and then does not extend anything).
- Pending cap: at most `max_pending` connections are reading a head at once; one more crowds out
  the oldest (closed, counted `crowded_out`), so a flood of silent connections ages out instead of
  locking out a sender, whose head arrives in a packet or two.
- Token first: it is checked as soon as the head is complete, before anything else (no `100
  Continue` before it); a refused request (401 among them) is answered and its connection closed,
  body unread. The shard itself is refused (bad name, index, size, staging full) before any body
  byte is read.
- Slots: only a request past those checks takes one of `max_connections` slots, for that request
  only (a kept-alive connection between requests holds none and is back under the head deadline);
  with all taken it is answered 503 (counted `over_capacity`; the sender retries a 5xx). A body
  shorter than its length, or one that stalls for `idle_timeout_s` in one read, is dropped with
  the connection.

So there are at most about `max_pending + max_connections` connection threads, plus the few
answering a refusal; `close()` shuts every connection down and joins its thread.
"""

from __future__ import annotations

import hashlib
import json
import re
import socket
import socketserver
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from burstrl.inference.adapters import AdapterRegistry
from burstrl.protocol.adapters import UploadError
from burstrl.protocol.http import bearer_matches
from burstrl.protocol.tenants import scoped, tenant_of

CHUNK = 1 << 20
SHARD_PATH = re.compile(r"/v1/adapters/([^/]+)/shards/([0-9]{1,6})")


@dataclass
class BulkCounters:
    """What the listener took, refused or dropped (a replica exports them as metrics)."""

    shards: int = 0
    refused: int = 0  # requests answered 4xx/5xx (401 and 503 among them)
    truncated: int = 0  # bodies cut short or stalled
    over_capacity: int = 0  # authenticated requests answered 503: `max_connections` were in flight
    slow_headers: int = 0  # connections with no complete head in `header_timeout_s` (idle kept-alive too)
    crowded_out: int = 0  # connections still reading a head, closed when `max_pending` others came


class BulkReceiver:
    """A threaded listener taking adapter shards into `registry`; `close()` stops it (the owner's job)."""

    def __init__(self, registry: AdapterRegistry, token: str, host: str = "127.0.0.1", port: int = 0,
                 max_shard_bytes: int = 2 << 30, ssl_context: ssl.SSLContext | None = None,
                 max_connections: int = 32, idle_timeout_s: float = 60.0,
                 on_refused: Callable[[], None] | None = None, header_timeout_s: float = 10.0,
                 max_pending: int = 256, tenant_key: str = "") -> None:
        self.registry, self.token, self.max_shard_bytes = registry, token, max_shard_bytes
        self.tenant_key = tenant_key  # set: tenants' tokens are accepted, for their own namespace
        self.idle_timeout_s = idle_timeout_s
        self.on_refused = on_refused or (lambda: None)
        self.counters = BulkCounters()
        self.tls = ssl_context is not None
        conns = _Connections(max_pending, header_timeout_s, self.counters)
        self._server = _BulkServer((host, port), _BulkShardHandler, self, max_connections, conns)
        if ssl_context is not None:  # handshake in the connection's thread, never in accept()
            self._server.socket = ssl_context.wrap_socket(self._server.socket, server_side=True,
                                                          do_handshake_on_connect=False)
        self.port: int = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="bulk-listener", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop accepting, shut every connection down (a shard in flight is dropped, as if the
        replica had died) and join every connection's thread, so that none outlives the owner."""
        self._server.shutdown()
        self._server.conns.drop_all()
        self._server.server_close()  # joins the connection threads (block_on_close)
        self._thread.join()

    def refused(self) -> None:
        self.counters.refused += 1
        self.on_refused()


class _Connections:
    """The listener's open connections, and the head deadline of each one still reading a head.

    Why here and not a socket timeout: a timeout is per read, so a byte every few seconds would
    hold a connection forever. The listener thread `reap`s late ones instead, by shutting the
    socket down, which wakes the connection's thread blocked in its read (TLS handshake included)."""

    def __init__(self, max_pending: int, header_timeout_s: float, counters: BulkCounters) -> None:
        self.max_pending, self.header_timeout_s, self.counters = max_pending, header_timeout_s, counters
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self._pending: dict[socket.socket, float] = {}  # the deadline; insertion order is deadline order

    def expect_head(self, sock: socket.socket) -> None:
        """Start `sock`'s head deadline (at accept, and again after each answer on a kept-alive
        connection), crowding out the oldest pending connection when `max_pending` are waiting."""
        with self._lock:
            self._open.add(sock)
            self._pending.pop(sock, None)  # re-inserted last, keeping the order of deadlines
            if len(self._pending) >= self.max_pending:
                oldest = next(iter(self._pending))
                del self._pending[oldest]
                _shut(oldest)
                self.counters.crowded_out += 1
            self._pending[sock] = time.monotonic() + self.header_timeout_s

    def head_arrived(self, sock: socket.socket) -> bool:
        """Stop `sock`'s deadline; False if it was already reaped or crowded out (then the head
        that seems complete may be cut short by the shutdown: it must not be served)."""
        with self._lock:
            return self._pending.pop(sock, None) is not None

    def reap(self) -> None:
        """Shut down the connections past their head deadline (the oldest come first)."""
        now = time.monotonic()
        with self._lock:
            while self._pending:
                sock, deadline = next(iter(self._pending.items()))
                if deadline > now:
                    break
                del self._pending[sock]
                _shut(sock)
                self.counters.slow_headers += 1

    def forget(self, sock: socket.socket) -> None:
        """`sock` is being closed: never shut it down after this (its descriptor may be reused)."""
        with self._lock:
            self._open.discard(sock)
            self._pending.pop(sock, None)

    def drop_all(self) -> None:
        """Shut every connection down, so that each thread ends at its next (or current) read or write."""
        with self._lock:
            for sock in self._open:
                _shut(sock)


def _shut(sock: socket.socket) -> None:
    """Shut `sock` down for both directions from another thread. `socket.socket.shutdown` on purpose:
    `SSLSocket.shutdown` also drops its TLS object, under the thread that may be using it."""
    try:
        socket.socket.shutdown(sock, socket.SHUT_RDWR)
    except OSError:  # already closed by the peer or reset
        pass


class _BulkServer(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = True  # server_close() joins the connection threads; close() has shut them down
    request_queue_size = 128  # not the stdlib's 5: a burst of connects must not leave a sender's SYN dropped

    def __init__(self, addr: tuple[str, int], handler: type, owner: BulkReceiver, max_connections: int,
                 conns: _Connections) -> None:
        self.owner, self.conns = owner, conns
        self.slots = threading.BoundedSemaphore(max_connections)
        if ":" in addr[0]:
            self.address_family = socket.AF_INET6
        super().__init__(addr, handler)

    def server_bind(self) -> None:
        """Bind without HTTPServer's `getfqdn` (a reverse DNS lookup that can hang where DNS is slow)."""
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = str(self.server_address[0]), int(self.server_address[1])

    def process_request(self, request: Any, client_address: Any) -> None:
        """Start the head deadline at accept, before the thread (and the TLS handshake in it)."""
        self.conns.expect_head(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request: Any) -> None:
        """Forget the connection before closing it, so no deadline shuts down a reused descriptor."""
        self.conns.forget(request)
        super().shutdown_request(request)

    def service_actions(self) -> None:
        """Called by `serve_forever` after each accept and at least every poll interval."""
        self.conns.reap()

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

    def handle(self) -> None:
        """The stdlib's loop, with a new head deadline for each request after the first (the one
        set at accept covers the first); between requests the connection holds no slot."""
        self.close_connection = True
        self.handle_one_request()
        while not self.close_connection:
            self.server.conns.expect_head(self.request)
            self.handle_one_request()

    def parse_request(self) -> bool:
        """Parse the head; a head whose deadline passed (its socket shut down) is not served."""
        if not super().parse_request():
            return False
        if not self.server.conns.head_arrived(self.request):
            self.close_connection = True
            return False
        return True

    def handle_expect_100(self) -> bool:
        """No `100 Continue` before the token is checked (`_continue` sends it after)."""
        return True

    def do_PUT(self) -> None:  # noqa: N802 - the stdlib's naming
        owner = self.server.owner
        try:
            name, shown, index, of, size = self._check(owner)
        except _BulkRefusal as exc:
            self._refuse(exc)
            return
        if not self.server.slots.acquire(blocking=False):
            owner.counters.over_capacity += 1
            self._refuse(_BulkRefusal(503, "bulk listener busy: too many shards in flight, retry", "server_error"))
            return
        try:
            self._continue()
            self._take(owner, name, shown, index, of, size)
        finally:
            self.server.slots.release()

    def _take(self, owner: BulkReceiver, name: str, shown: str, index: int, of: int, size: int) -> None:
        """Read the checked shard's body and stage it; answer (or drop the connection if it broke)."""
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
            self._answer(400, {"error": {"message": str(exc).replace(name, shown), "type": "invalid_request_error",
                                         "param": None, "code": 400}})
            return
        owner.counters.shards += 1
        self._answer(200, {"name": shown, "shard": index, "of": of, "bytes": size})

    def do_GET(self) -> None:  # noqa: N802
        """Any other method: 401 without the token (it comes first), else 405."""
        try:
            self._authenticate(self.server.owner)
        except _BulkRefusal as exc:
            self._refuse(exc)
            return
        self._refuse(_BulkRefusal(405, "the bulk listener takes PUT .../shards/{i} only"))

    do_POST = do_DELETE = do_HEAD = do_PATCH = do_GET  # noqa: N815

    def _refuse(self, exc: _BulkRefusal) -> None:
        """Answer the refusal and close the connection, its body (if any) unread."""
        self.server.owner.refused()
        self.close_connection = True
        self._answer(exc.status, {"error": {"message": exc.message, "type": exc.kind, "param": None,
                                            "code": exc.status}})

    def _authenticate(self, owner: BulkReceiver) -> str | None:
        """The token, before anything else is looked at: a `_BulkRefusal` (401) without it. Returns
        the tenant whose token it is, None for the admin token."""
        if bearer_matches(self.headers, owner.token):
            return None
        tenant = tenant_of(self.headers, owner.tenant_key)
        if tenant is None:
            raise _BulkRefusal(401, "bulk listener: missing or wrong bearer token", "authentication_error")
        return tenant

    def _continue(self) -> None:
        """The `100 Continue` a sender asked for, once its request is accepted (`handle_expect_100`)."""
        if self.request_version >= "HTTP/1.1" and self.headers.get("expect", "").lower() == "100-continue":
            self.send_response_only(100)
            self.end_headers()

    def _check(self, owner: BulkReceiver) -> tuple[str, str, int, int, int]:
        """The shard's stored and shown name, index, count and size, or a `_BulkRefusal`; no body byte read yet."""
        tenant = self._authenticate(owner)
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
        shown, index = m.group(1), int(m.group(2))
        name = scoped(tenant, shown)
        try:
            owner.registry.check_shard(name, index, int(of), size)
        except UploadError as exc:
            raise _BulkRefusal(400, str(exc).replace(name, shown)) from None
        return name, shown, index, int(of), size

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

