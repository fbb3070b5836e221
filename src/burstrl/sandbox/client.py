"""Harness-side clients of sandboxd: `SandboxClient` (sync) and `AsyncSandboxClient` (asyncio).

Both speak the dataclasses of `protocol` over HTTP/1.1 on a unix socket or TCP, send the token in
`X-Sandbox-Token`, and raise `SandboxError(status, message)` for every failure: the daemon's 4xx/5xx
with its message, 503 when the daemon cannot be reached, 504 when no answer came in time.

Retries: a request whose connection drops (a stale keep-alive connection, a daemon restart) is
sent once more on a new connection. That is safe because every exec carries a request id (uuid4,
or the caller's), and the daemon answers a repeated id with the first run's result instead of
running the command again; the other requests are idempotent.

Bodies over the daemon's limits (`MAX_BODY`, `MAX_UPLOAD_BODY`) are refused here with the 413 the
daemon would give, never sent; and a daemon's early answer (it refused a body while it was being
sent) is read and reported, not taken for a dropped connection and sent again.

Trusting the socket. Code inside the sandbox can write where the socket lives, so it could put its
own server or a symlink (to a host listener, which would receive the token) in its place. On a unix
socket the client refuses a path that is not a socket (lstat: a symlink is refused) or whose owner
is not `expected_uid`, and, after connecting and before sending a byte, checks the listener's
SO_PEERCRED against `expected_pid`/`expected_uid`. The pid check is the race-free one (no other
process can hold the daemon's pid); a backend records it with `socket_peer()` right after the
daemon says it is ready, before any command has run.

Standard library only, like the daemon, so a harness inside an image can use it too.
"""

from __future__ import annotations

import asyncio
import base64
import http.client
import io
import json
import os
import socket
import stat
import struct
import tarfile
import time
import uuid
from typing import Any, Dict, List, Optional, Tuple, Type, TypeVar, Union
from urllib.parse import urlencode, urlsplit

from burstrl.sandbox.protocol import (
    DEFAULT_OUTPUT_BYTES,
    DEFAULT_READ_BYTES,
    MAX_BODY,
    MAX_UPLOAD_BODY,
    ExecRequest,
    ExecResult,
    Health,
    ProtocolError,
    ReadFileRequest,
    ReadFileResult,
    UploadResult,
    WriteFileRequest,
    WriteFileResult,
    from_json,
    to_json,
)

TOKEN_HEADER = "X-Sandbox-Token"
T = TypeVar("T")
_DROPPED = (ConnectionError, http.client.RemoteDisconnected, http.client.BadStatusLine,
            asyncio.IncompleteReadError)


class SandboxError(Exception):
    """A request that failed; `status` is the HTTP status (503: unreachable, 504: no answer in time)."""

    def __init__(self, status: int, message: str, type: str = "error"):
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message
        self.type = type


class _Call:
    """One request, ready for either transport: method, target, body and how to read the answer."""

    def __init__(self, method: str, target: str, result: type, body: bytes = b"",
                 content_type: str = "application/json", wait_s: float = 0.0):
        self.method = method
        self.target = target
        self.result = result
        self.body = body
        self.content_type = content_type
        self.wait_s = wait_s  # added to the transport timeout: how long the daemon may legitimately work

    def headers(self, token: str) -> Dict[str, str]:
        return {TOKEN_HEADER: token, "Content-Type": self.content_type, "Content-Length": str(len(self.body))}


def _json_call(target: str, cls: Type[Any], result: type, wait_s: float = 0.0, **fields: Any) -> _Call:
    try:
        request = cls(**fields)
    except ProtocolError as exc:  # caught here, before anything is sent
        raise SandboxError(exc.status, exc.message, exc.type) from None
    return _Call("POST", target, result, json.dumps(to_json(request)).encode("utf-8"), wait_s=wait_s)


def _exec_call(cmd: Union[str, List[str]], timeout: float, cwd: Optional[str], env: Optional[Dict[str, str]],
               max_output_bytes: int, request_id: Optional[str], private_output: bool) -> _Call:
    return _json_call("/exec", ExecRequest, ExecResult, wait_s=timeout, cmd=cmd, timeout=timeout, cwd=cwd,
                      env=env, max_output_bytes=max_output_bytes, request_id=request_id or uuid.uuid4().hex,
                      private_output=private_output)


def _write_call(path: str, data: Union[bytes, str], mode: int, mkdir: bool) -> _Call:
    content = {"text": data} if isinstance(data, str) else {"content_b64": base64.b64encode(data).decode("ascii")}
    return _json_call("/write_file", WriteFileRequest, WriteFileResult, path=path, mode=mode, mkdir=mkdir, **content)


def _upload_call(src: Union[str, "os.PathLike[str]", bytes], dest: str) -> _Call:
    archive = src if isinstance(src, bytes) else tar_bytes(os.fspath(src))
    return _Call("POST", "/upload?" + urlencode({"dest": dest}), UploadResult, archive, "application/x-tar")


def tar_bytes(path: str) -> bytes:
    """A directory's contents (names relative to it), or a single file, as an in-memory tar."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        if os.path.isdir(path):
            for name in sorted(os.listdir(path)):
                tar.add(os.path.join(path, name), arcname=name)
        else:
            tar.add(path, arcname=os.path.basename(path))
    return buf.getvalue()


def _answer(call: _Call, status: int, data: bytes) -> Any:
    """The result object of a 200, else the daemon's error as a SandboxError."""
    try:
        body = json.loads(data) if data else {}
    except ValueError:
        body = None
    if status != 200:
        err = body.get("error") if isinstance(body, dict) else None
        if isinstance(err, dict):
            raise SandboxError(status, str(err.get("message")), str(err.get("type", "error")))
        raise SandboxError(status, data[:200].decode("utf-8", "replace"))
    try:
        return from_json(call.result, body)
    except ProtocolError as exc:
        raise SandboxError(502, f"malformed answer from sandboxd: {exc.message}") from None


def _file_bytes(result: ReadFileResult, max_bytes: int) -> bytes:
    if result.truncated:
        raise SandboxError(413, f"{result.path} has {result.size} bytes, over max_bytes={max_bytes}")
    return base64.b64decode(result.content_b64)


def _check_size(call: _Call) -> None:
    """Refuse a body the daemon would refuse, before sending it (the daemon closes on such a body)."""
    cap = MAX_UPLOAD_BODY if call.target.startswith("/upload") else MAX_BODY
    if len(call.body) > cap:
        raise SandboxError(413, f"body of {len(call.body)} bytes is over the {cap}-byte limit of "
                                f"{call.target.split('?')[0]}; not sent", "request_too_large")


def peer_credentials(sock: socket.socket) -> Tuple[int, int, int]:
    """(pid, uid, gid) of the process that listens at the other end of a connected unix socket."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    return pid, uid, gid


def _untrusted(path: str, why: str) -> SandboxError:
    return SandboxError(502, f"refusing sandbox socket {path}: {why}", "untrusted_endpoint")


def _check_path(path: str, expected_uid: Optional[int]) -> None:
    """The path must be a unix socket itself (not a symlink to one) owned by `expected_uid`."""
    st = os.lstat(path)  # FileNotFoundError: no daemon there (yet), i.e. unreachable
    if not stat.S_ISSOCK(st.st_mode):
        raise _untrusted(path, "not a unix socket (a symlink or another file)")
    if expected_uid is not None and st.st_uid != expected_uid:
        raise _untrusted(path, f"owned by uid {st.st_uid}, not {expected_uid}")


def _check_peer(path: str, sock: socket.socket, expected_pid: Optional[int], expected_uid: Optional[int]) -> None:
    pid, uid, _ = peer_credentials(sock)
    if expected_pid is not None and pid != expected_pid:
        raise _untrusted(path, f"served by pid {pid}, not the daemon's pid {expected_pid}")
    if expected_uid is not None and uid != expected_uid:
        raise _untrusted(path, f"served by uid {uid}, not {expected_uid}")


def connect_unix(path: str, timeout: Optional[float], expected_pid: Optional[int] = None,
                 expected_uid: Optional[int] = None) -> socket.socket:
    """A connected socket to the daemon at `path`, checked before anything is sent (see above)."""
    _check_path(path, expected_uid)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        _connect_waiting(sock, path, timeout)
        _check_peer(path, sock, expected_pid, expected_uid)
    except BaseException:
        sock.close()
        raise
    return sock


def _connect_waiting(sock: socket.socket, path: str, timeout: Optional[float]) -> None:
    """Connect, waiting out a full listen backlog: a unix socket in timeout mode answers EAGAIN at
    once where TCP would wait (a burst of connections to the daemon is transient)."""
    deadline = time.monotonic() + (timeout if timeout is not None else 30.0)
    while True:
        try:
            sock.connect(path)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise socket.timeout(f"connect to {path}: listen backlog full") from None
            time.sleep(0.01)


def socket_peer(path: str, timeout: float = 5.0) -> Tuple[int, int, int]:
    """(pid, uid, gid) of the daemon listening at `path`: record it when the sandbox starts."""
    sock = connect_unix(path, timeout)
    try:
        return peer_credentials(sock)
    finally:
        sock.close()


class _UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float, expected_pid: Optional[int] = None,
                 expected_uid: Optional[int] = None):
        super().__init__("localhost", timeout=timeout)
        self._path = path
        self._expected = (expected_pid, expected_uid)

    def connect(self) -> None:
        self.sock = connect_unix(self._path, self.timeout, *self._expected)


class _HTTPConnection(http.client.HTTPConnection):
    def connect(self) -> None:
        super().connect()
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _endpoint(socket_path: Optional[str], url: Optional[str]) -> Tuple[Optional[str], str, int]:
    if (socket_path is None) == (url is None):
        raise ValueError("give exactly one of socket_path or url")
    if url is None:
        return socket_path, "", 0
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise ValueError(f"url must look like http://HOST:PORT, got {url!r}")
    return None, parts.hostname, parts.port or 80


class SandboxClient:
    """Blocking client on one reused keep-alive connection; not for use from several threads at once.

    `timeout` bounds connecting and every answer; an exec may take its own timeout on top of it.
    `close()` stops the daemon; `disconnect()` (also `with` exit) only drops this connection.
    `expected_pid`/`expected_uid`: the daemon's, checked on every unix connection (see the module).
    """

    def __init__(self, socket_path: Optional[str] = None, url: Optional[str] = None, token: str = "",
                 timeout: float = 30.0, expected_pid: Optional[int] = None, expected_uid: Optional[int] = None):
        self.socket_path, self.host, self.port = _endpoint(socket_path, url)
        self.token = token
        self.timeout = timeout
        self.expected_pid = expected_pid
        self.expected_uid = expected_uid
        self._conn: Optional[http.client.HTTPConnection] = None

    def health(self) -> Health:
        return self._do(_Call("GET", "/health", Health))

    def exec(self, cmd: Union[str, List[str]], timeout: float = 60.0, cwd: Optional[str] = None,
             env: Optional[Dict[str, str]] = None, max_output_bytes: int = DEFAULT_OUTPUT_BYTES,
             request_id: Optional[str] = None, private_output: bool = False) -> ExecResult:
        return self._do(_exec_call(cmd, timeout, cwd, env, max_output_bytes, request_id, private_output))

    def read_file(self, path: str, max_bytes: int = DEFAULT_READ_BYTES) -> bytes:
        """The file's bytes; SandboxError(413) when it is over `max_bytes`."""
        call = _json_call("/read_file", ReadFileRequest, ReadFileResult, path=path, max_bytes=max_bytes)
        return _file_bytes(self._do(call), max_bytes)

    def write_file(self, path: str, data: Union[bytes, str], mode: int = 0o644, mkdir: bool = True) -> WriteFileResult:
        return self._do(_write_call(path, data, mode, mkdir))

    def upload(self, src: Union[str, "os.PathLike[str]", bytes], dest: str) -> UploadResult:
        """Unpack `src` (a local directory's contents, a file, or tar bytes) into `dest`."""
        return self._do(_upload_call(src, dest))

    def close(self, timeout: Optional[float] = None) -> None:
        """Stop the daemon (it kills the commands still running). A dropped answer counts as done.

        `timeout`: how long to wait for the answer instead of `self.timeout`; a caller that kills
        the sandbox right after (the backends) waits briefly, and then no answer counts as done too:
        a daemon a command stopped (SIGSTOP under gVisor) would otherwise hold every close for the
        whole timeout.
        """
        call, limit = _Call("POST", "/close", dict), self.timeout if timeout is None else timeout
        conn = self._new_connection(limit)  # its own: another thread's exec may hold `_conn` mid-request
        try:
            self._exchange(conn, call, limit)
        except socket.timeout:
            if timeout is None:
                raise SandboxError(504, f"no answer to /close within {limit:g}s") from None
        except (*_DROPPED, OSError):
            pass  # the daemon is gone or going: closed
        finally:
            conn.close()
            self.disconnect()

    def disconnect(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def __enter__(self) -> "SandboxClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.disconnect()

    def _connection(self) -> http.client.HTTPConnection:
        if self._conn is None:
            self._conn = self._new_connection(self.timeout)
        return self._conn

    def _new_connection(self, timeout: float) -> http.client.HTTPConnection:
        if self.socket_path is not None:
            return _UnixHTTPConnection(self.socket_path, timeout, self.expected_pid, self.expected_uid)
        return _HTTPConnection(self.host, self.port, timeout=timeout)

    def _do(self, call: _Call, retry: bool = True) -> Any:
        _check_size(call)
        for attempt in range(2 if retry else 1):
            conn = self._connection()
            try:
                status, data, will_close = self._exchange(conn, call, self.timeout)
            except socket.timeout:
                self.disconnect()
                raise SandboxError(504, f"no answer to {call.target} within {self.timeout + call.wait_s:g}s") from None
            except (*_DROPPED, OSError) as exc:
                self.disconnect()
                if attempt == 0 and retry and isinstance(exc, _DROPPED):
                    continue
                raise SandboxError(503, f"sandboxd unreachable: {exc!r}") from None
            if will_close:
                self.disconnect()
            if call.result is dict:  # /close: any 200 will do
                return None
            return _answer(call, status, data)
        raise AssertionError("unreachable")

    def _exchange(self, conn: http.client.HTTPConnection, call: _Call, timeout: float) -> Tuple[int, bytes, bool]:
        """(status, body, the daemon closes) of one request; a daemon's early answer is kept.

        Connects first if needed (within `timeout`), so the answer's deadline is always
        `timeout + wait_s`: left to `request`, a fresh connection kept the connect timeout for the
        answer too, and an exec longer than `timeout` failed as 504 after any disconnect.
        """
        if conn.sock is None:
            conn.connect()
        conn.sock.settimeout(timeout + call.wait_s)
        try:
            conn.request(call.method, call.target, body=call.body, headers=call.headers(self.token))
        except (BrokenPipeError, ConnectionResetError):
            early = _early_answer(conn, call)  # the daemon refused the body and closed: read why
            if early is None:
                raise
            return early
        resp = conn.getresponse()
        return resp.status, resp.read(), resp.will_close


def _early_answer(conn: http.client.HTTPConnection, call: _Call) -> Optional[Tuple[int, bytes, bool]]:
    """The answer a daemon sent before it stopped reading our request, if there is one."""
    if conn.sock is None:
        return None
    try:
        conn.sock.settimeout(1.0)
        resp = http.client.HTTPResponse(conn.sock, method=call.method)
        resp.begin()
        return resp.status, resp.read(), True
    except (OSError, http.client.HTTPException):
        return None


class AsyncSandboxClient:
    """The same methods as coroutines; one short connection per request (no shared state)."""

    def __init__(self, socket_path: Optional[str] = None, url: Optional[str] = None, token: str = "",
                 timeout: float = 30.0, expected_pid: Optional[int] = None, expected_uid: Optional[int] = None):
        self.socket_path, self.host, self.port = _endpoint(socket_path, url)
        self.token = token
        self.timeout = timeout
        self.expected_pid = expected_pid
        self.expected_uid = expected_uid

    async def health(self) -> Health:
        return await self._do(_Call("GET", "/health", Health))

    async def exec(self, cmd: Union[str, List[str]], timeout: float = 60.0, cwd: Optional[str] = None,
                   env: Optional[Dict[str, str]] = None, max_output_bytes: int = DEFAULT_OUTPUT_BYTES,
                   request_id: Optional[str] = None, private_output: bool = False) -> ExecResult:
        return await self._do(_exec_call(cmd, timeout, cwd, env, max_output_bytes, request_id, private_output))

    async def read_file(self, path: str, max_bytes: int = DEFAULT_READ_BYTES) -> bytes:
        call = _json_call("/read_file", ReadFileRequest, ReadFileResult, path=path, max_bytes=max_bytes)
        return _file_bytes(await self._do(call), max_bytes)

    async def write_file(self, path: str, data: Union[bytes, str], mode: int = 0o644,
                         mkdir: bool = True) -> WriteFileResult:
        return await self._do(_write_call(path, data, mode, mkdir))

    async def upload(self, src: Union[str, "os.PathLike[str]", bytes], dest: str) -> UploadResult:
        return await self._do(_upload_call(src, dest))

    async def close(self) -> None:
        try:
            await self._do(_Call("POST", "/close", dict), retry=False)
        except SandboxError as exc:
            if exc.status != 503:
                raise

    async def _do(self, call: _Call, retry: bool = True) -> Any:
        _check_size(call)
        limit = self.timeout + call.wait_s
        for attempt in range(2 if retry else 1):
            try:
                status, data = await asyncio.wait_for(self._once(call), limit)
            except asyncio.TimeoutError:
                raise SandboxError(504, f"no answer to {call.target} within {limit:g}s") from None
            except (*_DROPPED, OSError) as exc:
                if attempt == 0 and retry and isinstance(exc, _DROPPED):
                    continue
                raise SandboxError(503, f"sandboxd unreachable: {exc!r}") from None
            return None if call.result is dict else _answer(call, status, data)
        raise AssertionError("unreachable")

    async def _once(self, call: _Call) -> Tuple[int, bytes]:
        """A minimal HTTP/1.1 exchange on a raw socket: the daemon always sends Content-Length.

        Why not asyncio streams: a stream transport that fails to write closes itself and drops
        what the daemon already answered (its 413 for a body it would not read).
        """
        loop = asyncio.get_running_loop()
        sock = await self._open(loop)
        try:
            headers = dict(call.headers(self.token), Host="sandbox", Connection="close")
            head = f"{call.method} {call.target} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items())
            try:
                await loop.sock_sendall(sock, head.encode("latin-1") + b"\r\n" + call.body)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the daemon refused the body and closed: its answer may be waiting below
            return await _read_answer(loop, sock)
        finally:
            sock.close()

    async def _open(self, loop: asyncio.AbstractEventLoop) -> socket.socket:
        if self.socket_path is not None:
            sock = connect_unix(self.socket_path, self.timeout, self.expected_pid, self.expected_uid)
            sock.setblocking(False)
            return sock
        sock = socket.socket(socket.AF_INET6 if ":" in self.host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            await loop.sock_connect(sock, (self.host, self.port))
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except BaseException:
            sock.close()
            raise
        return sock


async def _read_answer(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> Tuple[int, bytes]:
    """(status, body) of one answer read from `sock`; ConnectionResetError if it ends before one."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = await loop.sock_recv(sock, 65536)
        if not chunk:
            raise ConnectionResetError("connection closed before an answer")
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    length = 0
    for line in lines[1:]:
        name, _, value = line.partition(":")
        if name.strip().lower() == "content-length":
            length = int(value.strip())
    while len(body) < length:
        chunk = await loop.sock_recv(sock, max(65536, length - len(body)))
        if not chunk:
            raise asyncio.IncompleteReadError(body, length)
        body += chunk
    return status, body[:length]
