"""Safe, fast extraction of an image layer's tar stream into a directory.

Why its own module: unpacking a layer is the cost a node pays on a cache miss, and for real
layers (a Python env, a repo checkout: thousands of small files) creating files costs more
than decompressing them, so the codec difference only shows if file creation is cheap. What
makes it cheap here:
- the namespace is checked once per directory, not once per file: `dirs` holds every directory
  this extraction created or verified to be a real directory (no symlink on the way), and an
  entry that replaces or removes one of them takes it, and everything below it, out of the set;
- file contents are written by a small thread pool (open/write/close release the GIL and overlap
  with decompression), each file with one O_EXCL|O_NOFOLLOW open and fd-based chmod/utime;
  large files are preallocated and streamed by the reading thread;
- no fsync per file (a layer is re-unpacked from its verified blob if the node loses it).

Safety (ImageError "refused"): absolute names, `..`, writing through a symlink an entry planted,
hardlinks to anything but an earlier regular file of the layer, device nodes and fifos. The
pool never races the checks: it only writes files inside directories in `dirs`, and any entry
that could change what a path means (a symlink, hardlink, removal, or a path with a write in
flight) first waits for the writes in flight (`_barrier`).
"""

from __future__ import annotations

import os
import shutil
import stat
import tarfile
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO

from burstrl.sandbox.images import ImageError

_CHUNK = 1 << 20
# tarfile's stream keeps its read-ahead as one bytes object and slices it for every 512-byte
# header: 1 MiB made parsing 1.6x slower than 64 KiB on a pip tree (measured, benchmarks/unpack.py).
TAR_BUFSIZE = 64 << 10
SMALL = 1 << 20  # files up to this size are read whole and written by the pool
IN_FLIGHT = 64  # most pool writes queued at once (so at most 64 MiB of file data held)
WORKERS = 4
_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def safe_name(name: str) -> str:
    """A member name as a relative path inside the layer; absolute paths and `..` are refused."""
    if name.startswith("/"):
        raise ImageError(f"layer entry {name!r}: absolute paths are refused")
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise ImageError(f"layer entry {name!r}: '..' is refused")
    return "/".join(parts)


def remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def apply_dir_modes(dir_modes: dict[Path, int]) -> None:
    """Set directory modes deepest first, last of all: a 0555 dir must stay writable until then."""
    for path in sorted(dir_modes, key=lambda p: len(p.parts), reverse=True):
        if path.is_dir() and not path.is_symlink():  # a later entry may have replaced or removed it
            os.chmod(path, dir_modes[path])


def extract_layer(stream: BinaryIO, root: Path, workers: int = WORKERS) -> int:
    """Extract an uncompressed tar stream into the existing dir `root`, safely; return file bytes.

    Whiteout files are kept as plain empty files: they only mean something when layers are
    merged. `workers` 0 writes every file from the calling thread.
    """
    ex = _Extractor(Path(root), workers)
    try:
        with tarfile.open(fileobj=stream, mode="r|", bufsize=TAR_BUFSIZE) as tar:
            for member in tar:
                ex.member(tar, member)
        ex.barrier()
    finally:
        ex.close()
    apply_dir_modes(ex.dir_modes)
    return ex.total


def _write(target: str, data: bytes | None, src: BinaryIO | None, size: int, info: tarfile.TarInfo) -> None:
    """Create one regular file (it must not exist), write it, set mode, owner and mtime by fd."""
    try:
        fd = os.open(target, _FLAGS, 0o600)
    except FileExistsError:  # left in `root` before this extraction: the entry replaces it
        remove(Path(target))
        fd = os.open(target, _FLAGS, 0o600)
    try:
        if data is not None:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        elif src is not None:
            if size:
                os.posix_fallocate(fd, 0, size)
            while chunk := src.read(_CHUNK):
                os.write(fd, chunk)
        os.fchmod(fd, info.mode & 0o7777)
        if os.geteuid() == 0:
            os.fchown(fd, info.uid, info.gid)
        os.utime(fd, (info.mtime, info.mtime))
    finally:
        os.close(fd)


def _replacing(make: Callable[[Any, Path], None], source: Any, target: Path) -> None:
    """`make(source, target)`; a path left in `root` before this extraction is replaced."""
    try:
        make(source, target)
    except FileExistsError:
        remove(target)
        make(source, target)


class _Extractor:
    """The state of one extraction; see the module docstring for what each set guarantees."""

    def __init__(self, root: Path, workers: int) -> None:
        self.root = root
        self.base = str(root) + "/"  # paths as strings in the per-entry path: pathlib costs ~80 us each
        self.dirs: set[str] = {""}
        self.made: set[str] = set()  # non-directories this extraction created
        self.pending: dict[str, Future] = {}
        self.dir_modes: dict[Path, int] = {}
        self.total = 0
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="unpack") if workers else None
        self.slots = threading.Semaphore(IN_FLIGHT)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)

    def barrier(self) -> None:
        """Wait for every write in flight; raise the first that failed."""
        pending, self.pending = list(self.pending.values()), {}
        for fut in pending:
            fut.result()

    def member(self, tar: tarfile.TarFile, info: tarfile.TarInfo) -> None:
        rel = safe_name(info.name)
        if not rel:
            return
        self._parent_dirs(rel)
        if info.isdir():
            target = self.root / rel
            if rel not in self.dirs:
                self._clear(rel)
                try:
                    os.mkdir(target)
                except FileExistsError:  # in `root` before this extraction
                    if not stat.S_ISDIR(os.lstat(target).st_mode):
                        remove(target)
                        os.mkdir(target)
                self.dirs.add(rel)
            self.dir_modes[target] = info.mode & 0o7777
            return
        self._clear(rel)
        if info.issym():
            _replacing(os.symlink, info.linkname, Path(self.base + rel))  # never followed on the host: resolved in the sandbox
        elif info.islnk():
            self._hardlink(rel, info)
        elif info.isreg():
            self._file(tar, rel, info)
        else:
            raise ImageError(f"layer entry {rel!r}: device nodes, fifos and other special files are refused")
        self.made.add(rel)

    def _parent_dirs(self, rel: str) -> None:
        """Make sure every directory above `rel` is a real directory (creating it if missing)."""
        if rel.rpartition("/")[0] in self.dirs:
            return  # the common case: the parent was made or checked by an earlier entry
        parts = rel.split("/")[:-1]
        for i in range(len(parts)):
            prefix = "/".join(parts[:i + 1])
            if prefix in self.dirs:
                continue
            if prefix in self.pending:
                self.barrier()
            path = self.root / prefix
            try:
                mode = os.lstat(path).st_mode
            except FileNotFoundError:
                os.mkdir(path)
                mode = stat.S_IFDIR
            if stat.S_ISLNK(mode):
                raise ImageError(f"layer entry {rel!r} goes through the symlink {parts[i]!r}: refused")
            if not stat.S_ISDIR(mode):
                raise ImageError(f"layer entry {rel!r}: {prefix!r} is not a directory")
            self.dirs.add(prefix)

    def _clear(self, rel: str) -> None:
        """An entry is about to be written at `rel`: remove what an earlier entry put there."""
        if rel not in self.made and rel not in self.dirs and rel not in self.pending:
            return
        self.barrier()
        if rel in self.dirs:
            below = rel + "/"
            self.dirs = {d for d in self.dirs if d != rel and not d.startswith(below)}
            self.made = {m for m in self.made if not m.startswith(below)}
        self.made.discard(rel)
        remove(self.root / rel)

    def _hardlink(self, rel: str, info: tarfile.TarInfo) -> None:
        link_rel = safe_name(info.linkname)
        if link_rel in self.pending:
            self.barrier()
        path = self.root
        for part in PurePosixPath(link_rel).parts:
            path = path / part
            if path.is_symlink():
                raise ImageError(f"layer entry {rel!r}: hardlink through the symlink {part!r}: refused")
        source = self.root / link_rel
        if not link_rel or not source.is_file():
            raise ImageError(f"layer entry {rel!r}: hardlink to {info.linkname!r} is not a file in the layer: refused")
        _replacing(os.link, source, self.root / rel)

    def _file(self, tar: tarfile.TarFile, rel: str, info: tarfile.TarInfo) -> None:
        src = tar.extractfile(info)
        assert src is not None  # isreg() members always have data
        target = self.base + rel
        self.total += info.size
        if info.size > SMALL:
            _write(target, None, src, info.size, info)
            return
        data = src.read()
        if self.pool is None:
            _write(target, data, None, info.size, info)
            return
        self.slots.acquire()
        fut = self.pool.submit(_write, target, data, None, info.size, info)
        fut.add_done_callback(lambda _: self.slots.release())
        self.pending[rel] = fut
