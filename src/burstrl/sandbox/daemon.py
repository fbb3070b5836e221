"""sandboxd: the command daemon inside every sandbox (`python3 -m burstrl.sandbox.daemon`).

Endpoints (JSON in and out, types in `protocol`): GET /health, POST /exec, POST /read_file,
POST /write_file, POST /upload (raw tar body, `?dest=DIR`), POST /close (answers, then the daemon
kills the commands still running and exits 0). Every request needs `X-Sandbox-Token`; the token
comes from `--token-file` or the env var SANDBOX_TOKEN (never argv, which any process can read).

Why a small HTTP/1.1 server of its own on `socketserver` rather than `http.server`: the daemon's
start is most of a sandbox's start, and `http.server` drags in the email package; this parser
needs only what the clients send (Content-Length bodies, keep-alive). Standard library only.

Listens on a unix socket (created 0600), on one handed over already listening (`--listen-fd`,
so the socket's path need not exist inside the sandbox at all), or on TCP (`--host/--port`, port
0 = any free port). When listening it prints one JSON line to stdout,
`{"event": "ready", "socket"|"fd"|"url", "pid"}`. SIGTERM and SIGINT stop it cleanly (exit 0,
socket file removed), except when it is pid 1 (see `guard_signals`).

Base environment: `--env-file FILE` (a JSON object of strings) or the env var SANDBOXD_ENV (the same
JSON, removed from this process's env) is given to every command, under the request's `env`; that
is how every backend passes `SandboxSpec.env` and an image's `Env`. With `--inherit-env` the
daemon's own environment (read after SANDBOX_TOKEN and SANDBOXD_ENV are removed from it) is the
base, under the JSON: for local use only, since a runtime may add to a daemon's env (no backend
uses it: a command's env is built from nothing, issue 49).

Fds: every fd the daemon holds above 2 is marked close-on-exec at start and before each spawn
(`guard.no_inherited_fds`), so a command gets only the fds its spawn names, never the listening
socket handed over with `--listen-fd`.

Holding against its own commands: at most `connections.MAX_CONNECTIONS` connections, a new one
evicting the oldest connection that is not serving an authenticated request (so idle or half-sent
connections can never lock the harness out), read timeouts, and the daemon makes itself
non-dumpable so its commands (same uid) cannot ptrace it or take its fds. When it is pid 1 of its
pid namespace it reaps orphans, raises back to 1000 the oom_score_adj of any command that lowered
its own, and no signal from inside (`kill -9 -1`) reaches it (`guard`). With `--cgroup-fd N` (the
commands' cgroup.procs, opened by the harness) every command moves itself into the commands' own
memory cgroup first, so an OOM there cannot pick the daemon whatever the commands' scores (`guard`).
With `--commands-ns UID:GID` (gVisor, whose sentry shows every process pid 1's /proc files) the
daemon, started as root, puts its commands in a pid namespace of their own and becomes UID:GID,
installing `--seccomp-file` on itself (`cmdns`).
"""

from __future__ import annotations

import sys

from burstrl.sandbox import cmdns as _cmdns

# Under gVisor (--commands-ns) the commands' spawner is forked here, before the imports below: a
# smaller process forks faster, and the spawner makes the namespace while the daemon imports.
EARLY_NS = _cmdns.fork_early(sys.argv) if __name__ == "__main__" else None

import argparse
import contextlib
import hmac
import json
import os
import signal
import socket
import socketserver
import threading
import time
import traceback
from typing import Any, Dict, List, Optional, Tuple
from urllib.parse import parse_qs, urlsplit

import burstrl
from burstrl.sandbox.cmdns import CommandNamespace, drop_ids, install_seccomp, read_bytes
from burstrl.sandbox.connections import ConnectionCap
from burstrl.sandbox.guard import guard_signals, hold_fd_dir, no_inherited_fds, protect_self, reap_forever
from burstrl.sandbox.protocol import (
    ENDPOINTS,
    MAX_BODY,
    MAX_UPLOAD_BODY,
    CloseResult,
    Health,
    ProtocolError,
    UploadRequest,
    error_body,
    from_json,
    to_json,
)
from burstrl.sandbox.runtime import Runtime

MAX_HEADER_BYTES = 64 * 1024
TOKEN_HEADER = "x-sandbox-token"
DRAIN_LIMIT = 1 << 20  # a refused request's body up to this size is read and dropped, not left unread
REASONS = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 403: "Forbidden", 404: "Not Found",
           405: "Method Not Allowed", 410: "Gone", 411: "Length Required", 413: "Payload Too Large",
           431: "Request Header Fields Too Large", 500: "Internal Server Error", 503: "Service Unavailable"}
IDLE_TIMEOUT_S = 300.0  # a connection waiting for its next request (a client reconnects on a drop)
READ_TIMEOUT_S = 30.0  # each read of the rest of a request once its first line came
ENV_VAR = "SANDBOXD_ENV"
WRITE_SLICE = 1 << 20  # a response body is written this many bytes at a time (smaller: with its head)


class _Request:
    def __init__(self, method: str, target: str, headers: Dict[str, str], keep_alive: bool):
        parts = urlsplit(target)
        self.method = method
        self.path = parts.path
        self.query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
        self.headers = headers
        self.keep_alive = keep_alive


class Daemon:
    """The endpoints over a `Runtime`; `handle` maps one authenticated request to (status, JSON)."""

    def __init__(self, runtime: Runtime, token: str):
        self.runtime = runtime
        self._token = token.encode("utf-8")
        self.started = time.monotonic()
        self.server: Optional[socketserver.BaseServer] = None

    def authorized(self, headers: Dict[str, str]) -> bool:
        given = headers.get(TOKEN_HEADER, "").encode("utf-8", "replace")
        return hmac.compare_digest(given, self._token)

    def handle(self, req: _Request, body: bytes) -> Dict[str, Any]:
        if req.path == "/health":
            return to_json(Health(status="ok", pid=os.getpid(), uptime_s=time.monotonic() - self.started,
                                  version=burstrl.__version__))
        if req.path == "/close":
            return to_json(CloseResult())
        if req.path == "/upload":
            if set(req.query) - {"dest"}:
                raise ProtocolError(400, f"unknown query parameter '{sorted(set(req.query) - {'dest'})[0]}'")
            upload = from_json(UploadRequest, dict(req.query))
            upload.archive = body
            return to_json(self.runtime.upload(upload))
        request_type = ENDPOINTS[req.path][0]
        try:
            data = json.loads(body) if body else None
        except ValueError as exc:
            raise ProtocolError(400, f"body is not valid JSON: {exc}") from None
        call = {"/exec": self.runtime.exec, "/read_file": self.runtime.read_file,
                "/write_file": self.runtime.write_file}[req.path]
        return to_json(call(from_json(request_type, data)))

    def stop_soon(self) -> None:
        """Stop serving from any thread but the serving one (`shutdown` waits for the loop)."""
        if self.server is not None:
            threading.Thread(target=self.server.shutdown, daemon=True).start()


class _Handler(socketserver.StreamRequestHandler):
    """One connection: requests served in order while the client keeps it alive."""

    server: Any

    def setup(self) -> None:
        if self.request.family != socket.AF_UNIX:
            self.request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        super().setup()

    def handle(self) -> None:
        daemon: Daemon = self.server.daemon_app
        while True:
            self.server.set_busy(self.request, False)  # evictable until its request is authenticated
            try:
                req = self._read_head()
            except ProtocolError as exc:
                self._send(exc.status, exc.to_body(), keep_alive=False)
                return
            except OSError:  # a read timeout, or evicted for a newer connection
                return
            if req is None:
                return
            try:
                status, body, keep = self._serve(daemon, req)
            except OSError:
                return
            self._send(status, body, keep)
            if req.path == "/close" and status == 200:
                daemon.stop_soon()
                return
            if not keep:
                return

    def _serve(self, daemon: Daemon, req: _Request) -> Tuple[int, Dict[str, Any], bool]:
        """(status, JSON body, keep the connection). An unread body forces the connection closed."""
        has_body = req.headers.get("content-length", "0") != "0" or "transfer-encoding" in req.headers
        try:
            _check_route(req, daemon)
            self.server.set_busy(self.request, True)
            body = self._read_body(req)
        except ProtocolError as exc:
            if has_body and self._drain(req):  # the connection stays in step, and closing it will not reset
                return exc.status, exc.to_body(), req.keep_alive
            return exc.status, exc.to_body(), req.keep_alive and not has_body
        if body is None:
            return 400, error_body(400, "connection closed before the body was complete"), False
        try:
            return 200, daemon.handle(req, body), req.keep_alive
        except ProtocolError as exc:
            return exc.status, exc.to_body(), req.keep_alive
        except Exception as exc:  # a bug, not bad input: answer 500, keep serving, log the traceback
            traceback.print_exc(file=sys.stderr)
            return 500, error_body(500, f"{type(exc).__name__}: {exc}"), False

    def _read_head(self) -> Optional[_Request]:
        self.request.settimeout(IDLE_TIMEOUT_S)
        line = self.rfile.readline(MAX_HEADER_BYTES + 1)
        if not line:
            return None
        self.request.settimeout(READ_TIMEOUT_S)
        if len(line) > MAX_HEADER_BYTES:
            raise ProtocolError(431, "request line too long")
        words = line.decode("latin-1").split()
        if len(words) != 3 or not words[2].startswith("HTTP/1."):
            raise ProtocolError(400, "malformed request line")
        headers: Dict[str, str] = {}
        total = len(line)
        while True:
            line = self.rfile.readline(MAX_HEADER_BYTES + 1)
            total += len(line)
            if total > MAX_HEADER_BYTES:
                raise ProtocolError(431, "request headers too large")
            if line in (b"\r\n", b"\n", b""):
                break
            name, sep, value = line.decode("latin-1").partition(":")
            if not sep:
                raise ProtocolError(400, "malformed header line")
            headers[name.strip().lower()] = value.strip()
        connection = headers.get("connection", "").lower()
        keep = connection != "close" if words[2] == "HTTP/1.1" else connection == "keep-alive"
        return _Request(words[0], words[1], headers, keep)

    def _drain(self, req: _Request) -> bool:
        """Read and drop a refused request's small body.

        Why: closing a socket with unread bytes in its receive buffer sends a TCP/unix reset, and the
        client may then lose the error answer (a 401 became "unreachable" under load). Bodies over
        DRAIN_LIMIT are not read: the connection is closed instead.
        """
        try:
            length = int(req.headers.get("content-length", "0"))
        except ValueError:
            return False
        if "transfer-encoding" in req.headers or not 0 < length <= DRAIN_LIMIT:
            return False
        return len(self.rfile.read(length)) == length

    def _read_body(self, req: _Request) -> Optional[bytes]:
        if "transfer-encoding" in req.headers:
            raise ProtocolError(411, "chunked bodies are not supported: send Content-Length")
        try:
            length = int(req.headers.get("content-length", "0"))
        except ValueError:
            raise ProtocolError(400, "bad Content-Length") from None
        cap = MAX_UPLOAD_BODY if req.path == "/upload" else MAX_BODY
        if length < 0:
            raise ProtocolError(400, "bad Content-Length")
        if length > cap:
            raise ProtocolError(413, f"body of {length} bytes is over the {cap}-byte limit of {req.path}")
        body = self.rfile.read(length)
        return body if len(body) == length else None

    def _send(self, status: int, body: Dict[str, Any], keep_alive: bool) -> None:
        """One response. `json.dumps` escapes to ASCII, so its length is the Content-Length and a
        large body goes out a slice at a time: an exec's output (up to 2 x MAX_OUTPUT_BYTES on the
        wire) is then held once as JSON, not again as bytes and again joined to the head."""
        data = json.dumps(body)
        head = (f"HTTP/1.1 {status} {REASONS.get(status, 'Error')}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(data)}\r\n" + ("" if keep_alive else "Connection: close\r\n") + "\r\n")
        try:
            if len(data) <= WRITE_SLICE:  # one write, one packet
                self.wfile.write((head + data).encode("ascii"))
                return
            self.wfile.write(head.encode("ascii"))
            for i in range(0, len(data), WRITE_SLICE):
                self.wfile.write(data[i:i + WRITE_SLICE].encode("ascii"))
        except OSError:  # the client went away; nothing to tell it
            pass


def _check_route(req: _Request, daemon: Daemon) -> None:
    """401 before anything else (nothing is revealed without the token), then 404, then 405."""
    if not daemon.authorized(req.headers):
        raise ProtocolError(401, f"missing or wrong {TOKEN_HEADER} header")
    if req.path not in ENDPOINTS:
        raise ProtocolError(404, f"no endpoint {req.path}")
    want = "GET" if req.path == "/health" else "POST"
    if req.method != want:
        raise ProtocolError(405, f"{req.path} takes {want}, not {req.method}")


class _UnixServer(ConnectionCap, socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True
    block_on_close = False
    request_queue_size = 128


class _TCPServer(ConnectionCap, socketserver.ThreadingMixIn, socketserver.TCPServer):
    daemon_threads = True
    block_on_close = False
    allow_reuse_address = True
    request_queue_size = 128


def make_server(daemon: Daemon, socket_path: Optional[str] = None, host: str = "127.0.0.1",
                port: Optional[int] = None, listen_fd: Optional[int] = None) -> socketserver.BaseServer:
    """Bind (unix socket, mode 0600, or TCP) and listen, or serve a listening unix socket handed
    over as `listen_fd`; the caller runs `serve_forever`."""
    if listen_fd is not None:
        server = _UnixServer(None, _Handler, bind_and_activate=False)  # type: ignore[arg-type]
        server.socket.close()
        server.socket = socket.socket(fileno=listen_fd)
    elif socket_path is not None:
        if os.path.exists(socket_path):
            os.unlink(socket_path)  # a stale socket from a crashed daemon
        old_umask = os.umask(0o177)  # never a moment where another user may connect
        try:
            server: socketserver.BaseServer = _UnixServer(socket_path, _Handler)
        finally:
            os.umask(old_umask)
        with contextlib.suppress(PermissionError):  # made 0600 by the umask; gVisor refuses chmod of a host socket
            os.chmod(socket_path, 0o600)
    else:
        server = _TCPServer((host, port or 0), _Handler)
    server.init_bounds()  # type: ignore[attr-defined]
    server.daemon_app = daemon  # type: ignore[attr-defined]
    daemon.server = server
    return server


def read_token(token_file: Optional[str], token_fd: Optional[int] = None) -> str:
    """The token from the fd (read to EOF, then closed), the file, else from SANDBOX_TOKEN (then
    removed from this process's env)."""
    if token_fd is not None:
        with os.fdopen(token_fd, encoding="utf-8") as f:
            token = f.read().strip()
    elif token_file:
        with open(token_file, encoding="utf-8") as f:
            token = f.read().strip()
    else:
        token = os.environ.pop("SANDBOX_TOKEN", "").strip()
    if not token:
        raise ValueError("no token: give --token-file FILE or set SANDBOX_TOKEN")
    return token


def read_base_env(env_file: Optional[str], inherit: bool = False) -> Dict[str, str]:
    """The commands' base env: the JSON object in `env_file`, else in SANDBOXD_ENV (then removed),
    over this process's env if `inherit` (call after `read_token`: the token is gone from it)."""
    text = os.environ.pop(ENV_VAR, "")
    if env_file:
        with open(env_file, encoding="utf-8") as f:
            text = f.read()
    own = {k: v for k, v in os.environ.items() if k != "SANDBOX_TOKEN"} if inherit else {}
    if not text.strip():
        return own
    try:
        env = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"base env is not valid JSON: {exc}") from None
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise ValueError("base env must be a JSON object of strings")
    return dict(own, **env)


def run_sandboxd(socket_path: Optional[str] = None, host: str = "127.0.0.1", port: Optional[int] = None,
                 token_file: Optional[str] = None, root: str = "/", work_dir: Optional[str] = None,
                 env_file: Optional[str] = None, inherit_env: bool = False, listen_fd: Optional[int] = None,
                 token_fd: Optional[int] = None, cgroup_fd: Optional[int] = None,
                 commands_ns: Optional[Tuple[int, int]] = None, seccomp_file: Optional[str] = None) -> int:
    """Serve until /close (or SIGTERM/SIGINT, unless pid 1); print the ready line once listening.
    `commands_ns` (uid, gid): commands run in a pid namespace of their own as those ids (`cmdns`)."""
    if socket_path is None and port is None and listen_fd is None:
        raise ValueError("give --socket PATH, --listen-fd N or --port N for TCP")
    no_inherited_fds()  # the fds a runtime handed over stay ours: a command gets only what its spawn names
    cmdns = _start_commands_ns(commands_ns) if commands_ns is not None else None
    token = read_token(token_file, token_fd)  # first: it removes the token from the env a command may inherit
    if cmdns is not None:
        seccomp = read_bytes(seccomp_file)
        cmdns.send_filter(seccomp)
        install_seccomp(seccomp)  # before any thread: every later thread inherits it
    runtime = Runtime(root=root, work_dir=work_dir or os.getcwd(), base_env=read_base_env(env_file, inherit_env),
                      cgroup_fd=cgroup_fd, cmdns=cmdns)
    daemon = Daemon(runtime, token)
    protect_self()
    server = make_server(daemon, socket_path, host, port, listen_fd)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: daemon.stop_soon())
    guard_signals()
    if cmdns is not None:
        cmdns.wait_ready()
    if os.getpid() == 1:
        threading.Thread(target=reap_forever, args=(runtime,), name="reaper", daemon=True).start()
    ready: Dict[str, Any] = {"event": "ready", "pid": os.getpid()}
    if listen_fd is not None:
        ready["fd"] = listen_fd
    elif socket_path is not None:
        ready["socket"] = os.path.abspath(socket_path)
    else:
        bound_host, bound_port = server.server_address[:2]  # type: ignore[misc]
        ready["url"] = f"http://{bound_host}:{bound_port}"
    sys.stdout.write(json.dumps(ready) + "\n")
    sys.stdout.flush()
    try:
        server.serve_forever(poll_interval=0.2)
    finally:
        daemon.runtime.close()
        server.server_close()
        if socket_path is not None and os.path.exists(socket_path):
            os.unlink(socket_path)
    return 0


def _start_commands_ns(ids: Tuple[int, int]) -> CommandNamespace:
    """The commands' spawner, forked at import (`EARLY_NS`) or now, while single-threaded and before
    the token is read (`cmdns`); then become `ids` with no capability (the token and filter files
    are theirs, 0600)."""
    cmdns = EARLY_NS
    if cmdns is None:
        hold_fd_dir()  # the daemon's own fds stay listable once the commands' /proc replaces the sandbox's
        cmdns = CommandNamespace.start(*ids)
    drop_ids(*ids)
    return cmdns


def parse_ids(text: Optional[str]) -> Optional[Tuple[int, int]]:
    """"UID:GID" as two ints (None for None)."""
    if text is None:
        return None
    uid, _, gid = text.partition(":")
    try:
        return int(uid), int(gid)
    except ValueError:
        raise ValueError(f"--commands-ns {text!r}: expected UID:GID") from None


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="sandboxd", description=__doc__.split("\n")[0])
    parser.add_argument("--socket", help="Unix socket path to listen on (created with mode 0600).")
    parser.add_argument("--host", default="127.0.0.1", help="TCP bind address (with --port).")
    parser.add_argument("--port", type=int, help="TCP port instead of a unix socket (0 = any free port).")
    parser.add_argument("--listen-fd", type=int, help="Serve this inherited, listening unix socket (fd).")
    parser.add_argument("--token-file", help="File holding the token (default: env SANDBOX_TOKEN).")
    parser.add_argument("--token-fd", type=int, help="Read the token from this inherited fd (e.g. a pipe).")
    parser.add_argument("--root", default="/", help="File requests must resolve inside this directory.")
    parser.add_argument("--work-dir", help="Default cwd and base of relative paths (default: the cwd).")
    parser.add_argument("--env-file", help=f"JSON object: every command's base env (default: env {ENV_VAR}).")
    parser.add_argument("--inherit-env", action="store_true",
                        help="Commands inherit this process's env (token removed), under --env-file.")
    parser.add_argument("--cgroup-fd", type=int,
                        help="Inherited fd of the commands' cgroup.procs, open for writing: every command enters it.")
    parser.add_argument("--commands-ns", metavar="UID:GID",
                        help="Started as root (gVisor's): commands in a pid namespace of their own, all as UID:GID.")
    parser.add_argument("--seccomp-file", help="A BPF filter the daemon installs on itself (with --commands-ns).")
    args = parser.parse_args(argv)
    try:
        return run_sandboxd(args.socket, args.host, args.port, args.token_file, args.root, args.work_dir,
                            args.env_file, args.inherit_env, args.listen_fd, args.token_fd, args.cgroup_fd,
                            parse_ids(args.commands_ns), args.seccomp_file)
    except (ValueError, OSError) as exc:
        sys.stderr.write(f"sandboxd: error: {exc}\n")
        return 2


if __name__ == "__main__":
    sys.exit(main())
