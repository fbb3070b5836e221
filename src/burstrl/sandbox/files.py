"""The checks behind the daemon's file requests: regular files only, paths and archive members
that stay inside the sandbox root, and the OS's refusals as HTTP statuses.

Why a module of its own: each check stops a way a request could hang the daemon or reach outside
the root (a fifo that blocks a request thread, a symlink swapped in after the path check, a tar
member or link leading outside `dest`); apart from running commands (`runtime`), they read as one list.
Standard library only: the daemon imports it inside sandbox images.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import os
import stat
from typing import Iterator, List, Optional

from burstrl.sandbox.protocol import ProtocolError, WriteFileRequest


def open_regular(path: str, real: str, flags: int, mode: int = 0o644) -> int:
    """Open `real` only if it is a regular file (400 otherwise); blocking mode once checked.

    Why O_NONBLOCK and the type check: opening a fifo blocks until a peer opens the other end, and a
    device may never end, so a request thread would hang forever. O_NOFOLLOW: `real` is already
    resolved, so a symlink there now was swapped in after the check.
    """
    with contextlib.suppress(FileNotFoundError):
        if not stat.S_ISREG(os.lstat(real).st_mode):
            raise ProtocolError(400, f"'{path}' is not a regular file")
    fd = os.open(real, flags | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ProtocolError(400, f"'{path}' is not a regular file")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def inside(path: str, root: str) -> bool:
    return root == os.sep or path == root or path.startswith(root + os.sep)


@contextlib.contextmanager
def os_errors(path: str) -> Iterator[None]:
    """Turn the OS's refusals into the HTTP statuses a client can act on."""
    try:
        yield
    except FileNotFoundError:
        raise ProtocolError(404, f"'{path}': no such file or directory") from None
    except PermissionError:
        raise ProtocolError(403, f"'{path}': permission denied") from None
    except (IsADirectoryError, NotADirectoryError, FileExistsError) as exc:
        raise ProtocolError(400, f"'{path}': {exc.strerror}") from None
    except OSError as exc:
        if exc.errno is not None and exc.strerror:
            raise ProtocolError(400, f"'{path}': {exc.strerror}") from None
        raise


def decode_content(req: WriteFileRequest) -> bytes:
    if req.text is not None:
        return req.text.encode("utf-8")
    assert req.content_b64 is not None
    try:
        return base64.b64decode(req.content_b64, validate=True)
    except (binascii.Error, ValueError):
        raise ProtocolError(400, "field 'content_b64' is not valid base64") from None


def check_member(member) -> None:
    """Refuse, before anything is written, members whose name or link target leaves `dest`."""
    name = member.name
    if os.path.isabs(name) or ".." in name.split("/"):
        raise ProtocolError(400, f"archive member '{name}': absolute path or '..' refused")
    if member.ischr() or member.isblk() or member.isfifo():
        raise ProtocolError(400, f"archive member '{name}': device or fifo refused")
    if member.issym():
        target = os.path.normpath(os.path.join(os.path.dirname(name), member.linkname))
        if os.path.isabs(member.linkname) or target == ".." or target.startswith("../"):
            raise ProtocolError(400, f"archive member '{name}': symlink leaving the destination refused")
    if member.islnk() and (os.path.isabs(member.linkname) or ".." in member.linkname.split("/")):
        raise ProtocolError(400, f"archive member '{name}': hard link leaving the destination refused")


def extract_member(tar, member, dest: str) -> None:
    """Extract one member after checking, against what is on disk now, that it lands in `dest`.

    The lexical checks cannot see symlinks (an earlier member or a file already there); this real
    path check can, so no write ever goes through a link to outside `dest`.
    """
    paths: List[str] = [os.path.join(dest, member.name)]
    if member.islnk():
        paths.append(os.path.join(dest, member.linkname))
    if member.issym():  # where the new link would point, through the links already on disk
        paths.append(os.path.join(dest, os.path.dirname(member.name), member.linkname))
    for path in paths:
        if not inside(os.path.realpath(path), dest):
            raise ProtocolError(400, f"archive member '{member.name}': resolves outside the destination")
    kwargs = {"filter": "data"} if hasattr(tar, "extraction_filter") else {}
    tar.extract(member, dest, set_attrs=not member.issym(), **kwargs)


def find_program(prog: str, path: str, cwd: str) -> Optional[str]:
    """Where `prog` resolves like execvp would, if it is an executable file."""
    for full in _candidates(prog, path, cwd):
        if os.path.isfile(full) and os.access(full, os.X_OK):
            return full
    return None


def program_exists(prog: str, path: str, cwd: str) -> bool:
    """Whether `prog` names something that is not executable (execvp's EACCES, not ENOENT)."""
    return any(os.path.exists(full) for full in _candidates(prog, path, cwd))


def _candidates(prog: str, path: str, cwd: str) -> List[str]:
    dirs = [""] if "/" in prog else [d or "." for d in path.split(os.pathsep)]
    return [os.path.join(cwd, d, prog) for d in dirs]
