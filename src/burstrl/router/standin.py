"""A stand-in replica: a small stdlib HTTP server that answers the router like a replica, or as a
broken or hostile one would, on cue.

Why in the package and not only in the tests: the router's regression tests, its hostile-replica
fuzzer and `benchmarks/router_hostile.py` all need a peer that can answer a scrape with any shape,
size or speed (a session of 10**400 tokens, JSON nested 100k deep, a body dripped a byte a second,
200 MB), which no real replica does on purpose. It holds no model: a generation call gets a one-word
completion (an SSE stream when asked). It serves in threads, so a dripping answer holds only its own
connection, as a real server's would.

Set `scrape` (both scrape answers), `loads`, `models` or `call` to an `Answer` to change what it sends;
None is the sane answer. `counts` tells how many scrapes and calls arrived.
"""

from __future__ import annotations

import json
import socket
import threading
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

Body = bytes | Callable[[], Iterable[bytes]]


@dataclass
class Answer:
    """One answer: status, body (bytes, or a function giving its chunks, for huge ones), content type,
    and its pace: bytes bodies are cut into `chunk_bytes` pieces with `pause_s` between chunks (sent
    chunked, with no length). `head_pause_s` drips the status line and headers a byte at a time with that
    pause (each read a client makes gets a byte: a per-read timeout never fires). `close` drops the
    connection instead of answering."""

    status: int = 200
    body: Body = b""
    content_type: str = "application/json"
    chunk_bytes: int = 0
    pause_s: float = 0.0
    head_pause_s: float = 0.0
    close: bool = False

    def chunks(self) -> Iterable[bytes]:
        if callable(self.body):
            return self.body()
        if not self.chunk_bytes:
            return [self.body]
        return (self.body[i:i + self.chunk_bytes] for i in range(0, len(self.body), self.chunk_bytes))

    def paced(self) -> bool:
        return callable(self.body) or bool(self.chunk_bytes) or self.pause_s > 0


class StandInReplica:
    """A replica stand-in on a loopback port (`url`) until `close`."""

    def __init__(self, versions: Iterable[str] = ("base",), capacity_tokens: int = 100_000) -> None:
        self.versions = list(versions)
        self.capacity_tokens = capacity_tokens
        self.scrape: Answer | None = None  # both scrape answers, unless `loads` / `models` say otherwise
        self.loads: Answer | None = None
        self.models: Answer | None = None
        self.call: Answer | None = None
        self.sessions: set[str] = set()
        self.counts: Counter[str] = Counter()
        self.stopped = threading.Event()
        self._connections: list[socket.socket] = []
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.server.daemon_threads = True
        self.server.handle_error = lambda *args: None  # a peer that hung up is not news
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True, name=f"standin {self.url}").start()

    def sane_loads(self) -> dict[str, Any]:
        sessions = [{"session_id": s, "version": self.versions[0], "tokens": 10, "context_tokens": 10, "busy": False}
                    for s in sorted(self.sessions)]
        return {"num_running_reqs": 0, "num_waiting_reqs": 0, "num_used_tokens": 10 * len(sessions),
                "max_total_num_tokens": self.capacity_tokens, "cache_hit_rate": 0.0, "versions": self.versions,
                "sessions": sessions}

    def answer_for(self, method: str, path: str, body: dict[str, Any]) -> Answer:
        if method == "GET" and path in ("/v1/loads", "/v1/models"):
            self.counts[path[4:]] += 1
            chosen = (self.loads if path == "/v1/loads" else self.models) or self.scrape
            if chosen is not None:
                return chosen
            sane = self.sane_loads() if path == "/v1/loads" else {"object": "list",
                                                                 "data": [{"id": v} for v in self.versions]}
            return Answer(body=json.dumps(sane).encode())
        if method == "GET" and path == "/health":
            return Answer(body=b'{"status": "ok"}')
        if method == "POST" and path in ("/v1/completions", "/v1/chat/completions"):
            self.counts["calls"] += 1
            if isinstance(body.get("session_id"), str):
                self.sessions.add(body["session_id"])
            return self.call or sane_completion(bool(body.get("stream")))
        if method == "DELETE" and path.startswith("/v1/traces/"):  # a session's release, as a replica's
            sid = path[len("/v1/traces/"):]
            self.sessions.discard(sid)
            self.counts["releases"] += 1
            return Answer(body=json.dumps({"session_id": sid, "released": True}).encode())
        return Answer(status=404, body=b'{"error": {"message": "not found", "code": 404}}')

    def close(self) -> None:
        """Stop as a killed process would: the listening socket and every open connection go."""
        self.stopped.set()
        self.server.shutdown()
        self.server.server_close()
        for conn in self._connections:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def sane_completion(stream: bool) -> Answer:
    """A one-word completion, or the same as an SSE stream ending in `[DONE]`."""
    if not stream:
        return Answer(body=b'{"object": "text_completion", "choices": [{"index": 0, "text": "ok"}]}')
    events = b'data: {"choices": [{"index": 0, "text": "ok"}]}\n\ndata: [DONE]\n\n'
    return Answer(body=events, content_type="text/event-stream")


def _handler(standin: StandInReplica) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def setup(self) -> None:
            super().setup()
            standin._connections.append(self.connection)

        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:
            self.serve("GET", {})

        def do_DELETE(self) -> None:
            self.serve("DELETE", {})

        def do_POST(self) -> None:
            raw = self.rfile.read(int(self.headers.get("content-length", 0) or 0))
            try:
                body = json.loads(raw)
            except ValueError:
                body = {}
            self.serve("POST", body if isinstance(body, dict) else {})

        def serve(self, method: str, body: dict[str, Any]) -> None:
            answer = standin.answer_for(method, self.path.split("?")[0], body)
            try:
                if answer.close:
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                self.send(answer)
            except OSError:  # the router hung up (a deadline, a cap): this connection is done
                self.close_connection = True

        def send(self, answer: Answer) -> None:
            if answer.head_pause_s:
                self.drip_head(answer)
                return
            self.send_response(answer.status)
            self.send_header("content-type", answer.content_type)
            if not answer.paced():
                self.send_header("content-length", str(len(answer.body)))  # type: ignore[arg-type]
                self.end_headers()
                self.wfile.write(answer.body)  # type: ignore[arg-type]
                return
            self.send_header("transfer-encoding", "chunked")
            self.end_headers()
            for chunk in answer.chunks():
                if chunk:
                    self.wfile.write(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
                    self.wfile.flush()
                if answer.pause_s and standin.stopped.wait(answer.pause_s):
                    return
            self.wfile.write(b"0\r\n\r\n")

        def drip_head(self, answer: Answer) -> None:
            """The status line and headers a byte per `head_pause_s`, then the body (if the client waited)."""
            body = b"".join(answer.chunks())
            head = (f"HTTP/1.1 {answer.status} Dripping\r\ncontent-type: {answer.content_type}\r\n"
                    f"x-pad: {'x' * 64}\r\ncontent-length: {len(body)}\r\n\r\n").encode()
            for i in range(len(head)):
                self.wfile.write(head[i:i + 1])
                self.wfile.flush()
                if standin.stopped.wait(answer.head_pause_s):
                    return
            self.wfile.write(body)

    return Handler
