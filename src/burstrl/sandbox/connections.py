"""The daemon's cap on connections: at the cap, a new connection evicts the oldest idle one.

Why a module of its own: anyone inside the sandbox can open connections to the daemon, and each is
a thread counted against the sandbox's pids limit, so their number is bounded; how the cap picks
what to drop (never a request being served, so the harness is never locked out) is its own rule,
apart from parsing and serving requests (`daemon`). Standard library only: the daemon imports it
inside sandbox images.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
from collections import OrderedDict
from typing import Any

from burstrl.sandbox.protocol import error_body

MAX_CONNECTIONS = 48  # each is a thread, and threads count against the sandbox's pids limit


class ConnectionCap:
    """Connection cap for a threading server: at the cap, a new connection evicts the oldest one
    that is not serving an authenticated request; when every one is, the new one is refused.

    Why evict rather than refuse: idle or half-sent connections (anyone inside the sandbox can open
    them) must not lock out the harness, whose client reconnects and retries on a dropped one.
    """

    def init_bounds(self) -> None:
        self._conns: "OrderedDict[socket.socket, bool]" = OrderedDict()  # socket -> busy
        self._conns_lock = threading.Lock()

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._admit(request):
            _refuse(request)
            super().shutdown_request(request)  # type: ignore[misc]
            return
        super().process_request(request, client_address)  # type: ignore[misc]

    def shutdown_request(self, request: Any) -> None:
        with self._conns_lock:
            self._conns.pop(request, None)
        super().shutdown_request(request)  # type: ignore[misc]

    def set_busy(self, request: Any, busy: bool) -> None:
        with self._conns_lock:
            if request in self._conns:
                self._conns[request] = busy

    def _admit(self, request: Any) -> bool:
        with self._conns_lock:
            if len(self._conns) >= MAX_CONNECTIONS:
                victim = next((s for s, busy in self._conns.items() if not busy), None)
                if victim is None:
                    return False
                del self._conns[victim]
                with contextlib.suppress(OSError):
                    victim.shutdown(socket.SHUT_RDWR)  # its thread reads EOF and ends
            self._conns[request] = False
            return True


def _refuse(request: socket.socket) -> None:
    """Tell a refused connection why, without ever blocking on it."""
    body = json.dumps(error_body(503, f"over {MAX_CONNECTIONS} connections all serving requests")).encode()
    head = f"HTTP/1.1 503 Service Unavailable\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    with contextlib.suppress(OSError):
        request.setblocking(False)
        request.send(head.encode("latin-1") + body)
