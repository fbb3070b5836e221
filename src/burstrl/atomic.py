"""Directories and files that appear whole or not at all: write into a temp, then rename.

Models, checkpoints and adapter versions are read by other processes (replicas, resumed trainers,
racing test sessions) and must never be seen half-written, even after a crash; so are the small
files roles share while a run goes on (replicas.txt, control requests, resume state).
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from pathlib import Path


def check_target(out: Path, force: bool) -> None:
    """Refuse to write over a non-empty directory (or a file) unless forced."""
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise FileExistsError(f"{out} exists and is not empty (use --force to replace it)")


def publish_dir(tmp: Path, out: Path, force: bool) -> None:
    """Rename the finished temp dir to `out`; with force, swap out a non-empty `out` first.

    Without force a non-empty `out` (one that appeared meanwhile: a racing writer) is a
    FileExistsError and `tmp` is left for the caller to remove.
    """
    if force and out.is_dir() and any(out.iterdir()):
        trash = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
        try:
            os.replace(out, trash / out.name)
        except FileNotFoundError:
            pass  # a racing writer moved it first
        shutil.rmtree(trash)
    try:
        os.replace(tmp, out)  # atomic; replaces a missing or empty directory only
    except OSError as exc:
        if exc.errno in (errno.ENOTEMPTY, errno.EEXIST):
            raise FileExistsError(f"{out} appeared while it was being written") from exc
        raise


def write_text(path: Path, text: str) -> None:
    """Replace `path`'s content at once: a reader sees the old text or the new, never part of one.

    The temp file's name is unique, so concurrent writers of the same path (threads of the
    launcher's fleet) never rename each other's half-written file; the last rename wins.
    """
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o644)  # mkstemp makes it private; these files are read by the run's other roles
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def make_readable(path: Path) -> None:
    """mkdtemp makes a private dir; a model dir is for every user of the cache."""
    os.chmod(path, 0o755)
    for child in path.iterdir():
        if child.is_file():
            os.chmod(child, 0o644)


def fsync_dir(path: Path) -> None:
    """Make a rename (or new entries) in `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
