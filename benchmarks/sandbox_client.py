"""One HTTP client for every system that benchmarks/sandbox.py compares.

burstrl's sandboxd (on the host, or inside a namespace / oci+runc / oci+runsc sandbox) and SWE-ReX's
server are driven by this same code: a keep-alive HTTP/1.1 connection from the standard library's
`http.client`, to a unix socket or to TCP (TCP_NODELAY), one JSON POST per command. It is not
burstrl's `SandboxClient` (no socket-owner / SO_PEERCRED checks, no request ids, no retries), so
neither side gets a client written for it: each request is the same few lines of `http.client`,
and the only thing that differs between systems is the path, the auth header and the JSON body.
"""

from __future__ import annotations

import http.client
import json
import socket
import time
from typing import Any


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float):
        super().__init__("localhost", timeout=timeout)
        self.path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(self.timeout)
            sock.connect(self.path)
        except BaseException:
            sock.close()
            raise
        self.sock = sock


class _TcpConnection(http.client.HTTPConnection):
    def connect(self) -> None:
        super().connect()
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class BenchClient:
    """POST JSON, read JSON, over one kept-alive connection (`unix=PATH` or `tcp=(host, port)`)."""

    def __init__(self, unix: str | None = None, tcp: tuple[str, int] | None = None,
                 headers: dict[str, str] | None = None, timeout: float = 60.0):
        assert (unix is None) != (tcp is None), "one of unix= or tcp="
        self.unix, self.tcp, self.timeout = unix, tcp, timeout
        self.headers = {"Content-Type": "application/json", **(headers or {})}
        self.conn: http.client.HTTPConnection | None = None

    @property
    def transport(self) -> str:
        return "unix socket" if self.unix else "TCP 127.0.0.1"

    def connect(self) -> None:
        """Open the connection now (raises FileNotFoundError / ConnectionRefusedError if nobody listens)."""
        if self.unix:
            conn: http.client.HTTPConnection = _UnixConnection(self.unix, self.timeout)
        else:
            conn = _TcpConnection(self.tcp[0], self.tcp[1], timeout=self.timeout)
        conn.connect()
        self.conn = conn

    def post(self, path: str, body: dict[str, Any]) -> Any:
        if self.conn is None:
            self.connect()
        data = json.dumps(body).encode()
        self.conn.request("POST", path, body=data, headers=self.headers)
        resp = self.conn.getresponse()
        raw = resp.read()
        if resp.status != 200:
            raise RuntimeError(f"{path}: HTTP {resp.status}: {raw[:300]!r}")
        if resp.will_close:
            self.close()
        return json.loads(raw)

    def connect_waiting(self, alive, deadline_s: float = 60.0, poll_s: float = 0.002) -> None:
        """Connect as soon as the server listens: retry every `poll_s` while `alive()` holds."""
        t0 = time.perf_counter()
        while True:
            try:
                self.connect()
                return
            except (FileNotFoundError, ConnectionRefusedError):
                if not alive() or time.perf_counter() - t0 > deadline_s:
                    raise RuntimeError("server did not come up") from None
                time.sleep(poll_s)

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None

    def __enter__(self):  # noqa: ANN204
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# The one command every system runs: exec /usr/bin/true directly (argv, no shell), like the bare
# `subprocess.run(["true"])` floor.
def burstrl_exec_true(c: BenchClient) -> None:
    out = c.post("/exec", {"cmd": ["true"]})
    assert out["exit_code"] == 0, out


def burstrl_client(socket_path: str, token: str) -> BenchClient:
    return BenchClient(unix=socket_path, headers={"X-Sandbox-Token": token})
