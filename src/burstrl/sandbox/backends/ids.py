"""Which host uid and gid a sandbox's processes run as, and, run as root, the lease that gives each
sandbox an id of its own.

Why a module of its own: the kernel counts some resources per host uid (inotify instances and
watches, pending signals, message queue bytes, processes, pipe pages), and namespaces do not
divide those counts; sandboxes that share a uid share them, so one could use up what the others
(and, under the harness's uid, the harness) need (issue 37). Choosing the id and holding it for a
sandbox's whole life, across every harness on the machine, is its own concern, apart from how a
backend starts the sandbox.
"""

from __future__ import annotations

import fcntl
import os
import secrets
import shutil
from pathlib import Path

NOBODY = 65534
# Run as root, each sandbox leases a host uid (and the gid of the same number) of its own, so the
# kernel's per-uid counts (inotify instances and watches, pending signals, message queue bytes,
# processes, pipe pages) are never shared between sandboxes: from root's subordinate ids
# (/etc/subuid and /etc/subgid) where the OS gives them, else this block, above the ids systemd
# hands to containers (524288-1879048191). Inside, the sandbox's uid still reads as nobody.
ID_BLOCK = (0x70000000, 65536)
LEASE_DIR = Path("/run/burstrl-sandbox-ids")


def sandbox_ids(uid: int | None, gid: int | None) -> tuple[int | None, int | None]:
    """The host uid/gid sandboxed code runs as: None (our own) unless we are root, where it is
    `uid` or nobody. Never 0: root inside would be root on the host (the core_pattern escape)."""
    if os.geteuid() != 0:
        return None, None
    uid = NOBODY if uid is None else uid
    gid = uid if gid is None else gid
    if uid == 0 or gid == 0:
        raise ValueError("sandbox_uid/sandbox_gid 0 would run sandboxed code as host root")
    if shutil.which("setpriv") is None:
        raise RuntimeError("running as root needs setpriv (util-linux) to drop to the sandbox uid")
    return uid, gid


class IdLease:
    """A host id (uid and gid) held for one sandbox: an exclusive flock on `LEASE_DIR/<id>`, let go
    at close or when the harness dies, so no two sandboxes, of this harness or another on the same
    machine, ever hold the same id: as root from `LEASE_DIR`, as an ordinary user with subordinate
    ids from a dir of that user's own (`subids`).

    The file goes at release (unlinked while locked); a contender that opened it just before
    then holds a lock on a file no longer at that path, sees so and tries the next id."""

    def __init__(self, first: int, count: int, directory: Path = LEASE_DIR) -> None:
        self.dir = directory  # an ordinary user's leases of its subordinate ids: `subids.lease`
        directory.mkdir(mode=0o700, exist_ok=True)
        start = secrets.randbelow(count)  # from anywhere in the block: few lock files to try
        for i in range(count):
            self.id = first + (start + i) % count
            self._fd = self._lock(directory / str(self.id))
            if self._fd is not None:
                return
        raise RuntimeError(f"every sandbox id of {first}-{first + count - 1} is leased")

    @staticmethod
    def _lock(path: Path) -> int | None:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if os.fstat(fd).st_ino == os.stat(path, follow_symlinks=False).st_ino:
                return fd
        except (BlockingIOError, FileNotFoundError):
            pass
        os.close(fd)
        return None

    def release(self) -> None:
        (self.dir / str(self.id)).unlink(missing_ok=True)
        os.close(self._fd)


def id_block(user: str = "root") -> tuple[int, int]:
    """(first id, count) that sandboxes lease ids from: `user`'s subordinate ids where a range of
    /etc/subuid is also one of /etc/subgid (so a sandbox's uid and gid are one number), else
    `ID_BLOCK`."""
    gids = set(subordinate(Path("/etc/subgid"), user, "0"))
    both = [r for r in subordinate(Path("/etc/subuid"), user, "0") if r in gids]
    return both[0] if both else ID_BLOCK


def subordinate(path: Path, *owners: str) -> list[tuple[int, int]]:
    """The (first, count) ranges of /etc/subuid or /etc/subgid (`path`) whose owner field is one of
    `owners` (a name or a uid, as shadow's newuidmap reads them), in file order."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return []
    ranges = []
    for line in lines:
        parts = line.strip().split(":")
        if len(parts) == 3 and parts[0] in owners and parts[1].isdigit() and parts[2].isdigit():
            ranges.append((int(parts[1]), int(parts[2])))
    return ranges
