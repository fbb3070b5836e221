"""Sized dirs for /work (issue 15, defect 5): a write past the quota fails with ENOSPC inside and
the host's disk loses at most the quota. Real mounts: needs root, and each kind skips where this
machine cannot make it (no loop devices, no mkfs.ext4, no mount allowed in this container).
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from burstrl.sandbox.backends import quota
from burstrl.sandbox.backends.quota import SizedDir, sized_dir, sweep_sized_dirs

ROOT = os.geteuid() == 0
MB = 1 << 20
SIZE = 32
OWNER = (65534, 65534)
needs_root = pytest.mark.skipif(not ROOT, reason="mounting a sized dir needs root")


def _mounted(path: Path) -> bool:
    return str(path) in quota._mount_points()


def _attached(image: Path) -> bool:
    """Whether a loop device still has `image` as its backing file (deleted or not)."""
    losetup = quota._tool("losetup")
    if losetup is None:
        return False
    out = subprocess.run([losetup, "-a"], capture_output=True, text=True, check=True).stdout
    return f"({image})" in out or f"({image} (deleted))" in out


def _wait_detached(image: Path, timeout: float = 5.0) -> bool:
    """The kernel detaches an autoclear loop device asynchronously after the last unmount."""
    end = time.monotonic() + timeout
    while _attached(image):
        if time.monotonic() > end:
            return False
        time.sleep(0.05)
    return True


def _fill(path: Path, mb: int) -> tuple[int, int | None]:
    """Write up to `mb` MiB into `path` in 1 MiB chunks; returns (bytes written, errno or None)."""
    chunk, done = b"\xa5" * MB, 0
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for _ in range(mb):
            done += os.write(fd, chunk)
        os.fsync(fd)
    except OSError as exc:
        return done, exc.errno
    finally:
        os.close(fd)
    return done, None


def _overlay(lower: Path, q: Path, work: Path) -> subprocess.CompletedProcess[str]:
    """Mount an overlay at `work` whose upper and work dirs live inside the sized dir `q`."""
    (q / "upper").mkdir()
    (q / "ovwork").mkdir()
    work.mkdir()
    opts = f"lowerdir={lower},upperdir={q / 'upper'},workdir={q / 'ovwork'}"
    return subprocess.run([quota._tool("mount") or "mount", "-t", "overlay", "-o", opts, "overlay",
                           str(work)], check=False, capture_output=True, text=True)


@pytest.fixture(params=["ext4-loop", "tmpfs"])
def make(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator:
    """sized_dir() of one kind only; skips when this machine cannot make that kind."""
    if not ROOT:
        pytest.skip("mounting a sized dir needs root")
    made: list[SizedDir] = []

    def _make(path: Path, size_mb: int = SIZE, owner: tuple[int, int] | None = None) -> SizedDir:
        d = sized_dir(path, size_mb, owner=owner, kinds=(request.param,))
        made.append(d)
        if d.kind != request.param:
            pytest.skip(f"{request.param} cannot be made here: {d.reason}")
        return d

    yield _make
    for d in made:
        d.close()


def test_under_the_limit_works_and_owner_applies(make, tmp_path: Path) -> None:
    d = make(tmp_path / "work", owner=OWNER)
    st = os.stat(d.path)
    assert (st.st_uid, st.st_gid) == OWNER and st.st_mode & 0o7777 == 0o755
    assert list(d.path.iterdir()) == []  # no lost+found
    assert _mounted(d.path) and d.reason == ""
    assert _fill(d.path / "f", SIZE // 2) == (SIZE // 2 * MB, None)
    assert (d.path / "f").stat().st_size == SIZE // 2 * MB


def test_over_the_limit_is_enospc_and_the_host_disk_barely_moves(make, tmp_path: Path) -> None:
    d = make(tmp_path / "work")
    free0 = shutil.disk_usage(tmp_path).free
    written, err = _fill(d.path / "big", 4 * SIZE)
    assert err == errno.ENOSPC
    assert SIZE * MB * 3 // 4 <= written <= SIZE * MB
    used = free0 - shutil.disk_usage(tmp_path).free
    assert used <= (SIZE + 24) * MB, f"host disk lost {used / MB:.1f} MiB for a {SIZE} MiB quota"
    if d.image is not None:
        assert d.image.stat().st_blocks * 512 <= SIZE * MB
    (d.path / "big").unlink()  # space comes back inside
    assert _fill(d.path / "again", SIZE // 2)[1] is None


def test_close_leaves_nothing_and_twice_is_fine(make, tmp_path: Path) -> None:
    d = make(tmp_path / "work", owner=OWNER)
    _fill(d.path / "f", 4)
    d.close()
    assert not _mounted(d.path) and not d.path.exists()
    assert list(tmp_path.iterdir()) == []  # image included
    if d.image is not None:
        assert _wait_detached(d.image), "loop device still attached"
    d.close()


def test_close_while_busy_unmounts_lazily(make, tmp_path: Path) -> None:
    d = make(tmp_path / "work")
    fd = os.open(d.path / "held", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        d.close()
        assert not _mounted(d.path) and not d.path.exists()
        os.write(fd, b"still writable through the open fd")
    finally:
        os.close(fd)
    if d.image is not None:
        assert not d.image.exists() and _wait_detached(d.image)


def test_overlay_with_upper_inside_the_sized_dir_hits_the_limit(make, tmp_path: Path) -> None:
    lower, work = tmp_path / "lower", tmp_path / "work"
    lower.mkdir()
    (lower / "from-image").write_text("lower\n")
    q = make(tmp_path / "q")
    r = _overlay(lower, q.path, work)
    if r.returncode != 0:
        pytest.skip(f"overlayfs on {q.kind} cannot be mounted here: {r.stderr.strip()}")
    try:
        assert (work / "from-image").read_text() == "lower\n"
        written, err = _fill(work / "big", 4 * SIZE)
        assert err == errno.ENOSPC and written <= SIZE * MB
        assert not (lower / "big").exists()
    finally:
        subprocess.run([quota._tool("umount") or "umount", "-l", str(work)], check=True)
    q.close()
    assert not _mounted(q.path) and not q.path.exists()


def test_sweep_after_a_crash_frees_everything(make, tmp_path: Path) -> None:
    """What the owner sweep meets after a crash: sized dirs (one under an overlay) never closed."""
    state = tmp_path / "state"
    a = make(state / "a" / "work")
    b = make(state / "b" / "q")
    (state / "b" / "lower").mkdir()
    overlay = _overlay(state / "b" / "lower", b.path, state / "b" / "work").returncode == 0
    _fill(a.path / "f", 4)
    assert sweep_sized_dirs(state) == 2 + overlay
    assert not any(p.startswith(str(state)) for p in quota._mount_points())
    shutil.rmtree(state)  # safe now: nothing mounted below
    for d in (a, b):
        if d.image is not None:
            assert _wait_detached(d.image), f"loop device of {d.image} still attached"
    a.close()  # a close() after the sweep is harmless
    b.close()


@needs_root
def test_without_mkfs_falls_back_to_tmpfs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = quota._tool
    monkeypatch.setattr(quota, "_tool", lambda name: None if name == "mkfs.ext4" else real(name))
    d = sized_dir(tmp_path / "work", SIZE)
    try:
        if d.kind == "none":
            pytest.skip(f"no mounts allowed here: {d.reason}")
        assert d.kind == "tmpfs" and "e2fsprogs" in d.reason
        assert not (tmp_path / "work.img").exists()
    finally:
        d.close()


def test_not_root_gives_a_plain_dir_with_the_reason(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(quota.os, "geteuid", lambda: 1000)
    d = sized_dir(tmp_path / "work", SIZE)
    assert (d.kind, d.reason) == ("none", "not root: no mounts")
    assert d.path.is_dir() and not _mounted(d.path)
    (d.path / "kept").write_text("x")
    d.close()
    d.close()
    assert (d.path / "kept").exists()  # kind "none": the caller's to remove


def test_refuses_a_dir_that_is_not_empty(tmp_path: Path) -> None:
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / "x").write_text("x")
    with pytest.raises(FileExistsError):
        sized_dir(tmp_path / "work", SIZE)
    with pytest.raises(ValueError):
        sized_dir(tmp_path / "other", 0)
