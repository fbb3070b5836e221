"""The `oci` backend: an OCI runtime bundle (config.json + rootfs) run by a runtime named at
construction: runc (the default) or runsc (gVisor, with `--network=none
--platform=ptrace`), which take the same bundle and command line.

The bundle's rootfs is a per-sandbox dir of empty mount points: each top-level entry of the base
(the host's system dirs, or an image's merged root) is bind-mounted read-only onto it, so the
runtime never writes into the shared image cache. Limits are the runtime's own (config.json
`linux.resources`, in a cgroup relative to ours, named `burstrl/oci-<state dir tag>-<id>` so a
sweep finds it even when its state dir is gone).

Who runs as whom: run as root (CI, GPU pods), the daemon and its commands run as `sandbox_uid`
if given, else under runc as a host uid leased for that sandbox alone (`ids.IdLease`; no user
namespace, so inside it reads as that number, with no passwd entry) and under runsc as nobody (the
sentry counts per-uid resources in its own kernel); never host uid 0. The daemon is the container's
pid 1: it reaps orphans, and no signal from a command reaches it. Under runsc the daemon starts as
the sentry's root (no host privilege) with `GVISOR_CAPS` only, to put its commands in a pid
namespace of their own (`sandbox.cmdns`: the sentry shows every process pid 1's environ, maps, auxv
and fds, non-dumpable or not), then becomes that uid and installs the seccomp filter on itself; the
bundle carries none there. runc gets the daemon's socket already listening (made on the
host, passed as fd 3 with the token pipe as fd 4: `--preserve-fds 2`), so no socket dir exists
inside. runsc cannot pass fds: its daemon makes the socket in a bound dir (`--host-uds=create`),
and once it is ready the harness takes that dir back (root-owned, 0700: commands can neither
replace the socket nor read the token, which is deleted). Under runsc, once its ready line is out,
the daemon's stdio are the sandbox's own /dev/null all the same (`base.DETACH_FLAG`): no host pipe
or log file is left inside, were its fds ever reachable again. Every runtime gets `limits.RLIMITS`
in config.json.

The commands' own memory cgroup (issue 37, `cgroups`), with runc where cgroup v1 holds the memory
controller: the harness makes S/cmds under the cgroup runc is about to make (runc then joins the
existing S and limits it, leaving S/cmds alone; teardown removes S/cmds before S) and passes a
write fd of S/cmds/cgroup.procs as fd 5 (`--preserve-fds 3`, the daemon's `--cgroup-fd`; every
command moves itself there, `guard`). Not under cgroup v2: runc puts its init in the very cgroup it
limits, and a v2 cgroup holding a process can have no child with memory on, so there the daemon
keeps the commands' scores alone (`LimitsReport.oom`; cgroupsPath naming a leaf S/daemon would move
the limit onto the daemon alone). Not under runsc: the sentry holds the host cgroup, so an OOM there
ends the whole sandbox.

Only runc and runsc are accepted (`RUNTIMES`): they are the runtimes the security suite runs.
crun took the same bundle but failed here (crun 1.8: "cgroups in hybrid mode not supported" on a
machine whose cgroup v2 hierarchy holds a controller while v1 is mounted too), so it went untested
and is refused by name rather than listed.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from burstrl.sandbox.backends import seccomp
from burstrl.sandbox.backends.base import (
    CLOSE_GRACE_S,
    CODE_MOUNT,
    RUN_MOUNT,
    SOCKET_NAME,
    TOKEN_NAME,
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
    write_owner,
)
from burstrl.sandbox.backends.cgroups import (
    CMDS,
    CPU_PERIOD_US,
    _mounts,
    _own_paths,
    _under,
    kill_and_remove,
    limit_tcp_v1,
    make_cmds_v1,
    oom_reason,
    open_procs,
    v1_memory_dir,
)
from burstrl.sandbox.backends.ids import IdLease, id_block, sandbox_ids
from burstrl.sandbox.backends.launch import kill_group, spawn, wait_ready
from burstrl.sandbox.backends.limits import sandbox_rlimits
from burstrl.sandbox.backends.namespace import (
    HOST_SECRETS,
    HOST_SYSTEM_DIRS,
    PATH,
    REPLACED,
    cgroup_fd_args,
    daemon_env,
    default_state_dir,
    hand_over,
    tmpfs_bytes,
)
from burstrl.sandbox.backends.workdir import disk_report, prepare_root, release_work

RUNTIMES = ("runc", "runsc")  # by the binary's name; a path to either is fine
RO = ["rbind", "ro", "nosuid", "nodev"]
# gVisor: no network stack at all, the ptrace platform (KVM is not available everywhere), and
# the right to create the daemon's unix socket on the host through the bound socket dir.
# --oci-seccomp: the sentry applies config.json's seccomp filter to the sandbox's own processes (the
# probe's bundle has one; a sandbox's has none under gVisor: its daemon installs the filter, `cmdns`).
RUNSC_FLAGS = ("--network=none", "--platform=ptrace", "--host-uds=create", "--oci-seccomp")
# Moves the handed-over fds to 3 and 4 for `--preserve-fds 2` (bash: dash takes single-digit fds only),
# and the commands' cgroup.procs to 5 for `--preserve-fds 3`.
_MOVE_FDS = 'exec 3<&"$1" 4<&"$2"; shift 2; exec "$@"'
_MOVE_3_FDS = 'exec 3<&"$1" 4<&"$2" 5>&"$3"; shift 3; exec "$@"'
FDS_INSIDE = (3, 4)
CGROUP_FD_INSIDE = 5
# gVisor: the daemon starts as the sentry's root with these only, to make the commands' pid namespace
# (`cmdns`), then drops them; the BPF filter it installs on itself lies beside the socket.
GVISOR_CAPS = ["CAP_SYS_ADMIN", "CAP_SETUID", "CAP_SETGID"]
SECCOMP_NAME = "seccomp.bpf"
GVISOR_PIDS_HEADROOM = 64  # host pids for the commands' spawner and init (`_resources`)
# Under gVisor the host's cgroup holds the sentry, not the commands.
RUNSC_OOM = ("oom: under gVisor the sentry holds the sandbox's memory cgroup: an OOM there ends the whole sandbox, "
             "the daemon with it")


@dataclass
class OciState(SandboxState):
    """An OCI sandbox's parts: the runtime's container and the cgroups it makes for it."""

    cgroups: list[str] = field(default_factory=list)  # where the runtime puts them; we remove them
    cid: str | None = None  # the container id, once `runc run` started


class OciBackend:
    """Creates OCI bundles under `state_dir/<id>/` and runs them with `runtime`."""

    name = "oci"

    def __init__(self, state_dir: Path | None = None, layer_cache: Any = None,
                 runtime: str = "runc", sandbox_uid: int | None = None, sandbox_gid: int | None = None) -> None:
        self.state_dir = Path(state_dir or default_state_dir())
        self.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.layer_cache = layer_cache
        if Path(runtime).name not in RUNTIMES:
            raise ValueError(f"OCI runtime {runtime!r} is not supported: use one of {', '.join(RUNTIMES)} "
                             "(crun failed on the test machines' cgroup layout and is untested)")
        self.runtime = shutil.which(runtime) or runtime
        self.gvisor = Path(runtime).name == "runsc"
        # The runtime's own state (container records) stays with ours, so a sweep finds it.
        self.runtime_root = self.state_dir / f".{Path(runtime).name}-state"
        self.uid, self.gid = sandbox_ids(sandbox_uid, sandbox_gid)
        # As root with no uid given, runc sandboxes run as a host uid leased for each alone
        # (the kernel's per-uid counts are not shared; issue 37); gVisor counts in its own kernel.
        self.id_block = id_block() if self.uid is not None and sandbox_uid is None and not self.gvisor else None

    def create(self, spec: SandboxSpec) -> Sandbox:
        sid = secrets.token_hex(4)
        path = self.state_dir / sid
        path.mkdir(mode=0o700)
        state = OciState(path=path, cgroups=cgroup_dirs(cgroup_name(self.state_dir, sid)), uid=self.uid,
                         gid=self.gid)
        try:
            if self.id_block is not None:
                state.lease = IdLease(*self.id_block)
                state.uid = state.gid = state.lease.id
            return self._start(sid, spec, state)
        except BaseException:
            self._teardown(state)
            raise

    def _start(self, sid: str, spec: SandboxSpec, state: OciState) -> Sandbox:
        path = state.path
        run, token = make_run_dir(path, token_file=self.gvisor)
        if self.gvisor:
            (run / SECCOMP_NAME).write_bytes(seccomp.bpf_program())
        (path / "work").mkdir()
        base = prepare_root(self, spec, path / "work", state)
        if state.uid is not None:
            hand_over([path / "work", *([run] if self.gvisor else [])], state.uid, state.gid)
        cid, name = f"burstrl-{sid}", cgroup_name(self.state_dir, sid)
        cgroup_fd, oom_why = (None, RUNSC_OOM) if self.gvisor else cmds_cgroup(name, spec)
        try:
            config = bundle_config(path, base, spec, name, state.uid, state.gid, gvisor=self.gvisor,
                                   image_env=state.image_env,
                                   cgroup_fd=None if cgroup_fd is None else CGROUP_FD_INSIDE)
            (path / "config.json").write_text(json.dumps(config, indent=1))
            delete = self._cmd("delete", "--force", cid)
            write_owner(path, cleanup_argv=delete, cgroups=state.cgroups)
            proc = self._spawn(path, cid, run, token, cgroup_fd)
        finally:
            if cgroup_fd is not None:  # the daemon holds it now
                os.close(cgroup_fd)
        state.proc, state.cid = proc, cid
        write_owner(path, cleanup_argv=delete, cgroups=state.cgroups, pid=proc.pid,
                    pid_start=process_start_time(proc.pid))
        wait_ready(proc, spec.start_timeout_s, path / "daemon.log")
        if self.gvisor:
            take_back(run)
        client = trusted_client(run / SOCKET_NAME, token)
        disk, why = disk_report(state)
        limits = LimitsReport(cpu="runtime", memory="runtime", pids="runtime", disk=disk,
                              reasons=why + ((oom_why,) if oom_why else ()), oom="score" if oom_why else "cgroup")
        return Sandbox(sid, client, limits, path, lambda: self._close(state, client))

    def _spawn(self, path: Path, cid: str, run: Path, token: str,
               cgroup_fd: int | None) -> subprocess.Popen[bytes]:
        """`runtime run` of the bundle; runc gets the daemon's socket and token pipe (and the
        commands' cgroup.procs) as fds 3, 4 (and 5)."""
        # setpriv: the runtime dies with the harness, the daemon (pid 1) with the runtime.
        argv = ["setpriv", "--pdeathsig", "KILL"]
        if self.gvisor:
            return spawn(argv + self._cmd("run", "--bundle", str(path), cid), {"PATH": PATH}, path / "daemon.log")
        handover = Handover(run, token)
        try:
            fds = (*handover.fds, *([] if cgroup_fd is None else [cgroup_fd]))
            argv += ["bash", "-c", _MOVE_FDS if len(fds) == 2 else _MOVE_3_FDS, "bash", *map(str, fds),
                     *self._cmd("run", "--preserve-fds", str(len(fds)), "--bundle", str(path), cid)]
            return spawn(argv, {"PATH": PATH}, path / "daemon.log", pass_fds=fds)
        finally:
            handover.close()  # the daemon holds them now; our copies would keep a dead daemon's socket open

    def _cmd(self, *args: str) -> list[str]:
        return [self.runtime, "--root", str(self.runtime_root), *(RUNSC_FLAGS if self.gvisor else ()), *args]

    def _close(self, state: OciState, client: Any) -> None:
        try:
            client.close(timeout=CLOSE_GRACE_S)
        except Exception:
            pass  # already dead; the runtime's kill and delete below are what guarantee the end
        self._teardown(state)

    def _teardown(self, state: OciState) -> None:
        """Kill, let the runtime clean up, then remove its cgroups ourselves; raises
        `SandboxNotGone` (after the rest is removed) when a process outlived the kill.

        Why the last step: runc's destroy retries rmdir for only ~0.3 s, and under load the
        killed processes take longer to leave their cgroups; runc then drops its state dir anyway
        and the cgroups leak (26 of 128 at 32-way here). `kill_and_remove` waits until empty.
        """
        if state.cid is not None:
            subprocess.run(self._cmd("kill", state.cid, "KILL"), capture_output=True)
        if state.proc is not None:
            _wait_then_kill(state.proc)
        if state.cid is not None:
            subprocess.run(self._cmd("delete", "--force", state.cid), capture_output=True)
        left = kill_and_remove(state.cgroups)
        release_work(state)
        if state.image is not None:
            self.layer_cache.unpin(state.image)
            state.image = None
        remove_tree(state.path)
        if left:  # the uid stays leased (its flock held) while a process of it may still run
            raise SandboxNotGone(state.path.name, left)
        if state.lease is not None:
            state.lease.release()
            state.lease = None


def _wait_then_kill(proc: subprocess.Popen[bytes], grace_s: float = 2.0) -> None:
    """Give `runc run` the moment it needs to reap its init and destroy the container itself
    (a SIGKILL mid-destroy leaves that half done), then kill its group."""
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    kill_group(proc)


def cmds_cgroup(name: str, spec: SandboxSpec) -> tuple[int | None, str | None]:
    """(a write fd of S/cmds/cgroup.procs, None), S being the v1 memory cgroup runc will make as
    `burstrl/<name>`; else (None, why not). Made before `runc run`, which joins the existing S."""
    memory = v1_memory_dir(f"burstrl/{name}")
    if memory is None:
        return None, oom_reason("cgroup v2: runc's init sits in the cgroup it limits")
    try:
        memory.mkdir(parents=True, exist_ok=True)
        limit_tcp_v1(memory, spec)  # runc sets no such limit itself
        return open_procs(make_cmds_v1(memory, spec)), None
    except OSError as exc:
        return None, oom_reason(f"{memory / CMDS}: {exc.strerror or exc}")


def take_back(run: Path) -> None:
    """After the daemon made its socket in `run` (runsc): the token file goes and the dir becomes
    root's again, 0700, so commands of the daemon's uid can neither replace the socket nor read
    the token. As root only (runsc needs root here anyway)."""
    (run / TOKEN_NAME).unlink(missing_ok=True)
    (run / SECCOMP_NAME).unlink(missing_ok=True)
    if os.geteuid() == 0:
        os.chown(run, 0, 0)
        os.chmod(run, 0o700)
        os.chown(run / SOCKET_NAME, 0, 0)  # the sentry answers as root: socket owner = listener uid


def state_tag(state_dir: Path) -> str:
    """A short hash of the state dir: sweeps of one state dir never touch another's cgroups."""
    return hashlib.sha256(str(Path(state_dir).resolve()).encode()).hexdigest()[:8]


def cgroup_name(state_dir: Path, sid: str) -> str:
    return f"oci-{state_tag(state_dir)}-{sid}"


def cgroup_dirs(name: str) -> list[str]:
    """Where runc makes the cgroups of a relative cgroupsPath `burstrl/<name>`: under its own
    (= our) cgroup in every mounted hierarchy, v1 and v2."""
    own = _own_paths()
    dirs = set()
    for fstype, root, point, opts in _mounts():
        keys = [""] if fstype == "cgroup2" else [o.removeprefix("name=") for o in opts]
        path = next((own[k] for k in keys if k in own), None)
        if path is not None:
            dirs.add(str(_under(point, root, path) / "burstrl" / name))
    return sorted(dirs)


def sweep_orphan_cgroups(state_dir: Path) -> list[str]:
    """Remove this state dir's cgroups whose sandbox dir is gone; returns their sandbox ids.

    Safe against a live sandbox: its dir is made before its cgroups and removed after them.
    """
    prefix = cgroup_name(state_dir, "")
    orphans: dict[str, list[str]] = {}
    for parent in {Path(d).parent for d in cgroup_dirs(prefix)}:
        for child in parent.glob(prefix + "*"):
            sid = child.name.removeprefix(prefix)
            if child.is_dir() and not (Path(state_dir) / sid).exists():
                orphans.setdefault(sid, []).append(str(child))
    for dirs in orphans.values():
        kill_and_remove(dirs)
    return sorted(orphans)


def bundle_config(path: Path, base: Path | None, spec: SandboxSpec, cgroup: str, uid: int | None = None,
                  gid: int | None = None, gvisor: bool = False, image_env: dict[str, str] | None = None,
                  cgroup_fd: int | None = None) -> dict[str, Any]:
    """config.json per the OCI runtime spec 1.0: root read-only, no capabilities, new pid, net,
    ipc, uts, mount and cgroup namespaces, the base bound read-only onto empty mount points, the
    host's secrets masked, the seccomp deny list, the daemon as pid 1 as `uid` (0 only where we
    are not root). For `gvisor` (runsc cannot pass fds) the daemon makes its socket in the bound
    socket dir, else it gets fds 3 and 4 (and `cgroup_fd`, the commands' cgroup.procs, if given).
    Under `gvisor` the daemon starts as root with `GVISOR_CAPS` and no filter, makes the commands'
    pid namespace, then becomes `uid` and installs the deny list itself (`cmdns`)."""
    rootfs = path / "rootfs"
    rootfs.mkdir()
    mounts = _base_mounts(rootfs, base)
    mounts += [
        {"destination": "/proc", "type": "proc", "source": "proc"},
        {"destination": "/dev", "type": "tmpfs", "source": "tmpfs",
         "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]},
        {"destination": "/dev/pts", "type": "devpts", "source": "devpts",
         "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620"]},
        {"destination": "/dev/shm", "type": "tmpfs", "source": "shm",
         "options": ["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"]},
        {"destination": "/tmp", "type": "tmpfs", "source": "tmpfs",  # sized: ENOSPC, not the OOM killer
         "options": ["nosuid", "nodev", "mode=1777", f"size={tmpfs_bytes(spec) >> 10}k"]},
        {"destination": "/work", "type": "bind", "source": str(path / "work"),
         "options": ["rbind", "rw", "nosuid", "nodev"]},
        {"destination": CODE_MOUNT, "type": "bind", "source": str(src_dir()), "options": RO},
    ]
    if gvisor:
        mounts.append({"destination": RUN_MOUNT, "type": "bind", "source": str(path / "run"),
                       "options": ["rbind", "rw", "nosuid", "nodev", "noexec"]})
    env = [f"{k}={v}" for k, v in daemon_env(spec, image_env or {}).items()]
    return {
        "ociVersion": "1.0.2",
        # The daemon is pid 1: it reaps orphans, and signals from its commands do not reach it.
        "process": {"terminal": False, "user": {"uid": 0 if gvisor else uid or 0, "gid": 0 if gvisor else gid or 0},
                    "args": [*daemon_argv(fds=None if gvisor else FDS_INSIDE, detach_stdio=gvisor),
                             *cgroup_fd_args(cgroup_fd), *_commands_ns_args(uid, gid, gvisor)],
                    "env": env, "cwd": "/work", "noNewPrivileges": True,
                    "capabilities": _capabilities(GVISOR_CAPS if gvisor else []),
                    "rlimits": _rlimits(spec, gvisor)},
        "root": {"path": "rootfs", "readonly": True},
        "hostname": "sandbox",
        "mounts": mounts,
        "linux": {
            "namespaces": [{"type": t} for t in ("pid", "network", "ipc", "uts", "mount", "cgroup")],
            # Relative: nested under the runtime's own cgroup (ours), so a container's limits hold.
            "cgroupsPath": f"burstrl/{cgroup}",
            **({} if gvisor else {"seccomp": seccomp.oci_profile()}),
            "resources": _resources(spec, gvisor),
            "maskedPaths": ["/proc/acpi", "/proc/asound", "/proc/kcore", "/proc/keys", "/proc/latency_stats",
                            "/proc/timer_list", "/proc/timer_stats", "/proc/sched_debug", "/sys/firmware",
                            "/proc/scsi", *HOST_SECRETS],
            "readonlyPaths": ["/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger"],
        },
    }


def _capabilities(caps: list[str]) -> dict[str, list[str]]:
    """config.json's capability sets: `caps` bounding, effective and permitted; nothing inherited."""
    return {k: caps if k in ("bounding", "effective", "permitted") else []
            for k in ("bounding", "effective", "inheritable", "permitted", "ambient")}


def _commands_ns_args(uid: int | None, gid: int | None, gvisor: bool) -> list[str]:
    """The daemon's `--commands-ns` under gVisor, where the sentry shows every process of the sandbox
    its pid 1's /proc files (issue 49): commands then live in a pid namespace without the daemon."""
    if not gvisor:
        return []
    return ["--commands-ns", f"{uid or 0}:{gid or 0}", "--seccomp-file", f"{RUN_MOUNT}/{SECCOMP_NAME}"]


def _rlimits(spec: SandboxSpec, gvisor: bool) -> list[dict[str, Any]]:
    """`limits.RLIMITS` as config.json takes them. Under gVisor RLIMIT_NPROC too: the host's pids
    cgroup holds the sentry's threads, not the sandbox's processes, and the sentry counts the uid's
    processes in its own kernel, so that count is the sandbox's alone."""
    return [{"type": r.name, "hard": r.hard, "soft": r.soft}
            for r in sandbox_rlimits(spec, pids_by_cgroup=not gvisor)]


def _resources(spec: SandboxSpec, gvisor: bool = False) -> dict[str, Any]:
    """config.json's `linux.resources`. Under gVisor the pids cgroup holds the sentry's host threads
    (~15 per process inside, with the ptrace platform), of which the commands' spawner and init
    (`sandbox.cmdns`) take ~30 for good: `GVISOR_PIDS_HEADROOM` more, so that the limit is reached
    no sooner than before them (a sentry out of pids panics, ending the sandbox)."""
    limit = spec.memory_limit_mb << 20
    return {
        "memory": {"limit": limit, "reservation": (spec.memory_request_mb or 0) << 20, "swap": limit},
        "cpu": {"quota": max(1000, int(spec.cpu_limit * CPU_PERIOD_US)), "period": CPU_PERIOD_US,
                "shares": max(2, int((spec.cpu_request or 0) * 1024))},
        "pids": {"limit": spec.pids_limit + (GVISOR_PIDS_HEADROOM if gvisor else 0)},
    }


def _base_mounts(rootfs: Path, base: Path | None) -> list[dict[str, Any]]:
    """Mirror the base's top level in `rootfs`: symlinks as symlinks, the rest as mount points."""
    entries = [Path("/") / n for n in HOST_SYSTEM_DIRS] if base is None else sorted(base.iterdir())
    mounts = []
    for entry in entries:
        if entry.name in REPLACED or not os.path.lexists(entry):
            continue
        target = rootfs / entry.name
        if entry.is_symlink():
            target.symlink_to(os.readlink(entry))
            continue
        target.mkdir() if entry.is_dir() else target.touch()
        mounts.append({"destination": f"/{entry.name}", "type": "bind", "source": str(entry), "options": RO})
    for name in ("proc", "dev", "tmp", "work", "run", "opt"):
        (rootfs / name).mkdir(exist_ok=True)
    os.chmod(rootfs / "tmp", 0o1777)  # runc gives a tmpfs its mount point's mode, whatever `mode=` says
    (rootfs / RUN_MOUNT.lstrip("/")).mkdir(parents=True, exist_ok=True)
    (rootfs / CODE_MOUNT.lstrip("/")).mkdir(parents=True, exist_ok=True)
    return mounts


def runtime_works(runtime: str, state_dir: Path, tries: int = 3) -> tuple[bool, str]:
    """Whether `runtime run` of a trivial bundle (host dirs, `true`) succeeds here, and if not,
    the runtime's own error: tests skip on this, measured at test time, not assumed. Tried up to
    `tries` times: under heavy load runsc's first start now and then loses its sentry ("urpc
    method containerManager.StartRoot failed: EOF"), which says nothing about the machine."""
    exe = shutil.which(runtime)
    if exe is None:
        return False, f"{runtime} is not installed"
    reason = ""
    for _ in range(tries):
        ok, reason = _probe(exe, runtime, state_dir)
        if ok:
            return True, ""
    return False, reason


def _probe(exe: str, runtime: str, state_dir: Path) -> tuple[bool, str]:
    flags = list(RUNSC_FLAGS) if Path(runtime).name == "runsc" else []
    path = Path(state_dir) / f"probe-{secrets.token_hex(4)}"
    path.mkdir(parents=True)
    try:
        (path / "work").mkdir()
        (path / "run").mkdir()
        config = bundle_config(path, None, SandboxSpec(), cgroup_name(state_dir, path.name))
        config["process"]["args"] = ["/bin/true"]
        (path / "config.json").write_text(json.dumps(config))
        root = str(path / "state")
        proc = subprocess.run([exe, "--root", root, *flags, "run", "--bundle", str(path), f"probe-{path.name}"],
                              capture_output=True, text=True, timeout=30)
        subprocess.run([exe, "--root", root, *flags, "delete", "--force", f"probe-{path.name}"],
                       capture_output=True)
        kill_and_remove(cgroup_dirs(cgroup_name(state_dir, path.name)))
        if proc.returncode != 0:
            return False, f"{runtime} run failed (rc={proc.returncode}): {(proc.stderr or proc.stdout).strip()[-500:]}"
        return True, ""
    finally:
        remove_tree(path)
