"""Small loopback HTTP stand-ins for tests of a client against a peer's routes (a fleet's router,
a node agent): serve one on a thread for a block, answer JSON."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@contextmanager
def serving(srv: ThreadingHTTPServer) -> Iterator[str]:
    """`srv` serving on a thread until the block ends (then shut down and closed); its URL."""
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}"
    finally:
        srv.shutdown()
        thread.join()
        srv.server_close()


class JsonHandler(BaseHTTPRequestHandler):
    """A handler that answers JSON and logs nothing."""

    def send_json(self, status: int, body: Any) -> None:
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def log_message(self, *args: object) -> None:
        pass
