"""Layer extraction (sandbox/extract.py): the pool of file writers gives the same tree as the serial
path, entries that replace earlier ones still work, and every unsafe entry is still refused."""

from __future__ import annotations

import io
import os
import stat
import tarfile
from pathlib import Path

import pytest

from burstrl.sandbox.extract import SMALL, extract_layer
from burstrl.sandbox.images import ImageError


def _tar(entries: list[tuple[str, str, bytes | str | None]]) -> io.BytesIO:
    """A tar from (name, kind, payload): kind file (bytes), dir (mode), symlink/hardlink (target), chr, fifo."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, kind, payload in entries:
            info = tarfile.TarInfo(name)
            info.mtime = 1_000_000
            if kind == "dir":
                info.type, info.mode = tarfile.DIRTYPE, int(payload or "755", 8)
            elif kind == "symlink":
                info.type, info.linkname = tarfile.SYMTYPE, str(payload)
            elif kind == "hardlink":
                info.type, info.linkname = tarfile.LNKTYPE, str(payload)
            elif kind == "chr":
                info.type = tarfile.CHRTYPE
            elif kind == "fifo":
                info.type = tarfile.FIFOTYPE
            else:
                data = payload if isinstance(payload, bytes) else b""
                info.size, info.mode = len(data), 0o755 if name.endswith(".sh") else 0o644
                tar.addfile(info, io.BytesIO(data))
                continue
            tar.addfile(info)
    buf.seek(0)
    return buf


def _snapshot(root: Path) -> dict[str, tuple]:
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            st = os.lstat(path)
            rel = path.relative_to(root).as_posix()
            if stat.S_ISLNK(st.st_mode):
                out[rel] = ("link", os.readlink(path))
            elif stat.S_ISDIR(st.st_mode):
                out[rel] = ("dir", stat.S_IMODE(st.st_mode))
            else:
                out[rel] = ("file", stat.S_IMODE(st.st_mode), int(st.st_mtime), st.st_nlink, path.read_bytes())
    return out


def _many() -> list[tuple[str, str, bytes | str | None]]:
    entries: list[tuple[str, str, bytes | str | None]] = [("pkg", "dir", "755"), ("ro", "dir", "555")]
    for i in range(300):
        entries.append((f"pkg/m{i % 7}/f{i}.py", "file", f"x = {i}\n".encode() * (i + 1)))
    entries += [("ro/inside.txt", "file", b"in a 0555 dir"), ("run.sh", "file", b"#!/bin/sh\n"),
                ("big.bin", "file", os.urandom(SMALL + 12345)), ("link", "symlink", "pkg/m0/f0.py"),
                ("hard", "hardlink", "pkg/m1/f1.py"), ("pkg/m2/f2.py", "file", b"replaced\n"),
                ("gone", "dir", None), ("gone/a.txt", "file", b"a"), ("gone", "file", b"now a file"),
                ("was_file", "file", b"f"), ("was_file", "dir", None), ("was_file/x", "file", b"x"),
                (".wh.deleted", "file", b"")]
    return entries


@pytest.mark.parametrize("workers", [0, 1, 4])
def test_pool_and_serial_give_the_same_tree(tmp_path: Path, workers: int) -> None:
    serial, pooled = tmp_path / "serial", tmp_path / "pooled"
    serial.mkdir()
    pooled.mkdir()
    entries = _many()
    total = extract_layer(_tar(entries), serial, workers=0)
    assert extract_layer(_tar(entries), pooled, workers=workers) == total
    snap = _snapshot(pooled)
    assert snap == _snapshot(serial)
    assert snap["pkg/m2/f2.py"][-1] == b"replaced\n"  # a later entry of the same name wins
    assert snap["gone"][0] == "file" and snap["was_file"][0] == "dir" and snap["was_file/x"][-1] == b"x"
    assert snap["hard"][3] == 2 and snap["hard"][-1] == snap["pkg/m1/f1.py"][-1]
    assert snap["ro"] == ("dir", 0o555) and snap["run.sh"][1] == 0o755 and snap["run.sh"][2] == 1_000_000
    assert snap["link"] == ("link", "pkg/m0/f0.py")
    os.chmod(pooled / "ro", 0o755)
    os.chmod(serial / "ro", 0o755)


@pytest.mark.parametrize("workers", [0, 4])
@pytest.mark.parametrize("entries", [
    [("../evil", "file", b"x")],
    [("/abs/evil", "file", b"x")],
    [("lib", "symlink", "/tmp"), ("lib/evil", "file", b"x")],
    # a directory with writes in flight, replaced by a symlink, then an entry through it
    [("lib", "dir", None)] + [(f"lib/f{i}", "file", b"x") for i in range(50)]
    + [("lib", "symlink", "/tmp"), ("lib/evil", "file", b"x")],
    [("lib", "symlink", "/tmp"), ("lib/sub/evil", "file", b"x")],
    [("a", "symlink", "/tmp"), ("h", "hardlink", "a/evil")],
    [("a", "symlink", "/etc/passwd"), ("h", "hardlink", "a")],
    [("h", "hardlink", "/etc/passwd")],
    [("h", "hardlink", "missing")],
    [("dev/null", "chr", None)],
    [("p", "fifo", None)],
], ids=["dotdot", "absolute", "through-symlink", "dir-replaced-by-symlink", "deep-through-symlink",
        "hardlink-through-symlink", "hardlink-to-symlink", "hardlink-absolute", "hardlink-missing", "device", "fifo"])
def test_unsafe_entries_are_refused(tmp_path: Path, entries: list, workers: int) -> None:
    root = tmp_path / "root"
    root.mkdir()
    with pytest.raises(ImageError, match="refused"):
        extract_layer(_tar(entries), root, workers=workers)
    assert not (tmp_path / "evil").exists() and not Path("/tmp/evil").exists()
    assert not Path("/tmp/sub").exists()


def test_what_was_in_root_before_is_replaced(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "d").mkdir(parents=True)
    (root / "f").write_text("old")
    (root / "d" / "old.txt").write_text("old")
    (root / "s").symlink_to("/tmp")
    extract_layer(_tar([("f", "file", b"new"), ("d", "file", b"not a dir"), ("s", "file", b"no longer a link"),
                        ("x", "dir", None)]), root)
    assert (root / "f").read_bytes() == b"new" and (root / "d").read_bytes() == b"not a dir"
    assert not (root / "s").is_symlink() and (root / "s").read_bytes() == b"no longer a link"
