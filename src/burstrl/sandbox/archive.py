"""Importing images made elsewhere: `docker save` tarballs and OCI archives, layers made tar+zstd.

Why import at all: SWE-bench ships one Docker image per task, and a user has them as `docker save`
files, OCI archives (`skopeo copy ... oci-archive:`) or in a registry (`registry.pull`). Why
recompress: a layer is unpacked on every node that lacks it and zstd decompresses several times
faster than gzip (`images` module docstring). The diff_id (sha256 of the uncompressed tar) does not
change with compression, so it is checked against the image config while the layer is converted:
an import either reproduces every layer bit for bit or fails, and nothing is published.

`LayoutWriter` is the shared back half (registry pulls use it too): a staging dir next to the
target, layers streamed in and re-encoded, config and manifest written last, one rename to publish.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tarfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

from burstrl.atomic import check_target, publish_tmp, sibling_tmp
from burstrl.sandbox.images import (
    CONFIG_TYPE,
    INDEX_TYPE,
    LAYER_GZIP,
    LAYER_TAR,
    LAYER_TYPES,
    LAYER_ZSTD,
    MANIFEST_TYPE,
    REF_NAME,
    Descriptor,
    ImageError,
    ImageRef,
    _HashingReader,
    _HashingWriter,
    _index,
    _write_json_blob,
    _write_layer,
    blob_path,
    compressor,
    digest_hex,
)

DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
DOCKER_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
DOCKER_CONFIG = "application/vnd.docker.container.image.v1+json"
DOCKER_LAYER_TAR = "application/vnd.docker.image.rootfs.diff.tar"
FOREIGN = ("application/vnd.docker.image.rootfs.foreign.diff.tar.gzip",
           "application/vnd.oci.image.layer.nondistributable.v1.tar+gzip")
SOURCE = "io.burstrl.imported.from"  # manifest annotation: where an imported image came from
_CHUNK = 1 << 20
_MAGIC = {b"\x1f\x8b": LAYER_GZIP, b"\x28\xb5\x2f\xfd": LAYER_ZSTD}

Progress = Callable[[str, int, int | None], None]  # (what, bytes so far, total or None)


def stderr_progress(every: int = 32 << 20) -> Progress:
    """A progress callback printing `what: N MB [of M MB]` to stderr every `every` bytes and at the end."""
    last: dict[str, int] = {}

    def show(what: str, done: int, total: int | None) -> None:
        if done - last.get(what, -every) >= every or (total is not None and done >= total):
            last[what] = done
            of = f" of {total / 1e6:.1f}" if total else ""
            print(f"{what}: {done / 1e6:.1f}{of} MB", file=sys.stderr, flush=True)

    return show


def layer_kind(media_type: str) -> str:
    """The compression of a layer media type; docker's plain-tar name too, foreign layers refused."""
    if media_type in FOREIGN:
        raise ImageError(f"foreign (non-distributable) layer {media_type!r}: its content is not in the image")
    if media_type == DOCKER_LAYER_TAR:
        return "tar"
    if media_type not in LAYER_TYPES:
        raise ImageError(f"unsupported layer media type {media_type!r}")
    return LAYER_TYPES[media_type]


def _decoded(kind: str, src: Any) -> Any:
    """An uncompressed stream of a layer; zstd across frames (a layer may hold several)."""
    if kind == "zstd":
        import zstandard

        return zstandard.ZstdDecompressor().stream_reader(src, read_size=_CHUNK, read_across_frames=True,
                                                          closefd=False)
    if kind == "gzip":
        import gzip

        return gzip.GzipFile(fileobj=src, mode="rb")
    return src


class LayoutWriter:
    """Stage an OCI layout next to `out_dir`, add layers, then `finish` publishes it in one rename.

    Use as a context manager: leaving it without `finish` (an error) removes the staging dir, so a
    failed import leaves nothing at `out_dir`.
    """

    def __init__(self, out_dir: Path, force: bool = False, progress: Progress | None = None) -> None:
        self.out_dir, self.force, self.progress = Path(out_dir), force, progress
        check_target(self.out_dir, force)
        self.tmp = sibling_tmp(self.out_dir)
        (self.tmp / "blobs" / "sha256").mkdir(parents=True)
        self.layers: list[Descriptor] = []
        self.diff_ids: list[str] = []

    def __enter__(self) -> LayoutWriter:  # noqa: PYI034 - not subclassed
        return self

    def __exit__(self, *exc: object) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)

    def scratch(self, name: str) -> Path:
        """A path inside the staging dir for a download (removed with it)."""
        return self.tmp / f".{name}"

    def add_layer(self, src: BinaryIO, media_type: str | None, *, label: str, digest: str | None = None,
                  size: int | None = None, diff_id: str | None = None) -> Descriptor:
        """Convert one layer blob read from `src` to tar+zstd; check it against `digest`/`size` (of
        the blob as given) and `diff_id` (of its uncompressed tar) where known.

        `media_type` None sniffs the compression from the first bytes (docker save's layer.tar is
        plain tar in practice, but gzipped ones exist)."""
        raw = _HashingReader(src, f"{label} (read)", size, self.progress)
        if media_type is None:
            head = raw.read(4)
            kind = LAYER_TYPES[next((t for m, t in _MAGIC.items() if head.startswith(m)), LAYER_TAR)]
            stream: Any = _Prefixed(head, raw)
        else:
            kind, stream = layer_kind(media_type), raw
        tmp = self.tmp / "blobs" / "sha256" / ".convert.tmp"
        with open(tmp, "wb") as fh:
            blob = _HashingWriter(fh)
            comp = compressor("zstd", blob)  # type: ignore[arg-type]
            diff = _HashingWriter(comp)
            try:
                decoded = _decoded(kind, stream)
                while chunk := decoded.read(_CHUNK):
                    diff.write(chunk)
            except (OSError, EOFError, ValueError) as exc:  # gzip.BadGzipFile, zstd errors, truncation
                raise ImageError(f"{label}: cannot decompress the {kind} layer: {exc}") from exc
            raw.drain()
            comp.close()
            fh.flush()
            os.fsync(fh.fileno())
        if digest is not None and (raw.digest != digest or (size is not None and raw.size != size)):
            raise ImageError(f"{label}: blob is corrupt: expected {digest} ({size} bytes), "
                             f"got {raw.digest} ({raw.size} bytes)")
        if diff_id is not None and diff.digest != diff_id:
            raise ImageError(f"{label}: uncompressed layer is {diff.digest}, the config says {diff_id}")
        os.replace(tmp, blob_path(self.tmp, blob.digest))
        desc = Descriptor(LAYER_ZSTD, blob.digest, blob.size)
        self.layers.append(desc)
        self.diff_ids.append(diff.digest)
        return desc

    def add_tree(self, src_dir: Path, dest: str) -> Descriptor:
        """A layer of a host directory tree (deterministic tar, see `images.write_tree_tar`)."""
        desc, diff_id = _write_layer(self.tmp, Path(src_dir), dest, "zstd")
        self.layers.append(desc)
        self.diff_ids.append(diff_id)
        return desc

    def finish(self, config: dict[str, Any], tag: str = "latest",
               annotations: dict[str, str] | None = None) -> ImageRef:
        """Write config (its diff_ids the layers added), manifest and index; publish atomically."""
        config = json.loads(json.dumps(config))
        config["rootfs"] = {"type": "layers", "diff_ids": list(self.diff_ids)}
        cdesc = _write_json_blob(self.tmp, config, CONFIG_TYPE)
        manifest: dict[str, Any] = {"schemaVersion": 2, "mediaType": MANIFEST_TYPE, "config": cdesc.to_json(),
                                    "layers": [d.to_json() for d in self.layers]}
        if annotations:
            manifest["annotations"] = dict(annotations)
        mdesc = _write_json_blob(self.tmp, manifest, MANIFEST_TYPE)
        for leftover in (self.tmp / "blobs" / "sha256").glob(".*"):
            leftover.unlink()
        for scratch in self.tmp.glob(".*"):
            scratch.unlink()
        (self.tmp / "oci-layout").write_text(json.dumps({"imageLayoutVersion": "1.0.0"}))
        (self.tmp / "index.json").write_text(json.dumps(_index(mdesc, tag), sort_keys=True))
        publish_tmp(self.tmp, self.out_dir, force=self.force, durable=True)
        return ImageRef(self.out_dir, tag, mdesc.digest)


class _Prefixed:
    """`head` then the rest of `src`: the sniffed bytes go back in front."""

    def __init__(self, head: bytes, src: Any) -> None:
        self.head, self.src = head, src

    def read(self, n: int = -1) -> bytes:
        if self.head:
            if n < 0:
                out, self.head = self.head + self.src.read(), b""
                return out
            out, self.head = self.head[:n], self.head[n:]
            return out
        return self.src.read(n)

    def readable(self) -> bool:
        return True


def clean_config(config: dict[str, Any]) -> dict[str, Any]:
    """The image config as an OCI config: docker's extra keys kept (they are valid JSON the spec
    ignores), rootfs rewritten by `LayoutWriter.finish`."""
    out = {k: v for k, v in config.items() if k not in ("rootfs",)}
    out.setdefault("os", "linux")
    return out


def config_diff_ids(config: dict[str, Any], n_layers: int, where: str) -> list[str]:
    diff_ids = list((config.get("rootfs") or {}).get("diff_ids") or [])
    if len(diff_ids) != n_layers:
        raise ImageError(f"{where}: {n_layers} layers but {len(diff_ids)} diff_ids in the config")
    return diff_ids


# ------------------------------------------------------------------------------ archives


def _member(tar: tarfile.TarFile, name: str, what: str) -> BinaryIO:
    try:
        fh = tar.extractfile(os.path.normpath(name).lstrip("/"))
    except KeyError as exc:
        raise ImageError(f"{what}: {name} is not in the archive") from exc
    if fh is None:
        raise ImageError(f"{what}: {name} is not a file in the archive")
    return fh  # type: ignore[return-value]


def _json_member(tar: tarfile.TarFile, name: str, what: str, digest: str | None = None) -> dict[str, Any]:
    data = _member(tar, name, what).read()
    if digest is not None and "sha256:" + hashlib.sha256(data).hexdigest() != digest:
        raise ImageError(f"{what}: {name} does not match its digest {digest}")
    try:
        return json.loads(data)
    except ValueError as exc:
        raise ImageError(f"{what}: {name} is not valid JSON: {exc}") from exc


def _names(tar: tarfile.TarFile) -> set[str]:
    return {os.path.normpath(m.name).lstrip("/") for m in tar.getmembers()}


def import_archive(path: Path, out_dir: Path, *, tag: str | None = None, platform: str = "linux/amd64",
                   force: bool = False, progress: Progress | None = None) -> ImageRef:
    """Import a `docker save` tarball (legacy `<id>/layer.tar` or docker 25's OCI-in-tar, both
    with manifest.json) or an OCI archive (a tar of an OCI layout), optionally gzipped, into an
    OCI layout at `out_dir` tagged `latest`, every layer tar+zstd.

    `tag` picks an image of a multi-image archive (a docker RepoTag `name:tag` or an OCI ref
    name); one image needs none. Every layer's diff_id is checked against the config."""
    path = Path(path)
    with LayoutWriter(out_dir, force, progress) as writer:
        tar = _open_tar(path, writer)
        with tar:
            return _import(tar, path, writer, tag, platform)


def _open_tar(path: Path, writer: LayoutWriter) -> tarfile.TarFile:
    """The archive as a seekable plain tar: a compressed one (`docker save | gzip`) is unpacked
    into the staging dir first, since reading its members out of order would decompress it
    from the start for every layer."""
    try:
        with open(path, "rb") as fh:
            kind = LAYER_TYPES[next((t for m, t in _MAGIC.items() if fh.read(4).startswith(m)), LAYER_TAR)]
            if kind != "tar":
                fh.seek(0)
                plain = writer.scratch("archive.tar")
                with open(plain, "wb") as out:
                    shutil.copyfileobj(_decoded(kind, fh), out, _CHUNK)
                path = plain
        return tarfile.open(path, "r:")
    except (OSError, EOFError, tarfile.TarError) as exc:
        raise ImageError(f"{path} is not a tar archive: {exc}") from exc


def _import(tar: tarfile.TarFile, path: Path, writer: LayoutWriter, tag: str | None, platform: str) -> ImageRef:
    """Dispatch on what the archive holds: manifest.json (docker save) or index.json (OCI)."""
    names = _names(tar)
    if "manifest.json" in names:
        config = _docker_save(tar, writer, tag, str(path))
    elif "index.json" in names:
        config = _oci_archive(tar, writer, tag, platform, str(path))
    else:
        raise ImageError(f"{path}: neither manifest.json (docker save) nor index.json (OCI archive) inside")
    return writer.finish(config, annotations={SOURCE: f"archive:{path.name}"})


def _docker_save(tar: tarfile.TarFile, writer: LayoutWriter, tag: str | None, where: str) -> dict[str, Any]:
    entries = _json_member(tar, "manifest.json", where)
    if not isinstance(entries, list) or not entries:
        raise ImageError(f"{where}: manifest.json lists no image")
    if tag is not None:
        entries = [e for e in entries if tag in (e.get("RepoTags") or [])]
        if not entries:
            raise ImageError(f"{where}: no image tagged {tag!r}")
    elif len(entries) > 1:
        tags = [t for e in entries for t in e.get("RepoTags") or []]
        raise ImageError(f"{where} holds {len(entries)} images; pick one with a tag ({', '.join(tags)})")
    entry = entries[0]
    cname = entry["Config"]
    config = _json_member(tar, cname, where, _digest_from_name(cname))
    layers = list(entry.get("Layers") or [])
    diff_ids = config_diff_ids(config, len(layers), where)
    for i, (name, diff_id) in enumerate(zip(layers, diff_ids, strict=False)):
        writer.add_layer(_member(tar, name, where), None, label=f"layer {i + 1}/{len(layers)}",
                         digest=_digest_from_name(name), diff_id=diff_id)
    return clean_config(config)


def _digest_from_name(name: str) -> str | None:
    """docker 25 names files blobs/sha256/<hex>: that is the content's digest, so check it."""
    parts = os.path.normpath(name).lstrip("/").split("/")
    if len(parts) == 3 and parts[:2] == ["blobs", "sha256"]:
        return "sha256:" + digest_hex("sha256:" + parts[2])
    return None


def _blob(tar: tarfile.TarFile, desc: Descriptor, where: str) -> BinaryIO:
    return _member(tar, f"blobs/sha256/{desc.hex}", where)


def _oci_archive(tar: tarfile.TarFile, writer: LayoutWriter, tag: str | None, platform: str,
                 where: str) -> dict[str, Any]:
    index = _json_member(tar, "index.json", where)
    entries = [Descriptor.from_json(m) for m in index.get("manifests") or []]
    if tag is not None:
        entries = [d for d in entries if d.annotations.get(REF_NAME) in (tag, tag.rpartition(":")[2])]
    if len(entries) != 1:
        tags = [d.annotations.get(REF_NAME, "?") for d in entries]
        raise ImageError(f"{where}: {len(entries)} images match; pick one with a tag ({', '.join(tags)})")
    desc = entries[0]
    manifest = _json_member(tar, f"blobs/sha256/{desc.hex}", where, desc.digest)
    if desc.media_type in (INDEX_TYPE, DOCKER_LIST) or manifest.get("manifests"):
        desc = pick_platform(manifest, platform, where)
        manifest = _json_member(tar, f"blobs/sha256/{desc.hex}", where, desc.digest)
    cdesc = Descriptor.from_json(manifest.get("config") or {})
    config = _json_member(tar, f"blobs/sha256/{cdesc.hex}", where, cdesc.digest)
    layers = [Descriptor.from_json(d) for d in manifest.get("layers") or []]
    diff_ids = config_diff_ids(config, len(layers), where)
    for i, (ldesc, diff_id) in enumerate(zip(layers, diff_ids, strict=False)):
        writer.add_layer(_blob(tar, ldesc, where), ldesc.media_type, label=f"layer {i + 1}/{len(layers)}",
                         digest=ldesc.digest, size=ldesc.size, diff_id=diff_id)
    return clean_config(config)


def pick_platform(index: dict[str, Any], platform: str, where: str) -> Descriptor:
    """The manifest of an index / manifest list for `platform` (`os/arch[/variant]`)."""
    want = platform.split("/")
    if len(want) not in (2, 3):
        raise ImageError(f"platform {platform!r} is not os/arch[/variant]")
    seen = []
    for m in index.get("manifests") or []:
        p = m.get("platform") or {}
        have = [p.get("os", ""), p.get("architecture", "")] + ([p.get("variant", "")] if len(want) == 3 else [])
        seen.append("/".join(x for x in [p.get("os"), p.get("architecture"), p.get("variant")] if x))
        if have == want:
            return Descriptor.from_json(m)
    raise ImageError(f"{where} has no image for {platform} (it has: {', '.join(seen) or 'none'})")
