"""Size-limited directories for a sandbox's writable /work (issue 15, defect 5).

A plain host dir bound at /work lets sandboxed code fill the host's disk. `sized_dir()` turns a
dir into its own filesystem of at most `size_mb`, so a write past it fails with ENOSPC inside and
the host loses at most `size_mb` of disk. Kinds, best first:

- "ext4-loop" (root, loop devices, e2fsprogs): a sparse image `<path>.img` beside the dir, made
  with `mkfs.ext4` (no journal, lazy inode tables: nothing to replay, 0.7 MB written up front for
  1 GB) and mounted `nosuid,nodev` from a loop device attached with direct I/O (written pages
  are not cached twice). The host disk fills only as the sandbox writes, never past `size_mb`.
  The loop device is set to autoclear once mounted: it detaches by itself at the final unmount,
  lazy or not. Files deleted inside give no host blocks back (no `discard`); close() does.
- "tmpfs" (root, no loop devices or no mkfs.ext4): memory-backed, `size=<size_mb>m`. It never
  touches the host disk, but its pages count against the memory cgroup of whoever writes them
  (the sandbox), and swap if any: size the sandbox's memory limit with that in mind.
- "none" (not root, or no mount allowed here): a plain dir, `reason` says why. The caller then
  uses bwrap's own sized tmpfs (`--size`) or runs without a quota.

Usable space is a little below `size_mb` for ext4 (metadata: 973 MiB and 131072 inodes of 1 GiB).

Measured on a 2-core VM (kernel 6.18, e2fsprogs 1.47, util-linux 2.38, host fs ext4), median of
20, sized_dir() (owner chown included) + close(), two runs:

    size       ext4-loop: total (create + close)      tmpfs
    64 MB      30-34 ms (18-26 + 8-12)                4.5-6.5 ms
    1024 MB    22-30 ms (15-21 + 7-9)                 6-6.5 ms
    10240 MB   41-44 ms (29-33 + 11-13)               6.5-9 ms

Of an ext4 create, mkfs is 5 ms (15 ms at 10 GB) and losetup + mount 8-10 ms. A pre-made
template image copied with `cp --sparse=always` instead of mkfs saved 2-3 ms at 1 GB (9 ms at
10 GB): not worth a cache of templates per size. `-N`/`-i` change nothing (lazy inode tables).
Direct I/O: 600 MB written and synced in 0.48-0.54 s against 0.64-0.67 s buffered, with half the
page cache; set at attach time it costs 5 ms, switched on a mounted device 16 ms.

What a crash leaves: the mounted fs (and with it its loop device) and the image file, up to
`size_mb` of host disk; a crash between losetup and mount, an attached loop device without
autoclear (`losetup -d` it). `sweep_sized_dirs()` (or `umount -l` of the mount point followed by
removing the tree) frees them all: once the last user of the lazily unmounted fs is gone, the
loop device detaches (autoclear) and the unlinked image's blocks go back to the host.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

KINDS = ("ext4-loop", "tmpfs")
# Bytes per inode: 8 KiB gives a 1 GB /work 131072 inodes (repos, venvs, node_modules are many
# small files); the inode tables cost 3% of the size and nothing on the host until used.
INODE_RATIO = 8192
MKFS_OPTS = ("-q", "-F", "-O", "^has_journal", "-m", "0", "-i", str(INODE_RATIO),
             "-E", "lazy_itable_init=1,lazy_journal_init=1,nodiscard")
MOUNT_OPTS = "nosuid,nodev"
_SBIN = "/usr/sbin:/sbin:/usr/bin:/bin"


def _tool(name: str) -> str | None:
    """Path of a system tool; /sbin is not on every PATH (sudo, cron, a venv's shell)."""
    return shutil.which(name) or shutil.which(name, path=_SBIN)


def _unescape(field_: str) -> str:
    """A path field of /proc/self/mountinfo: spaces, tabs, newlines, backslashes are octal."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field_)


def _mount_points() -> list[str]:
    """Every mount point this process sees, in mount order."""
    with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
        return [_unescape(line.split()[4]) for line in f]


def _is_mounted(path: Path) -> bool:
    """Whether `path` is a mount point (os.path.ismount misses binds within one filesystem)."""
    return str(path) in _mount_points()


def _run(tool: str, *args: str) -> str:
    """Run a system tool, return its stdout; stderr goes into the error for `reason`."""
    return subprocess.run([_tool(tool) or tool, *args], check=True, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True).stdout.strip()


def _why(exc: Exception) -> str:
    """One line for `reason`."""
    if isinstance(exc, subprocess.CalledProcessError):
        return f"{Path(exc.cmd[0]).name} failed: {(exc.stderr or '').strip() or exc.returncode}"
    return f"{type(exc).__name__}: {exc}"


def _unmount(path: Path) -> None:
    """Unmount `path`, lazily when busy (a sandbox process may still hold it open)."""
    try:
        _run("umount", str(path))
    except subprocess.CalledProcessError:
        if _is_mounted(path):
            _run("umount", "-l", str(path))


@dataclass
class SizedDir:
    """A dir that is its own filesystem of at most `size_mb` (or, kind "none", a plain dir)."""

    kind: str
    path: Path
    size_mb: int
    reason: str = ""
    image: Path | None = None
    closed: bool = field(default=False, compare=False)

    def close(self) -> None:
        """Unmount (lazily if busy), remove the image and the then empty mount point.

        Idempotent. Never deletes recursively: after the unmount only os.rmdir runs on the mount
        point, which fails rather than remove anything through a mount still there. For kind
        "none" the dir and what was written into it stay (they are the caller's to remove).
        """
        if self.closed:
            return
        if self.kind != "none":
            if _is_mounted(self.path):
                _unmount(self.path)
            if _is_mounted(self.path):
                raise OSError(errno.EBUSY, "still mounted after umount -l", str(self.path))
            if self.image is not None:
                with contextlib.suppress(FileNotFoundError):
                    self.image.unlink()
            with contextlib.suppress(FileNotFoundError):
                self.path.rmdir()
        self.closed = True


def _prepare(path: Path) -> None:
    """Make `path` an empty dir that is not a mount point: the mount must hide nothing."""
    path.mkdir(parents=True, exist_ok=True)
    if any(path.iterdir()):
        raise FileExistsError(errno.ENOTEMPTY, "not empty", str(path))
    if _is_mounted(path):
        raise FileExistsError(errno.EBUSY, "already a mount point", str(path))


def _make_ext4(path: Path, size_mb: int) -> Path:
    """The "ext4-loop" kind; returns the image. Leaves nothing behind when it fails."""
    if _tool("mkfs.ext4") is None:
        raise FileNotFoundError("mkfs.ext4 not found (Debian package e2fsprogs)")
    if not Path("/dev/loop-control").exists() and not any(Path("/dev").glob("loop[0-9]*")):
        raise FileNotFoundError("no loop devices (/dev/loop-control; modprobe loop)")
    image = path.with_name(path.name + ".img")
    fd = os.open(image, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        try:
            os.ftruncate(fd, size_mb << 20)
        finally:
            os.close(fd)
        _run("mkfs.ext4", *MKFS_OPTS, str(image))
        try:  # direct I/O set when attaching: 5 ms, against 16 ms to switch a mounted one
            dev = _run("losetup", "--find", "--show", "--direct-io=on", str(image))
        except (OSError, subprocess.CalledProcessError):
            _run("mount", "-t", "ext4", "-o", f"loop,{MOUNT_OPTS}", str(image), str(path))
        else:
            try:
                _run("mount", "-t", "ext4", "-o", MOUNT_OPTS, dev, str(path))
            finally:  # mounted: sets autoclear (detach at the last unmount); else detaches now
                _run("losetup", "-d", dev)
    except BaseException:
        image.unlink(missing_ok=True)
        raise
    with contextlib.suppress(OSError):
        (path / "lost+found").rmdir()  # only fsck wants it; the sandbox should see an empty dir
    return image


def sized_dir(path: Path, size_mb: int, owner: tuple[int, int] | None = None,
              kinds: tuple[str, ...] = KINDS) -> SizedDir:
    """Make `path` (absent or an empty dir) a filesystem of at most `size_mb` MiB.

    Tries `kinds` in order ("ext4-loop", then "tmpfs"); falls back to kind "none" (a plain dir,
    the reasons in `reason`) when not root or nothing can be mounted. `owner` (uid, gid) gets the
    root dir, so an unprivileged sandbox user can write it. Errors of the caller (a non-empty
    dir, an image file already there, size_mb < 1) raise instead of falling back.
    """
    if size_mb < 1:
        raise ValueError(f"size_mb must be >= 1, got {size_mb}")
    path = Path(os.path.realpath(path))  # as /proc/self/mountinfo will name it
    _prepare(path)
    if path.with_name(path.name + ".img").exists():
        raise FileExistsError(errno.EEXIST, "image already there", f"{path}.img")
    reasons: list[str] = []
    result: SizedDir | None = None
    if os.geteuid() != 0:
        reasons.append("not root: no mounts")
    else:
        for kind in kinds:
            try:
                if kind == "ext4-loop":
                    result = SizedDir(kind, path, size_mb, image=_make_ext4(path, size_mb))
                elif kind == "tmpfs":
                    opts = f"size={size_mb}m,{MOUNT_OPTS},mode=0755"
                    _run("mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path))
                    result = SizedDir(kind, path, size_mb)
                else:
                    raise ValueError(f"unknown kind {kind!r}")
            except (OSError, subprocess.CalledProcessError) as exc:
                reasons.append(f"{kind}: {_why(exc)}")
                continue
            break
    if result is None:
        result = SizedDir("none", path, size_mb)
    result.reason = "; ".join(reasons)
    if owner is not None:
        try:
            os.chown(path, *owner)
        except OSError:
            if result.kind != "none":
                result.close()
                raise
    return result


def sweep_sized_dirs(parent: Path) -> int:
    """Lazily unmount every mount below `parent`, deepest first; returns how many it unmounted.

    For the owner's sweep of `<state_dir>/<id>` trees a crash left: after this, removing the tree
    (images included) is safe and frees the host disk once the last user of each fs is gone.
    """
    base = str(Path(os.path.realpath(parent))).rstrip("/") + "/"
    points = sorted((p for p in _mount_points() if p.startswith(base)),
                    key=lambda p: p.count("/"), reverse=True)
    done = 0
    for point in points:
        try:
            _run("umount", "-l", point)
            done += 1
        except subprocess.CalledProcessError:
            pass  # gone already (under a parent unmounted before it), or not ours to unmount
    return done
