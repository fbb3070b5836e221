"""A TCP port on the node forwarded to one sandbox daemon's unix socket (the node agent's).

Why: a harness on another machine must reach each sandbox's daemon directly (no central process
in a rollout's path), and the daemon listens only on a unix socket of the node. Every accepted
connection is checked on the unix side as `SandboxClient` checks it (the listener's pid and uid,
`client.connect_unix`), so a socket swapped in by sandboxed code never receives the token. The
token itself still travels in `X-Sandbox-Token` in the clear: keep the node's network private.
"""

from __future__ import annotations

import contextlib
import socket
import threading

from burstrl.sandbox.client import connect_unix


class Forwarder:
    """Listens on (host, any free port); pipes each connection to the daemon's socket, both ways."""

    def __init__(self, host: str, socket_path: str, expected_pid: int | None, expected_uid: int | None) -> None:
        self.socket_path, self.expected = socket_path, (expected_pid, expected_uid)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.listener = socket.socket(family, socket.SOCK_STREAM)
        self.listener.bind((host, 0))
        self.listener.listen(64)
        h, p = self.listener.getsockname()[:2]
        self.url = f"http://{h if ':' not in h else f'[{h}]'}:{p}"
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = False
        self.refused = 0  # connections whose unix side failed its checks or was gone
        threading.Thread(target=self._accept, name=f"forward-{p}", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:  # the listener was closed: the sandbox is gone
                return
            threading.Thread(target=self._open, args=(conn,), daemon=True).start()

    def _open(self, conn: socket.socket) -> None:
        try:
            upstream = connect_unix(self.socket_path, 10.0, *self.expected)
        except Exception:  # a dead daemon or an untrusted socket: drop the TCP side, counted
            self.refused += 1
            conn.close()
            return
        upstream.settimeout(None)
        with self._lock:
            if self._closed:
                conn.close()
                upstream.close()
                return
            self._conns.update((conn, upstream))
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        threading.Thread(target=self._pump, args=(upstream, conn), daemon=True).start()
        self._pump(conn, upstream)

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        """Copy until either side ends; then end both (a half-open pair would leak the threads)."""
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:  # a reset on either side ends the pair, as EOF does
            pass
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
        with self._lock:
            for s in (src, dst):
                if s in self._conns:
                    self._conns.discard(s)
                    s.close()

    def close(self) -> None:
        """Stop listening and cut every open connection."""
        with self._lock:
            self._closed = True
            conns, self._conns = list(self._conns), set()
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)
        self.listener.close()
        for s in conns:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()
