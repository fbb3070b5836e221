"""The rlimits every process of a sandbox starts with: one table (`RLIMITS`), on every backend.

Why a module of its own: an rlimit a sandbox inherits is the harness's choice for itself, and
several (locked memory, message queue bytes, pending signals, processes) are counted per host uid,
so a sandbox left at the inherited values could take its uid's whole count (issue 37). The table
and the reason for each line are what a reviewer checks; the namespace backend applies it with
`prlimit`, the OCI backend in config.json.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Protocol


class _Spec(Protocol):
    """What the limits read of a `base.SandboxSpec` (not imported: base depends on this module's users)."""

    pids_limit: int


@dataclass(frozen=True)
class Rlimit:
    """A resource limit every process of a sandbox starts with, on every backend, whatever the
    harness's own is: an inherited limit is the harness's choice for itself (20,000 open files
    here), not one made for the sandbox."""

    name: str  # the kernel's name, as OCI's config.json spells it
    soft: int
    hard: int
    why: str

    def option(self) -> str:
        """As util-linux `prlimit` takes it (`--nofile=1024:4096`)."""
        return f"--{PRLIMIT_OPTIONS[self.name]}={self.soft}:{self.hard}"


# The one table of sandbox rlimits. The per-uid ones (locked memory, message queue bytes, pending
# signals, and processes) are counted per host uid: a low limit inside bounds what one sandbox takes
# of its uid's count, and with it what is left to the harness when the sandbox runs as the harness's uid.
RLIMITS = (
    Rlimit("RLIMIT_NOFILE", 1024, 4096, "open files per process: 1024 as runc and runsc always gave, so "
           "select() users stay safe; a program that needs more may raise its own to 4096"),
    Rlimit("RLIMIT_MEMLOCK", 64 << 10, 64 << 10, "locked memory is never reclaimed, and SHM_LOCK charges it "
           "per host uid; the kernel's old default, enough for gpg-style secrets"),
    Rlimit("RLIMIT_MSGQUEUE", 819200, 819200, "POSIX message queue bytes, counted per host uid "
           "(the ipc namespace divides the queues, not the count): the kernel's default"),
    Rlimit("RLIMIT_SIGPENDING", 1024, 1024, "queued signals, counted per host uid: the default (~96k "
           "here, scaled by RAM) let one sandbox take all of its uid's"),
    Rlimit("RLIMIT_CORE", 0, 0, "no core files: a crashed hog's dump would fill /work's quota"),
)
NPROC_WHY = ("processes, counted per host uid (so shared by every sandbox of that uid): only where no pids "
             "cgroup holds the sandbox")
PRLIMIT_OPTIONS = {"RLIMIT_NOFILE": "nofile", "RLIMIT_MEMLOCK": "memlock", "RLIMIT_MSGQUEUE": "msgqueue",
                   "RLIMIT_SIGPENDING": "sigpending", "RLIMIT_CORE": "core", "RLIMIT_NPROC": "nproc"}


@dataclass(frozen=True)
class UsernsLimit:
    """A per-uid count an ordinary user's sandbox may take at most, held by its own user namespace
    (`/proc/sys/user/<name>` there, written before any command runs: `subids`).

    Why: the kernel charges these counts (ucounts) to every user namespace up to the init
    namespace's owner, which is the harness's uid whatever uid the sandbox is mapped to (measured:
    a command holding 128 inotify instances made the harness's inotify_init fail with EMFILE, with
    or without a subordinate uid). The namespace's own maximum bounds what one sandbox takes; the
    rest stays the harness's."""

    name: str
    value: int
    why: str


USERNS_LIMITS = (
    UsernsLimit("max_inotify_instances", 8, "of the host's 128 per uid (fs.inotify.max_user_instances): "
                "a watcher, an editor or node need one or two"),
    UsernsLimit("max_inotify_watches", 8192, "of the host's per-uid watches (fs.inotify.max_user_watches, "
                "~190k here): enough to watch a task repo's tree"),
)


def userns_limits() -> tuple[UsernsLimit, ...]:
    """`USERNS_LIMITS`, each at most half the host's own maximum (a host set lower keeps its half)."""
    host = {"max_inotify_instances": "fs/inotify/max_user_instances",
            "max_inotify_watches": "fs/inotify/max_user_watches"}
    out = []
    for limit in USERNS_LIMITS:
        try:
            own = int(open(f"/proc/sys/{host[limit.name]}").read())
        except (OSError, ValueError):
            own = limit.value * 2
        out.append(UsernsLimit(limit.name, max(1, min(limit.value, own // 2)), limit.why))
    return tuple(out)


def sandbox_rlimits(spec: _Spec, pids_by_cgroup: bool) -> tuple[Rlimit, ...]:
    """`RLIMITS`, plus RLIMIT_NPROC at the pids limit where no cgroup holds pids; run by an ordinary
    user, each hard limit at most the harness's own (only root may raise one)."""
    table = RLIMITS if pids_by_cgroup else (*RLIMITS, Rlimit("RLIMIT_NPROC", spec.pids_limit,
                                                              spec.pids_limit, NPROC_WHY))
    return table if os.geteuid() == 0 else tuple(_within_own(r) for r in table)


def _within_own(limit: Rlimit) -> Rlimit:
    import resource

    own = resource.getrlimit(getattr(resource, limit.name))[1]
    if own == resource.RLIM_INFINITY or own >= limit.hard:
        return limit
    return Rlimit(limit.name, min(limit.soft, own), own, limit.why)
