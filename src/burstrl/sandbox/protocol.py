"""The one set of request/response types spoken by the sandbox runtime, daemon and clients.

Why one set: the in-process runtime, the HTTP daemon and the sync/async clients all build and read
these same dataclasses, so a field added here reaches every side at once and validation happens in
one place (`__post_init__`), whoever constructs the object. Standard library only, Python 3.8+
syntax: the daemon imports this inside images that hold nothing but a Python 3.

Wire format: JSON bodies of `to_json(obj)`; `from_json(cls, data)` rejects missing, unknown and
mistyped fields with `ProtocolError(400)` naming the field. The one exception is `POST /upload`,
whose body is a raw tar archive (`Content-Type: application/x-tar`) and whose destination is the
query parameter `dest` (`POST /upload?dest=/work`): no base64 inflation of the largest payload.
Errors travel as `{"error": {"message", "type", "code"}}` with `code` = the HTTP status.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Type, TypeVar, Union

MiB = 1024 * 1024
MAX_TIMEOUT_S = 3600.0
DEFAULT_OUTPUT_BYTES = 1 * MiB  # per stream
MAX_OUTPUT_BYTES = 64 * MiB
DEFAULT_READ_BYTES = 16 * MiB
MAX_READ_BYTES = 64 * MiB
MAX_BODY = 16 * MiB  # the daemon's limit on a JSON request body (the client checks it before sending)
MAX_UPLOAD_BODY = 64 * MiB  # the same for /upload's raw tar body

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "method_not_allowed",
    411: "length_required",
    410: "gone",
    413: "request_too_large",
    500: "internal_error",
}


class ProtocolError(Exception):
    """A request the daemon refuses (4xx) or could not serve (5xx); carries the HTTP status."""

    def __init__(self, status: int = 400, message: str = "bad request", type: Optional[str] = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or ERROR_TYPES.get(status, "error")

    def to_body(self) -> Dict[str, Any]:
        return error_body(self.status, self.message, self.type)


def error_body(status: int, message: str, type: Optional[str] = None) -> Dict[str, Any]:
    """The JSON error shape every non-2xx answer carries."""
    return {"error": {"message": message, "type": type or ERROR_TYPES.get(status, "error"), "code": status}}


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_str_dict(v: Any) -> bool:
    return isinstance(v, dict) and all(isinstance(k, str) and isinstance(x, str) for k, x in v.items())


def _is_argv(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(x, str) for x in v)


# Keyed by the annotation string (annotations are not evaluated, so `X | Y` is fine on 3.8).
_CHECKS: Dict[str, Callable[[Any], bool]] = {
    "str": lambda v: isinstance(v, str),
    "Optional[str]": lambda v: v is None or isinstance(v, str),
    "int": _is_int,
    "float": lambda v: _is_int(v) or isinstance(v, float),
    "bool": lambda v: isinstance(v, bool),
    "Union[str, List[str]]": lambda v: isinstance(v, str) or _is_argv(v),
    "Optional[Dict[str, str]]": lambda v: v is None or _is_str_dict(v),
    "bytes": lambda v: isinstance(v, bytes),
}
_TYPE_NAMES = {
    "Optional[str]": "a string or null",
    "Union[str, List[str]]": "a string or a list of strings",
    "Optional[Dict[str, str]]": "an object of string values or null",
    "float": "a number",
    "int": "an integer",
    "bool": "a boolean",
    "str": "a string",
}


def _check_types(obj: Any) -> None:
    """Type-check every field of a protocol dataclass; ints given for floats become floats."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if not _CHECKS[str(f.type)](value):
            want = _TYPE_NAMES.get(str(f.type), str(f.type))
            raise ProtocolError(400, f"field '{f.name}' must be {want}, got {type(value).__name__}")
        if f.type == "float":
            setattr(obj, f.name, float(value))


def _require(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise ProtocolError(400, f"field '{name}' {message}")


@dataclass
class ExecRequest:
    """Run one command: a string goes through `/bin/sh -c`, a list is exec'd directly.

    `env` is merged over the runtime's minimal default env (never the daemon's own, which may hold
    the token). `request_id` makes a retry safe: a repeated id returns the first run's result.
    `max_output_bytes` caps each stream in the bytes its text takes in the JSON answer (escaped:
    an undecodable byte is 6 bytes there), not in the bytes the command wrote.
    `private_output`: stdout and stderr are socket pairs, not pipes, so no other process of the
    sandbox can reopen them through /proc and write into them (`runtime`, "Private output").
    """

    cmd: Union[str, List[str]]
    timeout: float = 60.0
    cwd: Optional[str] = None
    env: Optional[Dict[str, str]] = None
    max_output_bytes: int = DEFAULT_OUTPUT_BYTES
    request_id: Optional[str] = None
    private_output: bool = False

    def __post_init__(self) -> None:
        _check_types(self)
        _require(bool(self.cmd), "cmd", "must not be empty")
        _require(0 < self.timeout <= MAX_TIMEOUT_S, "timeout", f"must be in (0, {MAX_TIMEOUT_S:g}] seconds")
        _require(2 <= self.max_output_bytes <= MAX_OUTPUT_BYTES, "max_output_bytes",
                 f"must be in [2, {MAX_OUTPUT_BYTES}]")


@dataclass
class ExecResult:
    """What a command did. Output is utf-8 text (undecodable bytes replaced); when a stream's text
    would pass `max_output_bytes` on the wire, its head and tail are kept around an elision marker
    and the number of bytes the command wrote that were dropped is reported. `exit_code` is -N when
    a signal N ended the command (-9 on timeout)."""

    stdout: str
    stderr: str
    exit_code: int
    timed_out: bool = False
    truncated: bool = False
    stdout_elided_bytes: int = 0
    stderr_elided_bytes: int = 0
    duration_s: float = 0.0

    def __post_init__(self) -> None:
        _check_types(self)


@dataclass
class ReadFileRequest:
    path: str
    max_bytes: int = DEFAULT_READ_BYTES

    def __post_init__(self) -> None:
        _check_types(self)
        _require(bool(self.path), "path", "must not be empty")
        _require(0 <= self.max_bytes <= MAX_READ_BYTES, "max_bytes", f"must be in [0, {MAX_READ_BYTES}]")


@dataclass
class ReadFileResult:
    """`size` is the file's full size; `truncated` says only the first `max_bytes` were sent."""

    path: str
    content_b64: str
    size: int
    truncated: bool = False

    def __post_init__(self) -> None:
        _check_types(self)


@dataclass
class WriteFileRequest:
    """Exactly one of `content_b64` (bytes) or `text` (written as utf-8). `mkdir` creates parents."""

    path: str
    content_b64: Optional[str] = None
    text: Optional[str] = None
    mode: int = 0o644
    mkdir: bool = True

    def __post_init__(self) -> None:
        _check_types(self)
        _require(bool(self.path), "path", "must not be empty")
        _require((self.content_b64 is None) != (self.text is None), "content_b64",
                 "or 'text' must be given, not both")
        _require(0 <= self.mode <= 0o7777, "mode", "must be a permission mode in [0, 0o7777]")


@dataclass
class WriteFileResult:
    path: str
    size: int

    def __post_init__(self) -> None:
        _check_types(self)


@dataclass
class UploadRequest:
    """Unpack a tar archive (plain or gzip) into the directory `dest`, created if missing.

    `archive` is the HTTP body, not a JSON field. Members with absolute names, `..`, links leaving
    `dest`, or device files are refused (400) before anything is written.
    """

    dest: str
    archive: bytes = field(default=b"", metadata={"body": True}, repr=False)

    def __post_init__(self) -> None:
        _check_types(self)
        _require(bool(self.dest), "dest", "must not be empty")


@dataclass
class UploadResult:
    dest: str
    files: int  # archive members written (files, directories and links)

    def __post_init__(self) -> None:
        _check_types(self)


@dataclass
class Health:
    status: str
    pid: int
    uptime_s: float
    version: str

    def __post_init__(self) -> None:
        _check_types(self)


@dataclass
class CloseResult:
    """The daemon's answer to `POST /close`; it stops right after sending it."""

    status: str = "closing"

    def __post_init__(self) -> None:
        _check_types(self)


T = TypeVar("T")


def from_json(cls: Type[T], data: Any) -> T:
    """Build a protocol object from decoded JSON; every problem is a 400 naming the field."""
    if not isinstance(data, dict):
        raise ProtocolError(400, f"body must be a JSON object, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls) if not f.metadata.get("body")}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ProtocolError(400, f"unknown field '{unknown[0]}'")
    for name, f in fields.items():
        no_default = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        if no_default and name not in data:
            raise ProtocolError(400, f"missing field '{name}'")
    return cls(**data)


def to_json(obj: Any) -> Dict[str, Any]:
    """The JSON object for a protocol dataclass (body-only fields such as `archive` left out)."""
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj) if not f.metadata.get("body")}


# path -> (request type or None for GET, result type); shared by the daemon's router and clients.
ENDPOINTS: Dict[str, tuple] = {
    "/health": (None, Health),
    "/exec": (ExecRequest, ExecResult),
    "/read_file": (ReadFileRequest, ReadFileResult),
    "/write_file": (WriteFileRequest, WriteFileResult),
    "/upload": (UploadRequest, UploadResult),
    "/close": (None, CloseResult),
}
