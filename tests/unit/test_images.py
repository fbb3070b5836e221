"""Sandbox images: OCI layouts with tar+zstd layers, and the node cache that unpacks and merges them."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import stat
import tarfile
import threading
from pathlib import Path

import pytest
from typer.testing import CliRunner

from burstrl.cli import app
from burstrl.sandbox.images import (
    LAYER_GZIP,
    Descriptor,
    ImageError,
    blob_path,
    build_image,
    read_image,
    verify_image,
)
from burstrl.sandbox.layercache import LayerCache


def _tree(root: Path) -> Path:
    (root / "pkg" / "sub").mkdir(parents=True)
    (root / "README.md").write_text("hello\n")
    (root / "pkg" / "mod.py").write_text("x = 1\n")
    (root / "pkg" / "sub" / "data.bin").write_bytes(os.urandom(2048))
    (root / "run.sh").write_text("#!/bin/sh\necho hi\n")
    (root / "run.sh").chmod(0o755)
    (root / "link").symlink_to("pkg/mod.py")
    return root


def _tar(entries: list[tuple[str, bytes | None, str]]) -> bytes:
    """A tar from (name, data, kind) with kind in file/dir/symlink:TARGET/chr."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data, kind in entries:
            info = tarfile.TarInfo(name)
            if kind == "dir":
                info.type, info.mode = tarfile.DIRTYPE, 0o755
            elif kind.startswith("symlink:"):
                info.type, info.linkname = tarfile.SYMTYPE, kind.split(":", 1)[1]
            elif kind == "chr":
                info.type = tarfile.CHRTYPE
            else:
                info.size, info.mode = len(data or b""), 0o644
            tar.addfile(info, io.BytesIO(data or b"") if kind == "file" else None)
    return buf.getvalue()


def _write_blob(layout: Path, data: bytes, media_type: str) -> Descriptor:
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    blob_path(layout, digest).write_bytes(data)
    return Descriptor(media_type, digest, len(data))


def _append_layer(layout: Path, tar_bytes: bytes) -> None:
    """Add a hand-made gzip layer on top of the image in `layout`, as another tool would."""
    image = read_image(layout)
    layer = _write_blob(layout, gzip.compress(tar_bytes), LAYER_GZIP)
    config = json.loads(json.dumps(image.config))
    config["rootfs"]["diff_ids"].append("sha256:" + hashlib.sha256(tar_bytes).hexdigest())
    cdesc = _write_blob(layout, json.dumps(config).encode(), "application/vnd.oci.image.config.v1+json")
    manifest = dict(image.manifest, config=cdesc.to_json(),
                    layers=[d.to_json() for d in image.layers] + [layer.to_json()])
    mdesc = _write_blob(layout, json.dumps(manifest).encode(), "application/vnd.oci.image.manifest.v1+json")
    index = {"schemaVersion": 2, "manifests": [dict(mdesc.to_json(), annotations={
        "org.opencontainers.image.ref.name": "latest"})]}
    (layout / "index.json").write_text(json.dumps(index))


def test_build_read_and_unpack_roundtrip(tmp_path: Path) -> None:
    ref = build_image(_tree(tmp_path / "src"), tmp_path / "img")
    image = read_image(tmp_path / "img")
    assert image.manifest_digest == ref.manifest_digest
    assert [d.media_type for d in image.layers] == ["application/vnd.oci.image.layer.v1.tar+zstd"]
    assert image.working_dir == "/work" and len(image.diff_ids) == 1
    verify_image(image)
    root = LayerCache(tmp_path / "cache", 10**9).rootfs(image)
    work = root / "work"
    assert (work / "README.md").read_text() == "hello\n"
    assert (work / "pkg" / "sub" / "data.bin").read_bytes() == (tmp_path / "src/pkg/sub/data.bin").read_bytes()
    assert os.readlink(work / "link") == "pkg/mod.py"
    assert stat.S_IMODE((work / "run.sh").stat().st_mode) == 0o755
    assert (work / "README.md").stat().st_nlink >= 2  # a hardlink to the cached layer, not a copy


def test_corrupt_blobs_are_refused(tmp_path: Path) -> None:
    build_image(_tree(tmp_path / "src"), tmp_path / "img")
    image = read_image(tmp_path / "img")
    layer = image.blob_path(image.layers[0])
    data = bytearray(layer.read_bytes())
    data[-1] ^= 0xFF
    layer.write_bytes(bytes(data))  # same size: only the digest can tell
    with pytest.raises(ImageError, match="corrupt"):
        verify_image(image)
    with pytest.raises(ImageError):
        LayerCache(tmp_path / "cache", 10**9).rootfs(image)
    assert not list((tmp_path / "cache" / "layers").iterdir())  # nothing half-unpacked left
    config = blob_path(tmp_path / "img", image.manifest["config"]["digest"])
    config.write_text(config.read_text().replace("/work", "/evil"))
    with pytest.raises(ImageError, match="corrupt"):
        read_image(tmp_path / "img")


def test_same_input_same_digest(tmp_path: Path) -> None:
    src = _tree(tmp_path / "src")
    a = build_image(src, tmp_path / "a")
    os.utime(src / "README.md", (1, 1))  # mtimes are not part of the image
    b = build_image(src, tmp_path / "b")
    assert a.manifest_digest == b.manifest_digest
    assert build_image(src, tmp_path / "c", compression="gzip").manifest_digest != a.manifest_digest
    assert build_image(src, tmp_path / "d", compression="gzip").manifest_digest == read_image(tmp_path / "c").manifest_digest


def test_base_layers_reused_and_whiteouts_applied(tmp_path: Path) -> None:
    base_src = tmp_path / "base"
    (base_src / "keep").mkdir(parents=True)
    (base_src / "keep" / "a.txt").write_text("a")
    (base_src / "gone.txt").write_text("gone")
    (base_src / "opaque").mkdir()
    (base_src / "opaque" / "old.txt").write_text("old")
    base = build_image(base_src, tmp_path / "baseimg", dest="/")
    _append_layer(tmp_path / "baseimg", _tar([
        (".wh.gone.txt", b"", "file"),
        ("opaque/", None, "dir"),
        ("opaque/.wh..wh..opq", b"", "file"),
        ("opaque/new.txt", b"new", "file"),
    ]))
    top = build_image(_tree(tmp_path / "src"), tmp_path / "img", base=tmp_path / "baseimg", compression="gzip")
    image = read_image(tmp_path / "img")
    assert len(image.layers) == 3 and top.manifest_digest != base.manifest_digest
    assert image.layers[0] == read_image(tmp_path / "baseimg").layers[0]
    assert image.blob_path(image.layers[0]).stat().st_ino == read_image(tmp_path / "baseimg").blob_path(
        image.layers[0]).stat().st_ino  # hardlinked, not recompressed
    root = LayerCache(tmp_path / "cache", 10**9).rootfs(image)
    assert (root / "keep" / "a.txt").read_text() == "a"
    assert not (root / "gone.txt").exists()
    assert sorted(p.name for p in (root / "opaque").iterdir()) == ["new.txt"]
    assert (root / "work" / "README.md").exists()
    assert not list(root.rglob(".wh.*"))


def test_cache_counts_and_evicts_lru(tmp_path: Path) -> None:
    images = []
    for name in "abc":
        (tmp_path / name).mkdir()
        (tmp_path / name / "blob").write_bytes(os.urandom(10_000))
        build_image(tmp_path / name, tmp_path / f"img-{name}")
        images.append(read_image(tmp_path / f"img-{name}"))
    a, b, c = images
    cache = LayerCache(tmp_path / "cache", max_bytes=25_000)
    cache.rootfs(a)
    cache.rootfs(b)
    cache.rootfs(a)  # a is now the most recently used
    assert cache.stats()["misses"] == 2 and cache.stats()["hits"] == 1
    cache.rootfs(c)  # over budget: b, the least recently used, goes
    stats = cache.stats()
    assert stats["evictions"] == 1 and stats["bytes_cached"] == 20_000 and stats["layers"] == 2
    assert not cache.layer_dir(b.layers[0]).exists() and cache.layer_dir(a.layers[0]).exists()
    assert stats["bytes_unpacked"] == 30_000 and stats["unpack_seconds"] > 0
    with cache.use(a) as root:  # pinned: a stays although it is now the oldest
        cache.rootfs(c)
        cache.rootfs(b)
        assert (root / "work" / "blob").exists()
    assert cache.layer_dir(a.layers[0]).exists() and not cache.layer_dir(c.layers[0]).exists()


def test_concurrent_unpack_of_one_layer_unpacks_once(tmp_path: Path) -> None:
    build_image(_tree(tmp_path / "src"), tmp_path / "img")
    image = read_image(tmp_path / "img")
    cache = LayerCache(tmp_path / "cache", 10**9)
    desc = image.layers[0]
    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(cache.unpack(desc, image.blob_path(desc))))
               for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(results)) == 1 and len(results) == 8
    assert cache.stats()["misses"] == 1 and cache.stats()["hits"] == 7
    assert [p.name for p in (tmp_path / "cache" / "layers").iterdir() if p.is_dir()] == [desc.hex]


@pytest.mark.parametrize("entries", [
    [("../evil", b"x", "file")],
    [("/abs/evil", b"x", "file")],
    [("lib", None, "symlink:/tmp"), ("lib/evil", b"x", "file")],
    [("dev/null", None, "chr")],
], ids=["dotdot", "absolute", "through-symlink", "device"])
def test_unsafe_tars_are_refused(tmp_path: Path, entries: list) -> None:
    data = _tar(entries)
    blob = tmp_path / "layer.tar"
    blob.write_bytes(data)
    desc = Descriptor("application/vnd.oci.image.layer.v1.tar", "sha256:" + hashlib.sha256(data).hexdigest(), len(data))
    cache = LayerCache(tmp_path / "cache", 10**9)
    with pytest.raises(ImageError, match="refused"):
        cache.unpack(desc, blob)
    assert not (tmp_path / "evil").exists() and not Path("/tmp/evil").exists()
    assert not list((tmp_path / "cache" / "layers").iterdir())


def test_cli_build_and_inspect(tmp_path: Path) -> None:
    runner = CliRunner()
    src = _tree(tmp_path / "src")
    result = runner.invoke(app, ["image", "build", str(src), "--out", str(tmp_path / "base"), "--dest", "/opt"])
    assert result.exit_code == 0, result.output
    result = runner.invoke(app, ["image", "build", str(src), "--out", str(tmp_path / "img"),
                                 "--base", str(tmp_path / "base"), "--compression", "gzip"])
    assert result.exit_code == 0, result.output
    assert result.output.strip() == read_image(tmp_path / "img").manifest_digest
    result = runner.invoke(app, ["image", "inspect", str(tmp_path / "img")])
    assert result.exit_code == 0, result.output
    info = json.loads(result.output)
    assert [layer["media_type"].rsplit("+", 1)[1] for layer in info["layers"]] == ["zstd", "gzip"]
    missing = runner.invoke(app, ["image", "build", str(tmp_path / "nope"), "--out", str(tmp_path / "x")])
    assert missing.exit_code == 2 and "not a directory" in missing.output
    bad = runner.invoke(app, ["image", "inspect", str(tmp_path / "nope")])
    assert bad.exit_code == 2 and "OCI image layout" in bad.output



def test_layers_from_another_boot_are_unpacked_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A host crash can leave a layer's files truncated under an intact record: after a reboot the
    cache unpacks (and merges) again from the digest-checked blob instead of serving them."""
    from burstrl.sandbox import layercache

    boot = tmp_path / "boot_id"
    boot.write_text("boot-1\n")
    monkeypatch.setattr(layercache, "BOOT_ID", boot)
    build_image(_tree(tmp_path / "src"), tmp_path / "img")
    image = read_image(tmp_path / "img")
    cache = LayerCache(tmp_path / "cache", 10**9)
    readme = cache.rootfs(image) / "work" / "README.md"
    (cache.layer_dir(image.layers[0]) / "work" / "README.md").write_bytes(b"")  # a write the crash lost
    assert cache.rootfs(image) == readme.parents[1] and readme.read_text() == ""  # same boot: trusted
    boot.write_text("boot-2\n")
    root = cache.rootfs(image)
    assert (root / "work" / "README.md").read_text() == "hello\n"
    assert cache.stats()["stale_after_reboot"] == 2 and cache.stats()["misses"] == 2  # the layer and the root
    assert cache.rootfs(image) == root and cache.stats()["rootfs_hits"] == 2
