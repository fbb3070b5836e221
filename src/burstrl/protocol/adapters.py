"""The sharded adapter upload, as both ends see it: PEFT's file names, the manifest, the packing.

Why here: the trainer packs and sends (`weights.push`), the replica receives and verifies
(`inference.adapters`), and the volume stores the same two files (`weights.volume`). When the
manifest lived in the replica's module, publishing imported the replica (and torch), and the
replica imported publishing back.

The sender tars the two PEFT files (deterministically: every trainer rank packs the same bytes),
splits the tar into byte ranges, one shard per rank, and sends a manifest with the sha256 of every
shard and the whole's sha256 as a root over the shard digests (`shard_root`); the receiver refuses
anything that does not add up. Why a root and not the sha256 of the joined bytes: every byte is
then hashed once on each side (the shard digests, computed as the bytes are packed or arrive), and
the root still changes when any shard is changed, missing, reordered or added.
"""

from __future__ import annotations

import hashlib
import os
import re
import tarfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ADAPTER_FILES = frozenset({"adapter_config.json", "adapter_model.safetensors"})  # PEFT's two files
MAX_SHARDS = 4096
# What the manifest's `sha256` is: the sha256 of the ordered shard digests (32 raw bytes each).
# An older sender's manifest (sha256 of the joined bytes, no `root`) is refused, not misread.
ROOT = "sha256-of-shard-sha256"
HEX_DIGEST = re.compile(r"[0-9a-f]{64}")


class UploadError(ValueError):
    """A sharded upload is incomplete or does not match its manifest."""


def shard_root(shard_sha256: list[str]) -> str:
    """The whole upload's digest: sha256 over its shards' sha256 digests, in shard order."""
    return hashlib.sha256(b"".join(bytes.fromhex(d) for d in shard_sha256)).hexdigest()


@dataclass
class Manifest:
    """What a sharded upload must add up to (sha256 hex digests; `sha256` is `shard_root`)."""

    name: str
    num_shards: int
    total_bytes: int
    sha256: str
    shard_sha256: list[str]
    root: str = ROOT

    @classmethod
    def parse(cls, data: Any) -> Manifest:
        try:
            m = cls(name=str(data["name"]), num_shards=int(data["num_shards"]),
                    total_bytes=int(data["total_bytes"]), sha256=str(data["sha256"]).lower(),
                    shard_sha256=[str(s).lower() for s in data["shard_sha256"]], root=str(data.get("root")))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise UploadError(f"bad manifest: {exc!r}") from None
        if not 1 <= m.num_shards <= MAX_SHARDS or len(m.shard_sha256) != m.num_shards:
            raise UploadError(f"manifest: num_shards must be 1..{MAX_SHARDS} and match shard_sha256")
        if m.root != ROOT:
            raise UploadError(f"manifest: root must be {ROOT!r} (the sha256 of the shard digests), "
                              f"got {m.root!r}; is the sender older than this replica?")
        if not all(HEX_DIGEST.fullmatch(d) for d in [m.sha256, *m.shard_sha256]):
            raise UploadError("manifest: every sha256 must be 64 hex digits")
        if m.total_bytes < 0:
            raise UploadError("manifest: total_bytes must be >= 0")
        return m

    def to_json(self) -> dict[str, Any]:
        return self.__dict__.copy()


class Packer:
    """Packs versions into one buffer kept from version to version (the sender side).

    Why keep it: a fresh 105 MB buffer costs a first touch of every page (0.15-0.25 s on the
    benchmark VM), and every version of a run has the same size. The shards `pack` returns are
    read-only views of that buffer: they are valid until the next `pack` with this packer, so its
    owner packs a version only once the previous push is done (the trainer's pushes are sequential).
    """

    def __init__(self) -> None:
        self._buffer = bytearray()

    def pack(self, directory: str | Path, num_shards: int, name: str) -> tuple[Manifest, list[memoryview]]:
        """Tar a PEFT adapter directory, cut it into `num_shards` byte ranges, hash every shard once.

        The tar depends only on the files' contents: every trainer rank packs the same version on
        its own and sends its own shard, so the ranks' bytes (and the manifest rank 0 sends) must
        agree even when their copies differ in mtime, owner or permissions. Built by hand (the
        header blocks tarfile writes), each file read straight into its place in the buffer, and
        the shards hashed on several threads (sha256 releases the GIL).
        """
        files = {fname: open(Path(directory) / fname, "rb", buffering=0) for fname in sorted(ADAPTER_FILES)}
        try:
            return self.pack_sources(files, num_shards, name)
        finally:
            for f in files.values():
                f.close()

    def pack_bytes(self, files: dict[str, bytes | memoryview], num_shards: int,
                   name: str) -> tuple[Manifest, list[memoryview]]:
        """`pack` from the two files' contents in memory (a version the trainer made without writing it)."""
        if set(files) != ADAPTER_FILES:
            raise ValueError(f"an adapter is exactly {sorted(ADAPTER_FILES)}, got {sorted(files)}")
        return self.pack_sources(files, num_shards, name)

    def pack_sources(self, sources: dict[str, Any], num_shards: int, name: str) -> tuple[Manifest, list[memoryview]]:
        """Lay out the tar of `sources` (file name -> open raw file or bytes) in the buffer, then hash."""
        layout, total = [], 0
        for fname in sorted(sources):
            source = sources[fname]
            info = _plain_member(tarfile.TarInfo(fname))
            info.size = len(source) if isinstance(source, (bytes, memoryview)) else os.fstat(source.fileno()).st_size
            head = info.tobuf(tarfile.PAX_FORMAT, tarfile.ENCODING, "surrogateescape")
            layout.append((source, total, head, info.size))
            total += len(head) + info.size + -info.size % tarfile.BLOCKSIZE
        total += 2 * tarfile.BLOCKSIZE  # two zero blocks end the archive
        total += -total % tarfile.RECORDSIZE
        if len(self._buffer) != total:
            self._buffer = bytearray(total)
        view, end = memoryview(self._buffer), 0
        for source, offset, head, size in layout:
            view[offset:offset + len(head)] = head
            data = view[offset + len(head):offset + len(head) + size]
            if isinstance(source, (bytes, memoryview)):
                data[:] = source
            else:
                _read_exactly(source, data)
            end = offset + len(head) + size
            pad = -size % tarfile.BLOCKSIZE
            view[end:end + pad] = bytes(pad)
            end += pad
        view[end:] = bytes(total - end)
        step = -(-total // num_shards)
        shards = [view[i * step:(i + 1) * step].toreadonly() for i in range(num_shards)]
        with ThreadPoolExecutor(max_workers=min(4, num_shards)) as pool:
            digests = list(pool.map(lambda b: hashlib.sha256(b).hexdigest(), shards))
        manifest = Manifest(name=name, num_shards=num_shards, total_bytes=total, sha256=shard_root(digests),
                            shard_sha256=digests)
        return manifest, shards


def pack_adapter(directory: str | Path, num_shards: int, name: str) -> tuple[Manifest, list[bytes]]:
    """`Packer.pack` for a caller that packs once and wants plain `bytes` (one copy more).

    Why not the views: an HTTP client given a memoryview as a body may iterate it as integers
    (httpx does); the push sends the packer's views itself.
    """
    manifest, shards = Packer().pack(directory, num_shards, name)
    return manifest, [bytes(s) for s in shards]


def _read_exactly(f: Any, out: memoryview) -> None:
    """Fill `out` from `f`, which must end exactly there (a file that changed size while packed is an error)."""
    got = 0
    while got < len(out):
        n = f.readinto(out[got:])
        if not n:
            raise ValueError(f"{f.name} shrank while being packed")
        got += n
    if f.read(1):
        raise ValueError(f"{f.name} grew while being packed")


def _plain_member(info: tarfile.TarInfo) -> tarfile.TarInfo:
    """Drop what differs between copies of the same file: times, owners, mode."""
    info.mtime = 0
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    info.mode = 0o644
    return info
