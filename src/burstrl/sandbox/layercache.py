"""A node-local cache of unpacked image layers, and read-only sandbox roots merged from them.

Why: a sandbox must start in well under a second, but unpacking an image takes seconds to
minutes. Each layer is unpacked once per node (keyed by its digest, shared by every image that
has it), and each image's layers are merged once (keyed by the manifest digest) into a tree made
of HARDLINKS to the unpacked files, with whiteouts applied. The merge copies no file data, and
a cache hit costs a few stat calls. bubblewrap 0.8.0 (this machine's) has no overlay support;
the hardlink merge works on any filesystem and needs no privilege.

Intended use by a backend: bind the merged root READ-ONLY as the sandbox's `/` (its files are
shared inodes: a write through any of them would change every sandbox and the cache), then bind
a per-sandbox writable directory on `/work` (seeded with `writable_copy(root, "/work", dir)`)
and a fresh one on `/tmp`. Keep the root pinned (`with cache.use(image) as root:`) while the
sandbox runs so eviction leaves it alone.

On-disk layout under `root`: `layers/<hex>/` (a layer's tree as in its tar, whiteout files
kept) + `layers/<hex>.json` (size; its mtime is the last use), `rootfs/<hex>/` + `rootfs/<hex>.json`
(layer list), `locks/` (flock files, never deleted: deleting a lock file breaks flock).

Durability without an fsync per file: each `.json` record names the boot it was written in, and a
layer or root recorded in another boot is unpacked or merged again (from its digest-checked blob)
on first use. Files written before a host crash may be truncated with their record intact; after
any reboot the cache trusts nothing it cannot re-check, at the price of one unpack per layer used.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import stat
import tempfile
import threading
import time
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import Any

from burstrl.sandbox.extract import WORKERS, apply_dir_modes, extract_layer, remove
from burstrl.sandbox.images import Descriptor, Image, ImageError, _HashingReader, decompressor

WHITEOUT = ".wh."
OPAQUE = ".wh..wh..opq"


# ------------------------------------------------------------------------------- unpacking

BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


def boot_id() -> str:
    """This boot's id ("" where the kernel does not say: records are then always trusted)."""
    try:
        return BOOT_ID.read_text().strip()
    except OSError:
        return ""


def _this_boot(meta: Path) -> bool:
    """Whether a record was written since the last boot (else its files may have lost unsynced writes)."""
    try:
        return json.loads(meta.read_text()).get("boot", "") == boot_id()
    except (OSError, ValueError, AttributeError):
        return False


def unpack_blob(desc: Descriptor, blob: Path, root: Path, workers: int = WORKERS) -> int:
    """Decompress + extract a layer blob into `root`, verifying the blob's digest as it streams
    (`workers`: threads writing files, see `extract.extract_layer`)."""
    with open(blob, "rb") as fh:
        reader = _HashingReader(fh)
        try:
            total = extract_layer(decompressor(desc.media_type, reader), root, workers)  # type: ignore[arg-type]
        except Exception as exc:
            if isinstance(exc, ImageError):
                raise
            reader.drain()  # a decompression or tar error: blame the blob if its digest is off
            _check_digest(desc, blob, reader, exc)
            raise
        reader.drain()
    _check_digest(desc, blob, reader)
    return total


def _check_digest(desc: Descriptor, blob: Path, reader: _HashingReader, cause: Exception | None = None) -> None:
    actual = "sha256:" + reader.sha.hexdigest()
    if actual != desc.digest or reader.size != desc.size:
        raise ImageError(f"layer blob {blob} is corrupt: expected {desc.digest} ({desc.size} bytes), "
                         f"got {actual} ({reader.size} bytes)") from cause


# ----------------------------------------------------------------------------------------- merge


def _apply_layer(layer: Path, merged: Path, dir_modes: dict[Path, int]) -> None:
    """Lay one unpacked layer over `merged`: opaque dirs, then whiteouts, then hardlinked entries.

    Whiteouts in a layer apply to lower layers only, so they go before the layer's own entries
    of the same directory.
    """
    entries = sorted(os.scandir(layer), key=lambda e: e.name)
    names = {e.name for e in entries}
    if OPAQUE in names:
        for child in list(merged.iterdir()):
            remove(child)
    for e in entries:
        if e.name.startswith(WHITEOUT) and e.name != OPAQUE:
            remove(merged / e.name[len(WHITEOUT):])
    for e in entries:
        if e.name.startswith(WHITEOUT):
            continue
        target = merged / e.name
        if e.is_dir(follow_symlinks=False):
            if target.is_symlink() or (target.exists() and not target.is_dir()):
                remove(target)
            target.mkdir(mode=0o755, exist_ok=True)
            dir_modes[target] = stat.S_IMODE(e.stat(follow_symlinks=False).st_mode)
            _apply_layer(Path(e.path), target, dir_modes)
            continue
        if target.exists() or target.is_symlink():
            remove(target)
        if e.is_symlink():
            os.symlink(os.readlink(e.path), target)
        else:
            os.link(e.path, target)  # a hardlink: the merge copies no data


def merge_layers(layers: list[Path], merged: Path) -> None:
    """Build the sandbox root `merged` (an existing empty dir) from unpacked layers, bottom first."""
    dir_modes: dict[Path, int] = {}
    for layer in layers:
        _apply_layer(layer, merged, dir_modes)
    apply_dir_modes(dir_modes)
    os.chmod(merged, 0o755)


def writable_copy(rootfs: Path, inner: str, dst: Path) -> Path:
    """Copy the root's `inner` subtree (e.g. "/work") into a sandbox's own writable dir `dst`.

    A real copy, not hardlinks: the sandbox writes to it. Task repos are small; the rest of the
    root stays shared and read-only.
    """
    src = rootfs / inner.strip("/")
    if src.is_dir():
        shutil.copytree(src, dst, symlinks=True, dirs_exist_ok=True)
    else:
        dst.mkdir(parents=True, exist_ok=True)
    return dst


# ----------------------------------------------------------------------------------------- cache


@contextlib.contextmanager
def _flock(path: Path, mode: int) -> Iterator[None]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, mode)
        yield
    finally:
        os.close(fd)


class LayerCache:
    """Unpacked layers and merged roots on this node, bounded by `max_bytes` with LRU eviction.

    Safe across threads and processes: one flock per layer makes concurrent callers unpack it
    once; a cache-wide flock is held shared by unpacks and merges and exclusively by eviction;
    a pinned root holds a shared flock on its pin file, which eviction tests without waiting.
    Only layer bytes count against `max_bytes` (a merged root is hardlinks: dirs and links only),
    and evicting a layer also evicts every merged root built from it, unless one is pinned.
    """

    def __init__(self, root: Path, max_bytes: int) -> None:
        self.root, self.max_bytes = Path(root), max_bytes
        for sub in ("layers", "rootfs", "locks"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._counts = {"hits": 0, "misses": 0, "bytes_unpacked": 0, "unpack_seconds": 0.0,
                        "evictions": 0, "rootfs_hits": 0, "rootfs_builds": 0, "stale_after_reboot": 0}
        self._pins: dict[str, list[int]] = {}

    def _count(self, **deltas: float) -> None:
        with self._lock:
            for key, value in deltas.items():
                self._counts[key] += value

    def _lockfile(self, name: str) -> Path:
        return self.root / "locks" / name

    def stats(self) -> dict[str, Any]:
        """Counters of this process, plus what is on disk now (bytes_cached, layers, roots)."""
        with self._lock:
            out: dict[str, Any] = dict(self._counts)
        metas = self._layer_metas()
        out.update(bytes_cached=sum(m["bytes"] for m in metas.values()), layers=len(metas),
                   roots=len(list((self.root / "rootfs").glob("*.json"))), max_bytes=self.max_bytes)
        return out

    def layers(self) -> dict[str, int]:
        """Layer digest -> unpacked bytes of every layer on disk now: what a node agent reports
        to placement (which scores a node by the image layers it already holds)."""
        return {m["digest"]: int(m["bytes"]) for m in self._layer_metas().values()}

    # -- layers

    def layer_dir(self, desc: Descriptor) -> Path:
        return self.root / "layers" / desc.hex

    def unpack(self, desc: Descriptor, blob: Path) -> Path:
        """The unpacked dir of a layer, unpacking it first if this node lacks it."""
        with _flock(self._lockfile(".cache"), fcntl.LOCK_SH):
            path = self._unpack_locked(desc, blob)
        self.evict(protect={desc.hex})
        return path

    def _unpack_locked(self, desc: Descriptor, blob: Path) -> Path:
        final, meta = self.layer_dir(desc), self.layer_dir(desc).with_suffix(".json")
        with _flock(self._lockfile(f"layer-{desc.hex}"), fcntl.LOCK_EX):
            if meta.exists():
                if _this_boot(meta):
                    os.utime(meta)
                    self._count(hits=1)
                    return final
                self._drop_stale(meta, final)
            start = time.perf_counter()
            tmp = Path(tempfile.mkdtemp(prefix=f".{desc.hex[:16]}.", dir=self.root / "layers"))
            try:
                size = unpack_blob(desc, blob, tmp)
                os.chmod(tmp, 0o755)
                _install(tmp, final)
            except BaseException:
                force_rmtree(tmp)
                raise
            seconds = time.perf_counter() - start
            meta.write_text(json.dumps({"digest": desc.digest, "bytes": size, "unpack_seconds": seconds,
                                        "boot": boot_id()}))
            self._count(misses=1, bytes_unpacked=size, unpack_seconds=seconds)
            return final

    def _drop_stale(self, meta: Path, final: Path) -> None:
        """A record from another boot: its tree goes (the caller holds its lock) and is made again."""
        meta.unlink(missing_ok=True)
        force_rmtree(final)
        self._count(stale_after_reboot=1)

    def _layer_metas(self) -> dict[str, dict[str, Any]]:
        out = {}
        for meta in (self.root / "layers").glob("*.json"):
            try:
                out[meta.stem] = {**json.loads(meta.read_text()), "last_use": meta.stat().st_mtime}
            except (OSError, ValueError):
                continue  # removed or being written by another process meanwhile
        return out

    # -- merged roots

    def rootfs(self, image: Image) -> Path:
        """The image's read-only sandbox root, merging its layers (hardlinks) on first use."""
        key = image.manifest_digest.split(":", 1)[1]
        final, meta = self.root / "rootfs" / key, self.root / "rootfs" / f"{key}.json"
        with _flock(self._lockfile(".cache"), fcntl.LOCK_SH):
            layers = [self._unpack_locked(d, image.blob_path(d)) for d in image.layers]
            with _flock(self._lockfile(f"rootfs-{key}"), fcntl.LOCK_EX):
                if meta.exists() and _this_boot(meta):
                    self._count(rootfs_hits=1)
                else:
                    if meta.exists():
                        self._drop_stale(meta, final)
                    self._build_root(layers, final)
                    meta.write_text(json.dumps({"manifest": image.manifest_digest,
                                                "layers": [d.hex for d in image.layers], "boot": boot_id()}))
                    self._count(rootfs_builds=1)
                os.utime(meta)
        self.evict(protect={d.hex for d in image.layers})
        return final

    def _build_root(self, layers: list[Path], final: Path) -> None:
        tmp = Path(tempfile.mkdtemp(prefix=".merge.", dir=self.root / "rootfs"))
        try:
            merge_layers(layers, tmp)
            _install(tmp, final)
        except BaseException:
            force_rmtree(tmp)
            raise

    def pin(self, image: Image) -> None:
        """Keep the image's root (and its layers) from eviction until `unpin`, across processes."""
        key = image.manifest_digest.split(":", 1)[1]
        fd = os.open(self._lockfile(f"pin-{key}"), os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(fd, fcntl.LOCK_SH)
        with self._lock:
            self._pins.setdefault(key, []).append(fd)

    def unpin(self, image: Image) -> None:
        key = image.manifest_digest.split(":", 1)[1]
        with self._lock:
            fd = self._pins[key].pop()
        os.close(fd)

    @contextlib.contextmanager
    def use(self, image: Image) -> Iterator[Path]:
        """Pin the image, yield its root; the way a sandbox backend should hold a root."""
        self.pin(image)
        try:
            yield self.rootfs(image)
        finally:
            self.unpin(image)

    # -- eviction

    def evict(self, protect: Collection[str] = ()) -> int:
        """Evict least recently used layers (and their roots) until under max_bytes; return bytes freed."""
        freed = 0
        with _flock(self._lockfile(".cache"), fcntl.LOCK_EX):
            metas = self._layer_metas()
            total = sum(m["bytes"] for m in metas.values())
            for key, meta in sorted(metas.items(), key=lambda kv: kv[1]["last_use"]):
                if total <= self.max_bytes:
                    break
                if key in protect or not self._evict_layer(key):
                    continue
                total -= meta["bytes"]
                freed += meta["bytes"]
                self._count(evictions=1)
        return freed

    def _evict_layer(self, key: str) -> bool:
        """Remove one layer and the roots built on it, unless one of those roots is pinned."""
        users = []
        for meta in (self.root / "rootfs").glob("*.json"):
            with contextlib.suppress(OSError, ValueError):
                if key in json.loads(meta.read_text())["layers"]:
                    users.append(meta.stem)
        with contextlib.ExitStack() as stack:
            for user in users:
                fd = os.open(self._lockfile(f"pin-{user}"), os.O_RDWR | os.O_CREAT, 0o644)
                stack.callback(os.close, fd)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    return False
            for user in users:
                (self.root / "rootfs" / f"{user}.json").unlink(missing_ok=True)
                force_rmtree(self.root / "rootfs" / user)
            (self.root / "layers" / f"{key}.json").unlink(missing_ok=True)
            force_rmtree(self.root / "layers" / key)
        return True


def _install(tmp: Path, final: Path) -> None:
    """Rename a finished tree into place; if another process got there first, that is success."""
    try:
        os.rename(tmp, final)
    except OSError:
        if not final.is_dir():
            raise
        force_rmtree(tmp)


def force_rmtree(path: Path) -> None:
    """rmtree that also removes trees holding read-only (0555) dirs, as unpacked layers may."""
    if not path.exists():
        return
    for dirpath, dirnames, _ in os.walk(path):
        for name in dirnames:
            full = os.path.join(dirpath, name)
            if not os.path.islink(full):
                os.chmod(full, 0o755)
    os.chmod(path, 0o755)
    shutil.rmtree(path, ignore_errors=True)

