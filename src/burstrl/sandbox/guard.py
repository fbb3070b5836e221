"""What the daemon does to hold against its own commands, which run as its uid: it makes itself
non-dumpable and, as pid 1 of the sandbox's pid namespace, ignores the signals a command could
send it, reaps the orphans and raises back the OOM scores commands lowered; and where the harness
made the commands a memory cgroup of their own, it puts every command there.

Why a module of its own: these are the defences of a process that has no privilege over the
commands it serves (see `runtime`'s "Protection"), apart from serving requests (`daemon`).
Standard library only: the daemon imports it inside sandbox images.

The commands' cgroup (issue 37; made by `backends.cgroups`). The harness (root) opens the commands'
cgroup.procs for writing and hands the fd to the daemon (`--cgroup-fd`). The kernel checks a write
there with the credentials of whoever opened the file, so the fd can move any process of the
sandbox, the daemon included: the daemon keeps it close-on-exec, gives it to each command's shell at
CGROUP_FD only (posix_spawn's file actions), and that shell's very first action is to move itself
and close it (ENTER_CGROUP), before the cwd, the OOM score and the command's own code. The command
and everything it starts are then in that cgroup and none of them holds the fd. What is left: from
its exec to `exec 9>&-` the shell is a process of the sandbox's uid like any other, and where no LSM
(Yama) says otherwise another command may write its memory through /proc/<pid>/mem (seccomp refuses
ptrace and process_vm_writev, not that file): a race for the few hundred microseconds of a shell's
start. Closing it needs the child made inside the cgroup (clone3's CLONE_INTO_CGROUP, v2 only) or a
non-dumpable spawner living there.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import resource
import signal
import time
from typing import List, Optional, Protocol, Tuple

REAP_INTERVAL_S = 0.5  # how often a pid 1 daemon reaps orphaned zombies and re-raises OOM scores
COMMAND_OOM_SCORE = 1000  # every command's oom_score_adj (runtime.OOM_PREFIX sets it at start)
CGROUP_FD = 9  # where a command's shell finds the commands' cgroup.procs (dash takes one-digit fds only)
# First in every shell command where the daemon holds that fd: "0" is the writer itself, in v1 and
# v2. A command that could not get there does not run (125) rather than run beside the daemon.
ENTER_CGROUP = ("{ echo 0 >&9; } 2>/dev/null || { echo 'sandboxd: cannot enter the commands cgroup' >&2; "
                "exit 125; }; exec 9>&-; ")
# The same for an image without a shell (`runtime.NO_SHELL_ENTER`), when its first argument is "1".
ENTER_CGROUP_PY = ("if sys.argv[1] == '1':\n"
                   "    try:\n        os.write(9, b'0')\n"
                   "    except OSError:\n        sys.stderr.write('sandboxd: cannot enter the commands cgroup\\n')\n"
                   "        os._exit(125)\n"
                   "    os.close(9)\n")


def protect_self() -> None:
    """Make the daemon non-dumpable: commands of the same uid can then neither ptrace it nor read its
    memory or take its fds (`pidfd_getfd`), and its /proc files are not theirs to open.

    What it cannot do unprivileged: lower its own oom_score_adj (commands raise theirs instead, and
    as pid 1 it raises again any a command lowered: `reassert_oom_scores`).
    """
    with contextlib.suppress(Exception):  # ctypes or libc may be missing in a minimal image
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE = 4


def guard_signals() -> None:
    """Stop on SIGTERM/SIGINT, except as pid 1: there a handler would let any command stop the
    daemon with `kill 1` (the kernel drops signals to a namespace's init only where it has none),
    so those signals are ignored and the harness ends the sandbox with /close or SIGKILL from outside.
    """
    if os.getpid() != 1:
        return
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2,
                signal.SIGALRM, signal.SIGTSTP, signal.SIGTTIN, signal.SIGTTOU):
        signal.signal(sig, signal.SIG_IGN)


def reassert_oom_scores(own_pid: int, proc: str = "/proc") -> int:
    """Raise every other process in `proc` whose oom_score_adj is below COMMAND_OOM_SCORE back to it;
    returns how many were raised. Only for a daemon that is pid 1: then `proc` holds its sandbox alone.

    Why: commands start at 1000 so that the OOM killer takes them before the daemon, but any of them
    may set its own score back to the floor it inherited (0) and then a crowd of processes, each
    smaller than the daemon, gets the daemon killed. Unprivileged, the daemon can neither lower its
    own score nor raise that floor (CAP_SYS_RESOURCE); raising a process of its own uid it may. What
    is left is a window of up to REAP_INTERVAL_S. Where the commands have a memory cgroup of their
    own (ENTER_CGROUP) that window no longer matters, as an OOM there never picks the daemon; the
    scores still rank commands against each other and hold where the daemon overran its reserve.
    """
    pids = [name for name in os.listdir(proc) if name.isdigit() and int(name) != own_pid]
    return sum(_raise_oom_score(f"{proc}/{pid}/oom_score_adj") for pid in pids)


def _raise_oom_score(path: str) -> bool:
    """Set one process's oom_score_adj to COMMAND_OOM_SCORE if it is lower; False if it was not
    (or the process is gone, or not ours to change)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        if int(os.read(fd, 16)) >= COMMAND_OOM_SCORE:
            return False
        os.lseek(fd, 0, os.SEEK_SET)
        os.write(fd, str(COMMAND_OOM_SCORE).encode())
        return True
    except (OSError, ValueError):
        return False
    finally:
        os.close(fd)


def own_cgroup_fd(fd: Optional[int]) -> Optional[int]:
    """The daemon's copy of the inherited cgroup.procs fd `fd` (closed): close-on-exec, so that no
    command inherits it by accident, and above CGROUP_FD, so that giving it there is a real dup2."""
    if fd is None:
        return None
    mine = fcntl.fcntl(fd, fcntl.F_DUPFD, CGROUP_FD + 1)
    os.set_inheritable(mine, False)
    os.close(fd)
    return mine


def no_inherited_fds() -> None:
    """Mark every fd above 2 close-on-exec: a command then gets only the fds its spawn names.

    Why: posix_spawn passes on every fd not marked close-on-exec, and the daemon starts with some
    that are not (the listening socket a runtime handed it, whatever a runtime leaves open); a
    command holding the listening socket could accept() the harness's connections (issue 49).
    Called at start and before each spawn (~50 us for ten fds: two syscalls per fd and a listing).
    """
    for fd in _open_fds():
        if fd > 2:
            with contextlib.suppress(OSError):  # closed since the listing (the listing's own fd)
                if os.get_inheritable(fd):
                    os.set_inheritable(fd, False)


def hold_fd_dir() -> None:
    """Keep an fd of this process's /proc/self/fd for `_open_fds`.

    Why: in a commands' pid namespace (`cmdns`) /proc is replaced by that namespace's, where the
    daemon has no entry; the fd still lists the daemon's fds. Call before that /proc is mounted.
    """
    global _FD_DIR
    _FD_DIR = os.open("/proc/self/fd", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)


_FD_DIR: Optional[int] = None


def _open_fds() -> List[int]:
    """The fds open now; without /proc every fd below the soft limit (at most 65536)."""
    try:
        return [int(name) for name in os.listdir("/proc/self/fd" if _FD_DIR is None else _FD_DIR)]
    except OSError:
        return list(range(min(resource.getrlimit(resource.RLIMIT_NOFILE)[0], 65536)))


def cgroup_actions(fd: Optional[int]) -> List[Tuple[int, int, int]]:
    """posix_spawn file actions that give a command's shell the cgroup fd at CGROUP_FD (none without one)."""
    return [] if fd is None else [(os.POSIX_SPAWN_DUP2, fd, CGROUP_FD)]


class Reaper(Protocol):
    """What the reaper thread needs of `runtime.Runtime` (which imports this module)."""

    def reap_orphans(self) -> int: ...


def reap_forever(runtime: Reaper) -> None:
    """A pid 1 daemon's reaper thread: every REAP_INTERVAL_S, reap orphans and raise OOM scores."""
    while True:
        time.sleep(REAP_INTERVAL_S)
        runtime.reap_orphans()
        reassert_oom_scores(os.getpid())
