"""An ordinary user's sandbox in a user namespace of its own, mapped to a subordinate host uid where
the OS offers one (issue 49, item 4).

Why: run by an ordinary user, bwrap maps the sandbox's uid to the harness's own, so every count the
kernel keeps per host uid was one count for the harness and all of its sandboxes. What the OS
offers an unprivileged user: a range of /etc/subuid and /etc/subgid and the setuid helpers
newuidmap/newgidmap (Debian: package uidmap). With them each sandbox starts in an outer user
namespace whose root is a subordinate uid leased for that sandbox alone (`IdLease` in a dir of the
user's own), and bwrap runs as that root: its processes and files are that uid's on the host.

What that separates, measured on this kernel (6.18; benchmarks/per_uid_probe.py and
tests/security/test_per_uid_limits.py): counts kept per host uid (the kernel's user_struct): pipe
pages, key quotas, epoll watches (the last by the kernel's source). What it does not: counts kept as ucounts are charged to every user namespace
up to the init namespace's owner, the harness's uid, whatever uid the sandbox is mapped to
(measured: inotify instances, processes, pending signals; so also inotify watches, message queue
bytes, locked memory, user namespaces). Those are bounded per sandbox instead: by its rlimits
(`limits.RLIMITS`; a user namespace takes its creator's as its own total) and by the outer
namespace's own inotify maxima (`limits.USERNS_LIMITS`), written there before any command runs.
Without subordinate ids the outer namespace maps the harness's uid (`unshare --map-root-user`),
which still bounds inotify; `LimitsReport.uid` says which holds.

The mapping itself: `unshare --user` starts the entry process in a fresh namespace and it waits on
its stdin; the harness (the namespace's owner) writes the maps with newuidmap/newgidmap (0 -> the
leased uid, 1 -> the harness's own, so the namespace's root may chown /work to itself), then lets it
go on: write the limits, chown /work, become root (the leased uid), exec bwrap (`--keep-caps`:
the capabilities `unshare` got in the namespace must outlive its exec of the shell). At close the
files of /work, the leased uid's, go from a namespace that maps all of the user's subordinate ids.
"""

from __future__ import annotations

import functools
import os
import pwd
import shlex
import shutil
import stat
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from burstrl.sandbox.backends.ids import IdLease, subordinate
from burstrl.sandbox.backends.launch import kill_group, spawn
from burstrl.sandbox.backends.limits import userns_limits

MAP_TIMEOUT_S = 10.0
HELPERS = ("newuidmap", "newgidmap", "unshare", "setpriv", "chown")


@dataclass(frozen=True)
class Subids:
    """The user's subordinate ids sandboxes lease from, pairwise: offset i is uid `uid + i`, gid `gid + i`."""

    uid: int
    gid: int
    count: int


@dataclass(frozen=True)
class Detected:
    """What holds on this machine for this user, found once per process (`detect`)."""

    sub: Subids | None  # None: no subordinate ids (`why` says why)
    userns: bool  # whether an outer user namespace can be made at all (`unshare --user`)
    why: str


@dataclass
class Outer:
    """One sandbox's outer user namespace: mapped to a leased subordinate uid (`lease`), or to the
    harness's own uid (`why` says why not)."""

    sub: Subids | None
    why: str
    lease: IdLease | None = None

    @property
    def uid(self) -> int | None:
        return None if self.sub is None or self.lease is None else self.sub.uid + self.lease.id

    @property
    def gid(self) -> int | None:
        return None if self.sub is None or self.lease is None else self.sub.gid + self.lease.id

    def share(self, why: str) -> None:
        """Fall back to the harness's uid for this sandbox (its code or image is out of the
        subordinate uid's reach), releasing the lease."""
        if self.lease is not None:
            self.lease.release()
        self.sub, self.lease, self.why = None, None, why


@functools.cache
def detect() -> Detected:
    """Whether an ordinary user's sandboxes can have subordinate uids here: the helpers installed
    and setuid root, a passwd entry (newuidmap needs one), a range in both files, and one real
    mapping that works; and whether an outer namespace with its limits works at all (else bwrap
    alone, as before). Cached: a few file reads and tens of ms of processes, once per process."""
    userns = os.geteuid() != 0 and _run([*outer_args(Outer(None, ""), None), "true"]) == ""
    why = _why_not()
    if why:
        return Detected(None, userns, why)
    pw = pwd.getpwuid(os.getuid())
    owners = (pw.pw_name, str(pw.pw_uid))
    uids, gids = subordinate(Path("/etc/subuid"), *owners), subordinate(Path("/etc/subgid"), *owners)
    if not uids or not gids:
        return Detected(None, userns, f"no range for {pw.pw_name} in /etc/subuid and /etc/subgid")
    sub = Subids(uids[0][0], gids[0][0], min(uids[0][1], gids[0][1]))
    err = _probe(sub)
    return Detected(None if err else sub, userns, err)


def _why_not() -> str:
    """Why subordinate ids cannot be used, before looking at the ranges ("" if nothing stops it)."""
    if os.geteuid() == 0:
        return "run as root: leased host uids instead"
    for name in HELPERS:
        path = shutil.which(name)
        if path is None:
            return f"{name} is not installed (newuidmap/newgidmap: package uidmap)"
        st = os.stat(path)
        if name.startswith("new") and (st.st_uid != 0 or not st.st_mode & stat.S_ISUID):
            return f"{path} is not setuid root"
    try:
        pw = pwd.getpwuid(os.getuid())
    except KeyError:
        return f"uid {os.getuid()} has no passwd entry (newuidmap needs one)"
    if pw.pw_gid != os.getgid():
        return f"the harness's gid {os.getgid()} is not its passwd gid {pw.pw_gid} (newuidmap refuses)"
    return ""


def _run(argv: list[str]) -> str:
    """'' where `argv` exits 0, else what it said."""
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=MAP_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return str(exc)
    return "" if r.returncode == 0 else (r.stderr.strip() or f"exit {r.returncode}")


def _probe(sub: Subids) -> str:
    """'' where a sandbox's mapping (offset 0, nothing run but `true`) works, else why not."""
    outer = Outer(sub, "")
    read, write = os.pipe()
    try:
        proc = subprocess.Popen([*outer_args(outer, None), "true"], stdin=read,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    finally:
        os.close(read)
    try:
        map_ids(proc, sub.uid, sub.gid, write)
        _, err = proc.communicate(timeout=MAP_TIMEOUT_S)
        return "" if proc.returncode == 0 else f"mapped namespace failed: {err.decode(errors='replace').strip()}"
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        proc.kill()
        proc.wait()
        return str(exc)
    finally:
        os.close(write)


def outer(found: Detected) -> Outer | None:
    """One sandbox's outer namespace: a leased subordinate uid where `found` has them and a lease
    is free, else the harness's uid; None where no user namespace can be made (bwrap alone, as before)."""
    if not found.userns:
        return None
    if found.sub is None:
        return Outer(None, found.why)
    directory = Path("/tmp") / f"burstrl-subids-{os.getuid()}"
    try:
        directory.mkdir(mode=0o700, exist_ok=True)
        st = os.lstat(directory)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
            return Outer(None, f"{directory} is not a private dir of this user")
        return Outer(found.sub, "", IdLease(0, found.sub.count, directory))
    except (OSError, RuntimeError) as exc:
        return Outer(None, f"no subordinate uid to lease: {exc}")


def outer_args(outer: Outer, work: Path | None) -> list[str]:
    """The argv prefix that starts the rest of the entry command in `outer`'s namespace: its inotify
    maxima written, /work (`work`) chowned to its root, and, mapped to a subordinate uid, as that
    root (after `map_ids` has written the maps and a line on stdin lets it go on)."""
    limits = " && ".join(f"echo {limit.value} > /proc/sys/user/{limit.name}" for limit in userns_limits())
    if outer.sub is None:
        return ["unshare", "--user", "--map-root-user", "--", "/bin/sh", "-c", f'{limits} && exec "$@"', "sh"]
    chown = f"chown -R -h -P 0:0 -- {shlex.quote(str(work))} && " if work is not None else ""
    script = (f"read -r _ && exec 0</dev/null && {limits} && {chown}"
              'exec setpriv --reuid=0 --regid=0 --clear-groups "$@"')
    return ["unshare", "--user", "--keep-caps", "--", "/bin/sh", "-c", script, "sh"]


def spawn_mapped(argv: list[str], env: dict[str, str], log: Path, fds: Sequence[int],
                 outer: Outer | None) -> subprocess.Popen[bytes]:
    """`launch.spawn`, and where `outer` has a subordinate uid, its maps written (`map_ids`)."""
    if outer is None or outer.uid is None or outer.gid is None:
        return spawn(argv, env, log, pass_fds=fds)
    read, write = os.pipe()
    try:
        proc = spawn(argv, env, log, pass_fds=fds, stdin=read)
    finally:
        os.close(read)
    try:
        map_ids(proc, outer.uid, outer.gid, write)
    except BaseException:
        kill_group(proc)
        raise
    finally:
        os.close(write)
    return proc


def map_ids(proc: subprocess.Popen[bytes], uid: int, gid: int, go: int) -> None:
    """Once `proc` is in its new user namespace, map its 0 to `uid`/`gid` and its 1 to the
    harness's own ids, then write the line on `go` (its stdin) that lets it go on."""
    pid, own = proc.pid, os.readlink("/proc/self/ns/user")
    deadline = time.monotonic() + MAP_TIMEOUT_S
    while _userns(pid) in (own, None):
        if proc.poll() is not None:
            raise RuntimeError(f"the sandbox's entry process ended (rc={proc.returncode}) before its mapping")
        if time.monotonic() > deadline:
            raise RuntimeError(f"no user namespace for the sandbox after {MAP_TIMEOUT_S:.0f}s")
        time.sleep(0.0002)
    helpers = [subprocess.Popen([helper, str(pid), "0", str(first), "1", "1", str(ours), "1"],
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
               for helper, first, ours in (("newuidmap", uid, os.getuid()), ("newgidmap", gid, os.getgid()))]
    errors = [p.communicate(timeout=MAP_TIMEOUT_S)[1].decode(errors="replace").strip() for p in helpers]
    failed = [f"{p.args[0]}: {err or p.returncode}" for p, err in zip(helpers, errors, strict=True) if p.returncode != 0]
    if failed:
        raise RuntimeError("mapping the sandbox's ids failed: " + "; ".join(failed))
    os.write(go, b"go\n")  # both at once: the two setuid helpers are most of the mapping's cost


def _userns(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/user")
    except OSError:
        return None


def remove_owned(path: Path, sub: Subids) -> str:
    """Remove `path`, which holds files of subordinate uids, from a user namespace mapping all of
    `sub` (its caps there cover them; the harness's own files stay the harness's to remove).
    '' on success, else what went wrong."""
    if not path.exists():
        return ""
    return _run(["unshare", "--user", "--keep-caps", f"--map-users={sub.uid},0,{sub.count}",
                 f"--map-groups={sub.gid},0,{sub.count}", "rm", "-rf", "--one-file-system", "--", str(path)])


def uid_report(outer: Outer | None, why: str = "") -> str:
    """`LimitsReport.uid` for an ordinary user's sandbox: which per-uid counts it shares with whom."""
    own, bounded = os.getuid(), _bounded(outer is not None)
    chain = (f"processes (RLIMIT_NPROC), pending signals, locked memory, message queue bytes (within its "
             f"rlimits), {bounded}")
    if outer is not None and outer.uid is not None:
        return (f"own subordinate uid {outer.uid} (newuidmap): pipe pages, epoll watches and key quotas are "
                f"its own; still charged to the harness's uid {own} (a user namespace's owner): {chain}")
    reason = why or (outer.why if outer is not None else "no user namespace of its own")
    return (f"shared with the harness's uid {own} ({reason}): pipe pages, epoll watches, key quotas, {chain}")


def _bounded(held: bool) -> str:
    if not held:
        return "inotify instances and watches (unbounded)"
    return " and ".join(f"{limit.name.removeprefix('max_').replace('_', ' ')} at most {limit.value}"
                        for limit in userns_limits()) + " (its user namespace's own maxima)"
