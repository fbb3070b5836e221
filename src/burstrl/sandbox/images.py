"""Sandbox images: OCI image layouts whose layers are tar+zstd (tar+gzip and plain tar also read).

Why OCI layouts: every container tool (skopeo, buildah, crane, oras) reads and writes them, so a
task image made here can be pushed to a registry, and an image pulled with `skopeo copy
docker://... oci:DIR` runs here unchanged. Why zstd: a layer is unpacked on every node that
lacks it, and zstd decompresses several times faster than gzip at a similar ratio.

Images are host-side only: nothing in here is imported by the daemon inside a sandbox. Unpacking
and merging layers into a sandbox root lives in `burstrl.sandbox.layercache`.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import platform
import shutil
import tarfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, BinaryIO

from burstrl.atomic import build_dir, check_target

MANIFEST_TYPE = "application/vnd.oci.image.manifest.v1+json"
CONFIG_TYPE = "application/vnd.oci.image.config.v1+json"
INDEX_TYPE = "application/vnd.oci.image.index.v1+json"
LAYER_ZSTD = "application/vnd.oci.image.layer.v1.tar+zstd"
LAYER_GZIP = "application/vnd.oci.image.layer.v1.tar+gzip"
LAYER_TAR = "application/vnd.oci.image.layer.v1.tar"
DOCKER_LAYER_GZIP = "application/vnd.docker.image.rootfs.diff.tar.gzip"
LAYER_TYPES = {LAYER_ZSTD: "zstd", LAYER_GZIP: "gzip", DOCKER_LAYER_GZIP: "gzip", LAYER_TAR: "tar"}
COMPRESSION_TYPES = {"zstd": LAYER_ZSTD, "gzip": LAYER_GZIP, "tar": LAYER_TAR}
REF_NAME = "org.opencontainers.image.ref.name"
# Default levels, the tools' own defaults: zstd 3 (zstd CLI, containerd) and gzip 6 (gzip CLI,
# Go's compress/gzip via docker). Higher levels shrink layers a little and build much slower.
ZSTD_LEVEL = 3
GZIP_LEVEL = 6
FIXED_MTIME = 0  # every tar entry gets this mtime so the same tree always gives the same digest
_CHUNK = 1 << 20


class ImageError(ValueError):
    """An image layout that is missing, malformed, or whose content does not match its digests."""


@dataclass(frozen=True)
class Descriptor:
    """An OCI content descriptor: what a blob is, its sha256 digest and its size in bytes."""

    media_type: str
    digest: str
    size: int
    annotations: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"mediaType": self.media_type, "digest": self.digest, "size": self.size}
        if self.annotations:
            out["annotations"] = dict(self.annotations)
        return out

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> Descriptor:
        try:
            return cls(obj["mediaType"], obj["digest"], int(obj["size"]), dict(obj.get("annotations") or {}))
        except (KeyError, TypeError, ValueError) as exc:
            raise ImageError(f"malformed descriptor {obj!r}: {exc}") from exc

    @property
    def hex(self) -> str:
        """The digest without its `sha256:` prefix: the blob's file name and the cache key."""
        return digest_hex(self.digest)


@dataclass(frozen=True)
class ImageRef:
    """What `build_image` made: where the layout is, under which tag, and its manifest digest."""

    layout: Path
    tag: str
    manifest_digest: str


@dataclass(frozen=True)
class Image:
    """A read, verified image: manifest, config, and the layer descriptors bottom to top."""

    layout: Path
    tag: str
    manifest_digest: str
    manifest: dict[str, Any]
    config: dict[str, Any]
    layers: list[Descriptor]

    def blob_path(self, desc: Descriptor) -> Path:
        return blob_path(self.layout, desc.digest)

    @property
    def diff_ids(self) -> list[str]:
        return list(self.config.get("rootfs", {}).get("diff_ids", []))

    @property
    def env(self) -> list[str]:
        return list((self.config.get("config") or {}).get("Env") or [])

    @property
    def working_dir(self) -> str | None:
        return (self.config.get("config") or {}).get("WorkingDir") or None


def digest_hex(digest: str) -> str:
    algo, _, hexpart = digest.partition(":")
    if algo != "sha256" or len(hexpart) != 64 or any(c not in "0123456789abcdef" for c in hexpart):
        raise ImageError(f"unsupported or malformed digest {digest!r} (sha256 only)")
    return hexpart


def blob_path(layout: Path, digest: str) -> Path:
    return Path(layout) / "blobs" / "sha256" / digest_hex(digest)


# ---------------------------------------------------------------------------------------- writing


class _HashingReader:
    """Reads `src`, hashing and counting every byte; `drain` reads to the end so the hash is whole."""

    def __init__(self, src: BinaryIO, label: str = "", total: int | None = None,
                 progress: Callable[[str, int, int | None], None] | None = None) -> None:
        self.src, self.label, self.total, self.progress = src, label, total, progress
        self.sha, self.size = hashlib.sha256(), 0

    def read(self, n: int = -1) -> bytes:
        data = self.src.read(n)
        self.sha.update(data)
        self.size += len(data)
        if self.progress is not None and data:
            self.progress(self.label, self.size, self.total)
        return data

    def readable(self) -> bool:
        return True

    def drain(self) -> None:
        while self.read(_CHUNK):
            pass

    @property
    def digest(self) -> str:
        return "sha256:" + self.sha.hexdigest()


class _HashingWriter:
    """A write-only file object that hashes and counts what passes through to `sink`."""

    def __init__(self, sink: IO[bytes] | None) -> None:
        self.sink = sink
        self.sha = hashlib.sha256()
        self.size = 0

    def write(self, data: bytes) -> int:
        self.sha.update(data)
        self.size += len(data)
        if self.sink is not None:
            self.sink.write(data)
        return len(data)

    def flush(self) -> None:
        if self.sink is not None:
            self.sink.flush()

    @property
    def digest(self) -> str:
        return "sha256:" + self.sha.hexdigest()


def _tarinfo(name: str, st: os.stat_result, path: Path) -> tarfile.TarInfo:
    """A TarInfo with nothing host-specific in it: owner root, no names, fixed mtime."""
    info = tarfile.TarInfo(name)
    info.mode = st.st_mode & 0o7777
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    info.mtime = FIXED_MTIME
    if os.path.islink(path):
        info.type, info.linkname, info.mode = tarfile.SYMTYPE, os.readlink(path), 0o777
    elif path.is_dir():
        info.type = tarfile.DIRTYPE
    elif path.is_file():
        info.type, info.size = tarfile.REGTYPE, st.st_size
    else:
        raise ImageError(f"{path}: only files, directories and symlinks can go into an image")
    return info


def _walk_sorted(root: Path) -> list[Path]:
    """Every path under `root` in a fixed order (sorted by name, parents before children)."""
    out: list[Path] = []
    for entry in sorted(os.scandir(root), key=lambda e: e.name):
        path = Path(entry.path)
        out.append(path)
        if entry.is_dir(follow_symlinks=False):
            out.extend(_walk_sorted(path))
    return out


def write_tree_tar(src_dir: Path, dest: str, out: IO[bytes]) -> None:
    """Write `src_dir`'s tree as a deterministic tar whose entries sit under `dest` in the image.

    The parents of `dest` get their own directory entries (mode 0755) so the layer is complete.
    """
    prefix = dest.strip("/")
    with tarfile.open(fileobj=out, mode="w|", format=tarfile.PAX_FORMAT) as tar:
        parts = prefix.split("/") if prefix else []
        for i in range(len(parts)):
            info = tarfile.TarInfo("/".join(parts[: i + 1]))
            info.type, info.mode, info.mtime = tarfile.DIRTYPE, 0o755, FIXED_MTIME
            tar.addfile(info)
        for path in _walk_sorted(src_dir):
            rel = path.relative_to(src_dir).as_posix()
            info = _tarinfo(f"{prefix}/{rel}" if prefix else rel, path.lstat(), path)
            if info.type == tarfile.REGTYPE:
                with open(path, "rb") as fh:
                    tar.addfile(info, fh)
            else:
                tar.addfile(info)


def compressor(kind: str, sink: IO[bytes], level: int | None = None) -> Any:
    """A writable stream compressing into `sink` (closing it does not close `sink`)."""
    if kind == "zstd":
        import zstandard

        cctx = zstandard.ZstdCompressor(level=ZSTD_LEVEL if level is None else level)
        return cctx.stream_writer(sink, closefd=False)
    if kind == "gzip":
        # mtime=0 and no file name in the header: gzip output must be deterministic too
        return gzip.GzipFile(filename="", mode="wb", fileobj=sink,
                             compresslevel=GZIP_LEVEL if level is None else level, mtime=0)
    if kind == "tar":
        return _Uncloseable(sink)
    raise ImageError(f"unknown compression {kind!r}; choose zstd, gzip or tar")


class _Uncloseable:
    def __init__(self, sink: IO[bytes]) -> None:
        self.sink = sink

    def write(self, data: bytes) -> int:
        return self.sink.write(data)

    def close(self) -> None:
        self.sink.flush()


def decompressor(media_type: str, src: BinaryIO) -> BinaryIO:
    """A readable stream of the uncompressed tar of a layer blob of `media_type`."""
    kind = LAYER_TYPES.get(media_type)
    if kind == "zstd":
        import zstandard

        return zstandard.ZstdDecompressor().stream_reader(src, read_size=_CHUNK, closefd=False)
    if kind == "gzip":
        return gzip.GzipFile(fileobj=src, mode="rb")  # type: ignore[return-value]
    if kind == "tar":
        return src
    raise ImageError(f"unsupported layer media type {media_type!r}")


def _write_json_blob(layout: Path, obj: dict[str, Any], media_type: str) -> Descriptor:
    data = json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    path = blob_path(layout, digest)
    path.write_bytes(data)
    return Descriptor(media_type, digest, len(data))


def _write_layer(layout: Path, src_dir: Path, dest: str, kind: str) -> tuple[Descriptor, str]:
    """Tar + compress `src_dir` into a blob; return its descriptor and its diff_id."""
    tmp = layout / "blobs" / "sha256" / ".layer.tmp"
    with open(tmp, "wb") as fh:
        blob = _HashingWriter(fh)
        comp = compressor(kind, blob)  # type: ignore[arg-type]
        diff = _HashingWriter(comp)
        write_tree_tar(src_dir, dest, diff)  # type: ignore[arg-type]
        comp.close()
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, blob_path(layout, blob.digest))
    return Descriptor(COMPRESSION_TYPES[kind], blob.digest, blob.size), diff.digest


def _link_or_copy(src: Path, dst: Path) -> None:
    """Reuse a base blob as is: hardlink when on the same filesystem, else copy."""
    if dst.exists():
        return
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)


def _machine_arch() -> str:
    machine = platform.machine().lower()
    return {"x86_64": "amd64", "aarch64": "arm64", "arm64": "arm64"}.get(machine, machine)


def _new_config(base: Image | None, diff_id: str, dest: str) -> dict[str, Any]:
    config = json.loads(json.dumps(base.config)) if base else {"architecture": _machine_arch(), "os": "linux"}
    config["rootfs"] = {"type": "layers", "diff_ids": (base.diff_ids if base else []) + [diff_id]}
    inner = config.setdefault("config", {}) or {}
    inner["WorkingDir"] = dest
    config["config"] = inner
    return config


def _index(manifest: Descriptor, tag: str) -> dict[str, Any]:
    entry = Descriptor(manifest.media_type, manifest.digest, manifest.size, {REF_NAME: tag})
    return {"schemaVersion": 2, "mediaType": INDEX_TYPE, "manifests": [entry.to_json()]}


def build_image(src_dir: Path, out_dir: Path, base: Path | None = None, dest: str = "/work",
                compression: str = "zstd", tag: str = "latest", base_tag: str = "latest",
                force: bool = False) -> ImageRef:
    """Write an OCI layout at `out_dir`: base's layers (reused as is) + one layer of `src_dir` at `dest`.

    The layout appears whole or not at all (temp dir + rename). The same inputs give the same
    manifest digest, so an unchanged task repo maps onto an already cached image.
    """
    src_dir, out_dir = Path(src_dir), Path(out_dir)
    if not src_dir.is_dir():
        raise ImageError(f"{src_dir} is not a directory")
    if compression not in COMPRESSION_TYPES:
        raise ImageError(f"unknown compression {compression!r}; choose zstd, gzip or tar")
    base_image = read_image(base, base_tag) if base is not None else None
    check_target(out_dir, force)  # before the layer is written: fail fast
    made: list[str] = []  # the manifest digest, read from our own layout before it is published
    build_dir(out_dir, lambda tmp: made.append(_fill_layout(tmp, src_dir, base_image, dest, compression, tag)),
              force=force, durable=True)
    return ImageRef(out_dir, tag, made[0])


def _fill_layout(tmp: Path, src_dir: Path, base: Image | None, dest: str, kind: str, tag: str) -> str:
    """Write the layout's blobs, oci-layout and index.json into `tmp`; returns the manifest digest."""
    (tmp / "blobs" / "sha256").mkdir(parents=True)
    layers = list(base.layers) if base else []
    for desc in layers:
        _link_or_copy(base.blob_path(desc), blob_path(tmp, desc.digest))  # type: ignore[union-attr]
    layer, diff_id = _write_layer(tmp, src_dir, dest, kind)
    config = _write_json_blob(tmp, _new_config(base, diff_id, dest), CONFIG_TYPE)
    manifest = {"schemaVersion": 2, "mediaType": MANIFEST_TYPE, "config": config.to_json(),
                "layers": [d.to_json() for d in layers + [layer]]}
    manifest_desc = _write_json_blob(tmp, manifest, MANIFEST_TYPE)
    (tmp / "oci-layout").write_text(json.dumps({"imageLayoutVersion": "1.0.0"}))
    (tmp / "index.json").write_text(json.dumps(_index(manifest_desc, tag), sort_keys=True))
    return manifest_desc.digest


# ---------------------------------------------------------------------------------------- reading


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_bytes())
    except FileNotFoundError as exc:
        raise ImageError(f"{path} is missing: not an OCI image layout") from exc
    except ValueError as exc:
        raise ImageError(f"{path} is not valid JSON: {exc}") from exc


def read_blob(layout: Path, desc: Descriptor) -> bytes:
    """Read a (small) blob whole and check its size and digest."""
    path = blob_path(layout, desc.digest)
    try:
        data = path.read_bytes()
    except FileNotFoundError as exc:
        raise ImageError(f"blob {desc.digest} is missing from {layout}") from exc
    actual = "sha256:" + hashlib.sha256(data).hexdigest()
    if actual != desc.digest or len(data) != desc.size:
        raise ImageError(f"blob {path} is corrupt: expected {desc.digest} ({desc.size} bytes), "
                         f"got {actual} ({len(data)} bytes)")
    return data


def verify_blob(layout: Path, desc: Descriptor) -> None:
    """Hash a blob of any size in chunks; raise ImageError when it does not match `desc`."""
    path = blob_path(layout, desc.digest)
    sha, size = hashlib.sha256(), 0
    try:
        with open(path, "rb") as fh:
            while chunk := fh.read(_CHUNK):
                sha.update(chunk)
                size += len(chunk)
    except FileNotFoundError as exc:
        raise ImageError(f"blob {desc.digest} is missing from {layout}") from exc
    if "sha256:" + sha.hexdigest() != desc.digest or size != desc.size:
        raise ImageError(f"blob {path} is corrupt: expected {desc.digest} ({desc.size} bytes), "
                         f"got sha256:{sha.hexdigest()} ({size} bytes)")


def _pick_manifest(layout: Path, tag: str) -> Descriptor:
    """The index entry named `tag`; an index holding one unnamed manifest answers any tag."""
    index = _read_json(layout / "index.json")
    entries = [Descriptor.from_json(m) for m in index.get("manifests") or []]
    named = [d for d in entries if d.annotations.get(REF_NAME) == tag]
    if not named and len(entries) == 1 and REF_NAME not in entries[0].annotations:
        named = entries
    if not named:
        tags = sorted(d.annotations.get(REF_NAME, "?") for d in entries)
        raise ImageError(f"{layout} has no image tagged {tag!r} (tags: {', '.join(tags) or 'none'})")
    if named[0].media_type != MANIFEST_TYPE:
        raise ImageError(f"{layout}: {tag!r} is a {named[0].media_type}, not an image manifest "
                         "(pick one platform, e.g. skopeo copy --override-arch)")
    return named[0]


def read_image(layout_dir: Path, tag: str = "latest") -> Image:
    """Read an OCI layout: manifest and config verified by digest, layer blobs checked by size.

    Layer blobs are hashed when they are unpacked (once per node), not here: this runs on every
    sandbox start and must not read hundreds of megabytes. `verify_image` hashes them all.
    """
    layout = Path(layout_dir)
    if not (layout / "oci-layout").is_file():
        raise ImageError(f"{layout} is not an OCI image layout (no oci-layout file)")
    mdesc = _pick_manifest(layout, tag)
    manifest = json.loads(read_blob(layout, mdesc))
    config = json.loads(read_blob(layout, Descriptor.from_json(manifest.get("config") or {})))
    layers = [Descriptor.from_json(d) for d in manifest.get("layers") or []]
    for desc in layers:
        if desc.media_type not in LAYER_TYPES:
            raise ImageError(f"{layout}: unsupported layer media type {desc.media_type!r}")
        path = blob_path(layout, desc.digest)
        if not path.is_file() or path.stat().st_size != desc.size:
            raise ImageError(f"layer blob {desc.digest} is missing or truncated in {layout}")
    diff_ids = (config.get("rootfs") or {}).get("diff_ids") or []
    if len(diff_ids) != len(layers):
        raise ImageError(f"{layout}: {len(layers)} layers but {len(diff_ids)} diff_ids in the config")
    return Image(layout, tag, mdesc.digest, manifest, config, layers)


def verify_image(image: Image) -> None:
    """Hash every layer blob of `image` (manifest and config were checked by read_image)."""
    for desc in image.layers:
        verify_blob(image.layout, desc)


def describe(image: Image) -> dict[str, Any]:
    """A JSON-able summary for `burstrl image inspect`."""
    return {
        "layout": str(image.layout), "tag": image.tag, "manifest": image.manifest_digest,
        "architecture": image.config.get("architecture"), "os": image.config.get("os"),
        "env": image.env, "working_dir": image.working_dir,
        "layers": [{"digest": d.digest, "media_type": d.media_type, "size": d.size, "diff_id": diff}
                   for d, diff in zip(image.layers, image.diff_ids, strict=False)],
        "compressed_bytes": sum(d.size for d in image.layers),
    }
