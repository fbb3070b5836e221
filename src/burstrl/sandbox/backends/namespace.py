"""The default backend: bubblewrap (bwrap) namespaces, the daemon as the entry process.

Each sandbox gets new user, mount, pid, ipc, uts, cgroup and network namespaces (no network at
all: only its own loopback), no capabilities, a read-only base (the host's system dirs, or an
image's merged root from the LayerCache), its own writable /work and /tmp, and the daemon's code
read-only at /opt/burstrl. Limits go through cgroups where the machine allows it.

Run as root (CI, GPU pods), the harness never hands root to sandboxed code: bwrap, the daemon
and every command run as an unprivileged host uid (`sandbox_uid` if given, else one leased for
that sandbox alone: `ids.IdLease`, read as nobody inside), so the user namespace maps the inside uid
to it; /proc/sys (and /proc/sysrq-trigger where the kernel
has it) are read-only inside. What stays visible in /proc/self/mountinfo: the host path of each
bind source within its filesystem (the host's /usr, /etc, ..., the daemon's code; /work is a
filesystem of its own or an overlay whose options name its dirs). bwrap has no way to hide a
bind's root field; with /proc/sys read-only and no host uid 0 the path is not a way out.

Run by an ordinary user, each sandbox starts in a user namespace of its own (`subids`) whose root
bwrap runs as: a subordinate host uid leased for that sandbox where the OS offers one (newuidmap),
else the harness's uid; that namespace's own inotify maxima bound what the sandbox takes of the
per-uid counts it still shares with the harness (`LimitsReport.uid` says which).

The daemon's socket is made here and inherited (`Handover`), the token through a pipe: no
socket dir is mounted inside. So is, where the sandbox's memory cgroup got a child for the commands
(as root: `cgroups`), a write fd of that child's cgroup.procs (`--cgroup-fd`): every command moves
itself there first, and an OOM there never picks the daemon (`guard`). A seccomp filter
(`seccomp.py`) goes in through `--seccomp`. Every process starts with `limits.RLIMITS` (set by
`prlimit` before the drop), not the harness's own.

Close holds no cgroup to wait on when run by an ordinary user: it waits on a pidfd of the daemon,
pid 1 of the sandbox's pid namespace, which the kernel signals only once every other process of
that namespace is gone (`PidNamespace`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import secrets
import select
import shutil
import signal
import subprocess
from pathlib import Path
from typing import Any

from burstrl.sandbox.backends import cgroups, seccomp, subids
from burstrl.sandbox.backends.base import (
    CLOSE_GRACE_S,
    CODE_MOUNT,
    GONE_WAIT_S,
    SOCKET_NAME,
    Handover,
    LimitsReport,
    Sandbox,
    SandboxNotGone,
    SandboxSpec,
    SandboxState,
    daemon_argv,
    make_run_dir,
    process_start_time,
    remove_tree,
    src_dir,
    trusted_client,
    warn_once,
    write_owner,
)
from burstrl.sandbox.backends.cgroups import CgroupSet
from burstrl.sandbox.backends.ids import NOBODY, IdLease, id_block, sandbox_ids
from burstrl.sandbox.backends.launch import kill_group, wait_ready
from burstrl.sandbox.backends.limits import sandbox_rlimits
from burstrl.sandbox.backends.workdir import disk_report, prepare_root, release_work

HOST_SYSTEM_DIRS = ("usr", "bin", "lib", "lib32", "lib64", "libx32", "sbin", "etc")
# Masked inside the host's /etc (files become empty, dirs empty tmpfs).
HOST_SECRETS = ("/etc/shadow", "/etc/gshadow", "/etc/shadow-", "/etc/gshadow-", "/etc/ssh", "/etc/ssl/private")
# Image entries the sandbox replaces with its own mounts.
REPLACED = {"proc", "dev", "sys", "tmp", "work", "run"}
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# Runs as the first process, already in the sandbox's cgroups before bwrap execs: every process
# of the sandbox inherits them, so no command runs unlimited even for a moment.
# Then the privilege drop and RLIMIT_NPROC come as argv prefixes (`setpriv`, `prlimit`: util-linux,
# since dash has no `ulimit -u`), so the cgroup writes happen as root and nothing after them does.
_ENTER = 'for f in $BURSTRL_CGROUP_PROCS; do echo $$ > "$f" || exit 125; done; exec "$@"'


@dataclasses.dataclass
class NamespaceState(SandboxState):
    """A bubblewrap sandbox's parts: its cgroups and the binds made for the sandbox uid."""

    cgroups: CgroupSet | None = None
    mounts: list[Path] = dataclasses.field(default_factory=list)  # unmounted before the dir is removed
    pid_ns: PidNamespace | None = None  # the daemon's pid namespace, once it is ready
    outer: subids.Outer | None = None  # run by an ordinary user: its own user namespace (`subids`)


def default_state_dir() -> Path:
    """Short on purpose: the daemon's unix socket path must fit in 107 bytes."""
    return Path("/tmp") / f"burstrl-sbx-{os.getuid()}"


class NamespaceBackend:
    """Creates bubblewrap sandboxes under `state_dir/<id>/` (work, run, log, owner.json)."""

    name = "namespace"

    def __init__(self, state_dir: Path | None = None, layer_cache: Any = None,
                 bwrap: str = "bwrap", sandbox_uid: int | None = None,
                 sandbox_gid: int | None = None) -> None:
        self.state_dir = Path(state_dir or default_state_dir())
        self.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.layer_cache = layer_cache
        self.bwrap = shutil.which(bwrap) or bwrap
        self.uid, self.gid = sandbox_ids(sandbox_uid, sandbox_gid)
        # As root with no uid given: one leased uid per sandbox, instead of nobody for all.
        self.id_block = id_block() if os.geteuid() == 0 and sandbox_uid is None else None
        # Run by an ordinary user: what the OS offers for uids of the sandboxes' own (once per process).
        self.found = subids.detect() if self.uid is None else None
        if self.uid is not None or (self.found and self.found.sub):  # bwrap, as another uid, must
            os.chmod(self.state_dir, 0o711)  # reach its bind sources under state_dir

    def create(self, spec: SandboxSpec) -> Sandbox:
        sid = secrets.token_hex(4)
        path = self.state_dir / sid
        other = self.uid is not None or bool(self.found and self.found.sub)
        path.mkdir(mode=0o711 if other else 0o700)
        state = NamespaceState(path=path, uid=self.uid, gid=self.gid)
        try:
            if self.id_block is not None:
                state.lease = IdLease(*self.id_block)
                state.uid = state.gid = state.lease.id
            elif self.found is not None:
                state.outer = subids.outer(self.found)
            return self._start(sid, spec, state)
        except BaseException:
            _teardown(state, self.layer_cache)
            raise

    def _start(self, sid: str, spec: SandboxSpec, state: NamespaceState) -> Sandbox:
        path = state.path
        run, token = make_run_dir(path, token_file=False)
        code = self._reachable(src_dir(), path / "code", state)
        (path / "work").mkdir()
        base = self._base_args(spec, path / "work", state)
        if state.uid is not None:
            hand_over([path / "work"], state.uid, state.gid)
        cg = cgroups.create(sid, spec)
        state.cgroups = cg
        report = dataclasses.replace(_report(cg.report), disk=disk_report(state)[0], uid=_uid_report(state))
        env = {"PATH": PATH, "BURSTRL_CGROUP_PROCS": " ".join(map(str, cg.procs_files))}
        handover, filter_fd = Handover(run, token), seccomp.write_program_fd()
        cgroup_fd = cg.open_cmds_procs()
        fds = (*handover.fds, filter_fd, *([] if cgroup_fd is None else [cgroup_fd]))
        argv = ["/bin/sh", "-c", _ENTER, "sh", *self._prefix(spec, report, state),
                *(subids.outer_args(state.outer, path / "work") if state.outer else []), self.bwrap, *base,
                *_uid_args(state),
                *self._common_args(run, code, spec, state.image_env), "--seccomp", str(filter_fd),
                *daemon_argv(fds=handover.fds), *cgroup_fd_args(cgroup_fd)]
        write_owner(path, cgroups=[str(d) for d in cg.dirs])
        log = path / "daemon.log"
        try:
            proc = subids.spawn_mapped(argv, env, log, fds, state.outer)
        finally:
            handover.close()  # the daemon holds them now; our copies would keep a dead daemon's socket open
            os.close(filter_fd)
            if cgroup_fd is not None:
                os.close(cgroup_fd)
        state.proc = proc
        write_owner(path, cgroups=[str(d) for d in cg.dirs], pid=proc.pid,
                    pid_start=process_start_time(proc.pid))
        wait_ready(proc, spec.start_timeout_s, log)
        state.pid_ns = PidNamespace(namespace_init(proc.pid))
        client = trusted_client(run / SOCKET_NAME, token)
        return Sandbox(sid, client, report, path, lambda: _close(state, client, self.layer_cache))

    def _prefix(self, spec: SandboxSpec, report: LimitsReport, state: NamespaceState) -> list[str]:
        """The sandbox's rlimits (`limits.RLIMITS`, RLIMIT_NPROC where no cgroup holds pids), then
        (as root) the drop to the sandbox uid: setting them first lets root raise a hard limit."""
        limits = sandbox_rlimits(spec, pids_by_cgroup=report.pids.startswith("cgroup"))
        prefix = ["prlimit", *(r.option() for r in limits)]
        if state.uid is not None:
            prefix += ["setpriv", f"--reuid={state.uid}", f"--regid={state.gid}", "--clear-groups"]
        return prefix

    def _base_args(self, spec: SandboxSpec, work: Path, state: NamespaceState) -> list[str]:
        root = prepare_root(self, spec, work, state)
        if root is not None:
            root = self._reachable(root, work.parent / "root", state)
        return _host_base() if root is None else _image_base(root)

    def _reachable(self, path: Path, mount_point: Path, state: NamespaceState) -> Path:
        """`path`, or a read-only bind of it at `mount_point` when the sandbox uid cannot walk
        down to it (a layer cache or checkout under root's 0700 home): bwrap, run as that uid,
        resolves its bind sources with that uid's rights. Run by an ordinary user, whose binds
        need root, such a sandbox keeps the harness's uid instead of a subordinate one."""
        outer = state.outer
        if outer is not None and outer.uid is not None and not _walkable(path, outer.uid, outer.gid):
            outer.share(f"{path} is out of reach of other uids")
        if state.uid is None or _walkable(path, state.uid, state.gid):
            return path
        mount_point.mkdir()
        state.mounts.append(mount_point)
        for opts in (["--bind"], ["-o", "remount,bind,ro"]):
            r = subprocess.run(["mount", *opts, str(path), str(mount_point)], capture_output=True, text=True,
                               check=False)
            if r.returncode != 0:
                raise RuntimeError(f"sandbox uid {state.uid} cannot reach {path}, and binding it "
                                   f"failed: {r.stderr.strip()}")
        return mount_point

    def _common_args(self, run: Path, code: Path, spec: SandboxSpec, image_env: dict[str, str]) -> list[str]:
        env: list[str] = []
        for key, value in daemon_env(spec, image_env).items():
            env += ["--setenv", key, value]
        tmpfs = str(tmpfs_bytes(spec))
        # --as-pid-1: the daemon is init of the pid namespace, so `kill -9 -1` from a command
        # cannot reach it, and it reaps the orphans commands leave. Sized tmpfs: filling /tmp or
        # /dev/shm ends in ENOSPC for the command, not in the memory cgroup's OOM killer.
        return ["--unshare-all", "--as-pid-1", "--die-with-parent", "--new-session", "--cap-drop", "ALL",
                "--hostname", "sandbox", "--clearenv", *env,
                "--proc", "/proc", *_proc_ro(), "--dev", "/dev", "--size", tmpfs, "--tmpfs", "/dev/shm",
                "--size", tmpfs, "--tmpfs", "/tmp",
                "--bind", str(run.parent / "work"), "/work",
                "--ro-bind", str(code), CODE_MOUNT, "--remount-ro", "/", "--chdir", "/work"]


def _uid_args(state: NamespaceState) -> list[str]:
    """bwrap's uid and gid inside: nobody for a leased uid (as root); the harness's own numbers in
    an outer namespace (bwrap runs as its root there), so a sandbox looks as it did without one."""
    if state.lease is not None and state.uid is not None:
        return ["--uid", str(NOBODY), "--gid", str(NOBODY)]
    if state.outer is not None:
        return ["--uid", str(os.getuid()), "--gid", str(os.getgid())]
    return []


def _uid_report(state: NamespaceState) -> str:
    """`LimitsReport.uid`: whose per-uid counts (inotify, processes, pipe pages...) the sandbox's are."""
    if state.uid is None:
        return subids.uid_report(state.outer)
    if state.lease is not None:
        return f"own host uid {state.uid} (leased for this sandbox alone)"
    return f"host uid {state.uid} (sandbox_uid), shared with every sandbox given the same"


def cgroup_fd_args(fd: int | None) -> list[str]:
    """The daemon's arguments for the commands' cgroup.procs fd `fd` (none without one)."""
    return [] if fd is None else ["--cgroup-fd", str(fd)]


def sandbox_env(spec: SandboxSpec, image_env: dict[str, str]) -> dict[str, str]:
    """Every command's base env: ours, under the image's `Env` (its PATH to its own Python),
    under the spec's."""
    return {"PATH": PATH, "HOME": "/work", "LANG": "C.UTF-8", **image_env, **spec.env}


def daemon_env(spec: SandboxSpec, image_env: dict[str, str]) -> dict[str, str]:
    """The daemon's own env: the commands' base env, and that env again as the JSON the daemon
    takes (and removes) as its commands' base (SANDBOXD_ENV). Why both: the daemon's own env is
    whatever a runtime makes of it (runc adds to it); commands get the JSON's names only."""
    env = sandbox_env(spec, image_env)
    return {**env, "SANDBOXD_ENV": json.dumps(env)}


def tmpfs_bytes(spec: SandboxSpec) -> int:
    """/tmp and /dev/shm each hold at most a quarter of the memory limit (their pages count
    against it), so both full still leave half of it to the commands and the daemon."""
    return max(16, spec.memory_limit_mb // 4) << 20


class PidNamespace:
    """A sandbox's pid namespace, held through a pidfd of its init (the daemon, pid 1 inside).

    Why this and not the runtime's pid: killing `bwrap` returns at once, while the kernel kills
    the namespace's other processes as the init exits; the init's pidfd turns readable only after
    every other process of the namespace is gone (and its kill reaches every one of them, without
    cgroups: what an ordinary user has)."""

    def __init__(self, init: int) -> None:
        self.fd = os.pidfd_open(init)
        self.pid = init
        self.ns = os.stat(f"/proc/{init}/ns/pid").st_ino

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            signal.pidfd_send_signal(self.fd, signal.SIGKILL)

    def wait_gone(self, timeout: float = GONE_WAIT_S) -> list[int]:
        """[] once every process of the namespace is gone; else the host pids still in it."""
        poll = select.poll()
        poll.register(self.fd, select.POLLIN)
        if poll.poll(int(timeout * 1000)):
            return []
        return members(self.ns)

    def close(self) -> None:
        os.close(self.fd)


def members(ns: int) -> list[int]:
    """Host pids of the processes in pid namespace `ns` (those we may inspect: ours, or all as root)."""
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if os.stat(f"/proc/{entry.name}/ns/pid").st_ino == ns:
                    found.append(int(entry.name))
    return sorted(found)


def namespace_init(runtime: int) -> int:
    """The host pid of the child of `runtime` (bwrap) that is pid 1 of a pid namespace of its own."""
    for pid in Path(f"/proc/{runtime}/task/{runtime}/children").read_text().split():
        status = Path(f"/proc/{pid}/status").read_text()
        nspid = next(line.split()[1:] for line in status.splitlines() if line.startswith("NSpid:"))
        if len(nspid) > 1 and nspid[-1] == "1":
            return int(pid)
    raise RuntimeError(f"no pid namespace init under process {runtime}")


def hand_over(paths: list[Path], uid: int, gid: int | None) -> None:
    """chown the sandbox's writable dirs (and what an image put in /work) to its uid, so it can
    write them; never follows symlinks (an image's links must not chown host files)."""
    g = -1 if gid is None else gid
    for top in paths:
        os.chown(top, uid, g, follow_symlinks=False)
        for root, dirs, files in os.walk(top):
            for name in dirs + files:
                os.chown(os.path.join(root, name), uid, g, follow_symlinks=False)


def _walkable(path: Path, uid: int, gid: int | None) -> bool:
    """Whether `uid`/`gid` (no other groups) may search every dir from / down to `path`."""
    for p in (path, path.resolve()):  # through a symlink both its dirs and its target's are walked
        for d in [p, *p.parents]:
            st = d.stat()
            bit = 0o100 if st.st_uid == uid else 0o010 if st.st_gid == gid else 0o001
            if not st.st_mode & bit:
                return False
    return True


def _proc_ro() -> list[str]:
    """/proc/sys and /proc/sysrq-trigger read-only over the sandbox's own /proc: sysctls that are
    not namespaced (vm.*, kernel.core_pattern) would otherwise be the host's to change."""
    return [a for p in ("/proc/sys", "/proc/sysrq-trigger") if os.path.exists(p)
            for a in ("--ro-bind", p, p)]


def _host_base() -> list[str]:
    """The host's system dirs read-only (symlinks kept as symlinks: merged-/usr systems)."""
    args: list[str] = []
    for name in HOST_SYSTEM_DIRS:
        host = Path("/") / name
        if host.is_symlink():
            args += ["--symlink", os.readlink(host), f"/{name}"]
        elif host.is_dir():
            args += ["--ro-bind", str(host), f"/{name}"]
    for secret in HOST_SECRETS:  # the host's password hashes and keys are not the sandbox's business
        if os.path.lexists(secret):
            args += ["--ro-bind", "/dev/null", secret] if not os.path.isdir(secret) else ["--tmpfs", secret]
    return args


def _image_base(root: Path) -> list[str]:
    """Each top-level entry of the image's root, read-only. /opt is rebuilt on a tmpfs from its
    entries, because the code mount at /opt/burstrl needs a mount point a read-only bind lacks."""
    args: list[str] = []
    for entry in sorted(root.iterdir()):
        if entry.name in REPLACED:
            continue
        if entry.name == "opt" and entry.is_dir() and not entry.is_symlink():
            args += ["--tmpfs", "/opt"] + _entries(entry, "/opt")
        else:
            args += _entries_one(entry, f"/{entry.name}")
    return args


def _entries(parent: Path, dest: str) -> list[str]:
    return [a for e in sorted(parent.iterdir()) if e.name != "burstrl"
            for a in _entries_one(e, f"{dest}/{e.name}")]


def _entries_one(entry: Path, dest: str) -> list[str]:
    if entry.is_symlink():
        return ["--symlink", os.readlink(entry), dest]
    return ["--ro-bind", str(entry), dest]


def _report(report: LimitsReport) -> LimitsReport:
    """Fall back to RLIMIT_NPROC for pids where no cgroup could, and say once what is not held
    (the daemon's OOM protection by its commands' scores alone included: `LimitsReport.oom`)."""
    if report.pids == "none":
        note = "pids: RLIMIT_NPROC instead (per host uid, so shared by every sandbox of that uid)"
        report = dataclasses.replace(report, pids="rlimit", reasons=report.reasons + (note,))
    if not report.enforced or report.pids == "rlimit" or report.oom != "cgroup":
        warn_once("sandbox limits not fully enforced on this machine: " + "; ".join(report.reasons))
    return report


def _close(state: NamespaceState, client: Any, layer_cache: Any) -> None:
    """Ask the daemon to stop (it kills its commands' groups), then make sure of it."""
    try:
        client.close(timeout=CLOSE_GRACE_S)
    except Exception:
        pass  # the daemon may already be dead: the kills below are what guarantee the end
    _teardown(state, layer_cache)


def _teardown(state: NamespaceState, layer_cache: Any) -> None:
    """Kill every process, then remove what the start made; raises `SandboxNotGone` (after the
    rest is removed) when some process of the sandbox outlived the kill."""
    left = _kill(state)
    _remove(state, layer_cache)
    if left:  # the uid stays leased (its flock held) while a process of it may still run
        raise SandboxNotGone(state.path.name, left)
    for lease in (state.lease, state.outer.lease if state.outer else None):
        if lease is not None:
            lease.release()
    state.lease = None
    if state.outer is not None:
        state.outer.lease = None


def _kill(state: NamespaceState) -> list[int]:
    """Kill the daemon (pid 1: the kernel then kills the rest of its namespace), bwrap and the
    cgroups, and wait until they are gone; returns the host pids of any still there."""
    pid_ns, state.pid_ns = state.pid_ns, None
    if pid_ns is not None:
        pid_ns.kill()
    if state.proc is not None:
        kill_group(state.proc)
    left = state.cgroups.kill_all() if state.cgroups is not None else []
    if pid_ns is not None:
        left = sorted({*left, *pid_ns.wait_gone()})
        pid_ns.close()
    return left


def _remove(state: NamespaceState, layer_cache: Any) -> None:
    mounts, state.mounts = state.mounts, []
    if state.outer is not None and state.outer.sub is not None:  # /work's files are a subordinate uid's
        subids.remove_owned(state.path / "work", state.outer.sub)
    for mount_point in mounts:  # unmounted first: rmtree must never reach the source
        subprocess.run(["umount", "-l", str(mount_point)], capture_output=True, check=False)
        with contextlib.suppress(OSError):  # still mounted: its bind is read-only, rmtree fails on it
            mount_point.rmdir()
    release_work(state)
    if state.image is not None:
        layer_cache.unpin(state.image)
        state.image = None
    remove_tree(state.path)
