"""Directories and files that appear whole or not at all: write into a temp, then rename.

Models, checkpoints and adapter versions are read by other processes (replicas, resumed trainers,
racing test sessions) and must never be seen half-written, even after a crash; so are the small
files roles share while a run goes on (replicas.txt, control requests, resume state).

`build_dir` is the one way to make such a directory: build in a sibling temp dir (same filesystem,
so the rename is atomic), publish with one rename, remove the temp dir whatever happens. Caches
that several processes may build at once (the warm-started models) pass `accept`, so the loser of
the race uses the winner's directory instead of deleting or swapping it. `sha256_file` and
`sha256_files` are the content digests the caches and the versions volume are keyed by.
"""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path

CHUNK = 1 << 20  # digests read files in 1 MiB pieces: adapters and models can be large


def check_target(out: Path, force: bool) -> None:
    """Refuse to write over a non-empty directory (or a file) unless forced."""
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise FileExistsError(f"{out} exists and is not empty (use --force to replace it)")


def build_dir(
    out: str | Path,
    build: Callable[[Path], object],
    *,
    force: bool = False,
    accept: Callable[[Path], bool] | None = None,
    durable: bool = False,
    prefix: str | None = None,
) -> Path:
    """Make directory `out` by `build(tmp)` in a sibling temp dir, then publish it in one rename.

    `out` never holds a partial result and the temp dir is removed on every path (a failed build,
    a lost race, success). A non-empty `out` is refused unless `force` (it is then swapped out).
    `accept(out)` is asked whenever `out` holds another writer's directory (before building and
    when one appears meanwhile): True means use it, so ours is discarded and racing builders of a
    cache all end with one complete directory. `durable` fsyncs the tree's entry and its parent
    (for volumes other machines read). `prefix` names the temp dir (default `.NAME.tmp-`).
    Returns `out` (absolute).
    """
    out = Path(out).absolute()
    if accept is not None and _published(out) and accept(out):
        return out
    check_target(out, force)
    tmp = sibling_tmp(out, prefix)
    try:
        build(tmp)
        if accept is not None and _published(out) and accept(out):
            return out  # a racing writer finished first with a result as good as ours
        try:
            publish_tmp(tmp, out, force=force, durable=durable)
        except FileExistsError:
            if accept is None or not accept(out):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already after a successful rename
    return out


def sibling_tmp(out: Path, prefix: str | None = None) -> Path:
    """A new private temp dir beside `out` (same filesystem: renaming it to `out` is atomic)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=prefix or f".{out.name}.tmp-", dir=out.parent))


def publish_tmp(tmp: Path, out: Path, *, force: bool, durable: bool) -> None:
    """Publish a finished temp dir made by `sibling_tmp` (for writers that fill it step by step,
    like an image import; `build_dir` does this for the rest): readable by all, renamed to `out`."""
    make_readable(tmp)
    if durable:
        fsync_dir(tmp)
    publish_dir(tmp, out, force)
    if durable:
        fsync_dir(out.parent)


def _published(out: Path) -> bool:
    return out.is_dir() and any(out.iterdir())


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


def write_text(path: Path, text: str, mode: int = 0o644) -> None:
    """Replace `path`'s content at once: a reader sees the old text or the new, never part of one.

    The temp file's name is unique, so concurrent writers of the same path (threads of the
    launcher's fleet) never rename each other's half-written file; the last rename wins. `mode`
    0o600 for a secret: the temp file is private from its creation (mkstemp) until the rename.
    """
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, mode)  # mkstemp makes it private; most of these files are read by the run's other roles
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


def sha256_file(path: str | Path) -> str:
    """Hex sha256 of one file's content, read in chunks (model weights need not fit in memory twice)."""
    return sha256_files([path])


def sha256_files(paths: Iterable[str | Path]) -> str:
    """Hex sha256 of the files' contents in the given order, as if concatenated.

    The fingerprint a cache is keyed by, e.g. a base model's weights and config.json: the order
    is the caller's (sort a glob) so the same files always give the same digest.
    """
    digest = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as f:
            while chunk := f.read(CHUNK):
                digest.update(chunk)
    return digest.hexdigest()
