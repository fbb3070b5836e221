"""The sender's side of the replica's bulk listener: an HTTP/1.1 PUT written straight to the socket.

Why not httpx here: h11 turns every body chunk into a new `bytes` (a copy of the whole shard, in
allocations the size of a chunk), and httpx adds a few Python calls per chunk; for a 100 MB shard
on loopback that doubled the send time next to a raw socket. Here the body goes out with one
`sendall` of a memoryview of the packed tar (no copy), over a kept-alive connection (TLS when the
replica's URL is https, checked like the main server's). The listener speaks the same request as
the main server's shard route, so the answer is parsed as plain HTTP/1.1: a status line, headers,
a `Content-Length` body (the listener always sends one).
"""

from __future__ import annotations

import socket
import ssl
from urllib.parse import urlencode

MAX_HEAD = 64 << 10  # the listener's answers are a few hundred bytes
MAX_ANSWER = 1 << 20


class BulkConnectionError(OSError):
    """The connection broke or the answer was not HTTP/1.1 as the listener writes it."""


class BulkConnection:
    """One kept-alive connection to a replica's bulk listener; reconnects after a failure."""

    def __init__(self, host: str, port: int, token: str, tls: bool, verify: bool | str = True,
                 timeout_s: float = 120.0, connect_timeout_s: float = 5.0) -> None:
        self.host, self.port, self.token, self.tls = host, port, token, tls
        self.verify, self.timeout_s, self.connect_timeout_s = verify, timeout_s, connect_timeout_s
        self._sock: socket.socket | None = None
        self._reader = None

    def put(self, path: str, params: dict[str, object], body: bytes | memoryview,
            headers: dict[str, str]) -> tuple[int, bytes]:
        """PUT `body` to `path?params`; (status, answer body). OSError (connection refused among
        them) when the request could not be sent or answered; the connection is then closed."""
        try:
            sock = self.connect()
            head = [f"PUT {path}?{urlencode(params)} HTTP/1.1", f"Host: {self.host}:{self.port}",
                    f"Authorization: Bearer {self.token}", f"Content-Length: {len(body)}",
                    *(f"{k}: {v}" for k, v in headers.items()), "", ""]
            sock.sendall("\r\n".join(head).encode("latin-1"))
            sock.sendall(memoryview(body))
            return self._answer()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
        self._sock = self._reader = None

    def connect(self) -> socket.socket:
        """The open connection, made (and TLS-wrapped) if there is none."""
        if self._sock is None:
            sock = socket.create_connection((self.host, self.port), timeout=self.connect_timeout_s)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.tls:
                sock = _tls_context(self.verify).wrap_socket(sock, server_hostname=self.host)
            sock.settimeout(self.timeout_s)
            self._sock, self._reader = sock, sock.makefile("rb")
        return self._sock

    def _answer(self) -> tuple[int, bytes]:
        reader = self._reader
        status_line = reader.readline(MAX_HEAD)
        parts = status_line.split(None, 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
            raise BulkConnectionError(f"not an HTTP/1.1 answer: {status_line[:100]!r}")
        length, close, seen = 0, False, len(status_line)
        while True:
            line = reader.readline(MAX_HEAD)
            seen += len(line)
            if not line or seen > MAX_HEAD:
                raise BulkConnectionError("answer headers cut short or too long")
            if line in (b"\r\n", b"\n"):
                break
            key, _, value = line.decode("latin-1").partition(":")
            key, value = key.strip().lower(), value.strip()
            if key == "content-length" and value.isdigit():
                length = int(value)
            elif key == "connection" and value.lower() == "close":
                close = True
        if length > MAX_ANSWER:
            raise BulkConnectionError(f"answer of {length} bytes")
        body = reader.read(length)
        if len(body) != length:
            raise BulkConnectionError("answer body cut short")
        if close:
            self.close()
        return int(parts[1]), body


def _tls_context(verify: bool | str) -> ssl.SSLContext:
    if isinstance(verify, str):
        return ssl.create_default_context(cafile=verify)
    ctx = ssl.create_default_context()
    if not verify:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    return ctx
