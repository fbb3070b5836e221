"""Per-sandbox cgroups (v2 where mounted and delegated, else the v1 memory, pids and cpu
controllers), made under this process's own cgroup so that a container's limits still apply.

Why under our own cgroup and not the hierarchy root: inside a container the root is usually
not ours to write, and nesting keeps the harness's own limits above every sandbox's.

The commands' own memory cgroup (issue 37). The sandbox's memory cgroup S keeps the limit L; its
child S/cmds, limited to L minus a reserve for the daemon (`cmds_limit`), holds every command, the
daemon stays outside it (v1: in S itself; v2, where a cgroup with children holds no process: in the
leaf S/daemon). An OOM in S/cmds then picks among commands only, whatever their oom_score_adj, so no
crowd of commands that lowered theirs can get the daemon killed. Commands get there by writing to
S/cmds/cgroup.procs through an fd the harness (root) opened and the daemon hands each command at start
(`open_cmds_procs`, `guard.ENTER_CGROUP`). Where S/cmds cannot be made, `LimitsReport.oom` says
"score": the daemon is then protected by the commands' oom_score_adj alone (`guard`).
"""

from __future__ import annotations

import fcntl
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from burstrl.sandbox.backends.base import GONE_WAIT_S, LimitsReport, SandboxSpec

CPU_PERIOD_US = 100_000
V1_CONTROLLERS = ("memory", "pids", "cpu")
CMDS = "cmds"  # the commands' memory cgroup, a child of the sandbox's
DAEMON_LEAF = "daemon"  # v2: the daemon's leaf beside it
DAEMON_RESERVE = 64 << 20  # at most this much of the limit is kept from the commands for the daemon
TCP_LIMIT = 32 << 20  # v1: TCP buffers a sandbox may hold (host-wide pool; loopback tests need far less)


@dataclass
class CgroupSet:
    """The cgroup dirs of one sandbox (one per v1 controller, or one v2 dir), the commands' memory
    cgroup under them where it could be made, and (v2) the daemon's leaf."""

    dirs: list[Path]
    report: LimitsReport
    cmds: Path | None = None
    daemon: Path | None = None

    @property
    def procs_files(self) -> list[Path]:
        """Where the sandbox's entry process (and so the daemon) goes: each dir, or its v2 leaf."""
        leaf = self.daemon
        return [(leaf if leaf is not None and leaf.parent == d else d) / "cgroup.procs" for d in self.dirs]

    def open_cmds_procs(self) -> int | None:
        """A write fd of S/cmds/cgroup.procs (close-on-exec: the caller passes it on), or None."""
        return None if self.cmds is None else open_procs(self.cmds)

    def kill_all(self) -> list[int]:
        """Kill every process in the cgroups and remove them; the pids still there after the wait."""
        return kill_and_remove([str(d) for d in self.dirs])


def _mounts() -> list[tuple[str, str, str, set[str]]]:
    """(fstype, mount root within the hierarchy, mount point, super options) of cgroup mounts."""
    out = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, right = line.split(" - ", 1)
        fields, rfields = left.split(), right.split()
        if rfields[0] in ("cgroup", "cgroup2"):
            out.append((rfields[0], fields[3], fields[4], set(rfields[2].split(","))))
    return out


def _own_paths() -> dict[str, str]:
    """controller name (or "" for v2) -> this process's cgroup path."""
    paths = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, ctrls, path = line.split(":", 2)
        for c in ctrls.split(",") if ctrls else [""]:
            paths[c.removeprefix("name=")] = path
    return paths


def _under(mount_point: str, mount_root: str, own: str) -> Path:
    rel = os.path.relpath(own, mount_root) if own.startswith(mount_root) else "."
    return Path(mount_point) / rel


def create(name: str, spec: SandboxSpec) -> CgroupSet:
    """Make the sandbox's cgroups and write its limits; never raises for a machine that cannot
    (the report says what was not enforced and why)."""
    mounts = _mounts()
    own = _own_paths()
    v2 = [m for m in mounts if m[0] == "cgroup2"]
    v1 = {c: m for m in mounts if m[0] == "cgroup" for c in V1_CONTROLLERS if c in m[3]}
    if v2 and not v1 and "" in own:
        return _create_v2(_under(v2[0][2], v2[0][1], own[""]) / "burstrl" / name, spec)
    return _create_v1(name, spec, v1, own)


def _write(path: Path, value: str | int) -> None:
    path.write_text(str(value))


def cmds_limit(spec: SandboxSpec) -> int:
    """The commands' share of the memory limit: all of it but min(DAEMON_RESERVE, a quarter)."""
    limit = spec.memory_limit_mb << 20
    return limit - min(DAEMON_RESERVE, limit // 4)


def open_procs(path: Path) -> int:
    """Open `path`/cgroup.procs for writing, close-on-exec, at fd 10 or above (a runtime moves the
    fds it passes down to 3, 4, ...). Whoever holds the fd moves processes with the opener's rights
    (the kernel checks the file's credentials, not the writer's): never a command's to keep."""
    fd = os.open(path / "cgroup.procs", os.O_WRONLY | os.O_CLOEXEC)
    try:
        return fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10)
    finally:
        os.close(fd)


def make_cmds_v1(memory_dir: Path, spec: SandboxSpec) -> Path:
    """Make S/cmds under the v1 memory cgroup `memory_dir` (S), limited to `cmds_limit`; raises
    OSError where it cannot. S must count its children's memory (use_hierarchy, always on since
    Linux 5.x), else S/cmds would hold L - reserve beside S's own L."""
    hier = memory_dir / "memory.use_hierarchy"
    if hier.exists() and hier.read_text().strip() != "1":
        _write(hier, 1)
    cmds = memory_dir / CMDS
    cmds.mkdir(exist_ok=True)
    limit = cmds_limit(spec)
    _write(cmds / "memory.limit_in_bytes", limit)
    if (cmds / "memory.memsw.limit_in_bytes").exists():
        _write(cmds / "memory.memsw.limit_in_bytes", limit)
    limit_tcp_v1(cmds, spec)  # v1 charges a socket only where its own cgroup has the limit written
    return cmds


def limit_tcp_v1(memory_dir: Path, spec: SandboxSpec) -> None:
    """Cap the TCP buffers the v1 memory cgroup `memory_dir` may hold (`tcp_limit`).

    Why: v1 charges socket buffers to no memory limit unless this is set, and they come from one
    host-wide pool (net.ipv4.tcp_mem): 64 loopback connections a sandbox never read from held
    239 MB there beside a 512 MB limit (issue 37), and a few hundred would push every TCP socket on
    the host, the harness's and the replicas' included, into memory pressure. Written before any
    process enters (it turns the accounting on). v2 charges socket memory to memory.max anyway.
    """
    path = memory_dir / "memory.kmem.tcp.limit_in_bytes"
    if path.exists():
        _write(path, tcp_limit(spec))


def tcp_limit(spec: SandboxSpec) -> int:
    """TCP buffers one sandbox may hold: min(TCP_LIMIT, a quarter of its memory limit)."""
    return min(TCP_LIMIT, (spec.memory_limit_mb << 20) // 4)


def v1_memory_dir(rel: str) -> Path | None:
    """Where the v1 memory cgroup `rel` (relative to ours) lies; None where no v1 memory controller
    is mounted."""
    own = _own_paths()
    for fstype, root, point, opts in _mounts():
        if fstype == "cgroup" and "memory" in opts:
            return _under(point, root, own.get("memory", "/")) / rel
    return None


def oom_reason(why: str) -> str:
    """The report's line for a sandbox whose daemon shares its memory cgroup with its commands."""
    return (f"oom: no memory cgroup of the commands' own ({why}): only their oom_score_adj 1000, which a "
            "command may lower and the pid 1 daemon raises again within 0.5 s, keeps the OOM killer off "
            "the daemon")


def _create_v1(name: str, spec: SandboxSpec, mounts: dict, own: dict[str, str]) -> CgroupSet:
    done: dict[str, str] = {}
    dirs: list[Path] = []
    reasons: list[str] = []
    cmds: Path | None = None
    for ctrl in V1_CONTROLLERS:
        if ctrl not in mounts:
            reasons.append(f"{ctrl}: no cgroup v1 '{ctrl}' controller mounted")
            continue
        _, root, point, _ = mounts[ctrl]
        path = _under(point, root, own.get(ctrl, "/")) / "burstrl" / name
        try:
            path.mkdir(parents=True)
            dirs.append(path)
            _limit_v1(ctrl, path, spec)
            done[ctrl] = "cgroup-v1"
        except OSError as exc:
            reasons.append(f"{ctrl}: cannot use cgroup {path}: {exc.strerror or exc}")
            continue
        if ctrl == "memory":
            cmds, why = _cmds_or_reason(path, spec)
            reasons += why
    if "memory" not in done:
        reasons.append(oom_reason("no memory cgroup"))
    report = LimitsReport(cpu=done.get("cpu", "none"), memory=done.get("memory", "none"),
                          pids=done.get("pids", "none"), reasons=tuple(reasons),
                          oom="cgroup" if cmds else "score")
    return CgroupSet(dirs=dirs, report=report, cmds=cmds)


def _cmds_or_reason(memory_dir: Path, spec: SandboxSpec) -> tuple[Path | None, list[str]]:
    try:
        return make_cmds_v1(memory_dir, spec), []
    except OSError as exc:
        return None, [oom_reason(f"{memory_dir / CMDS}: {exc.strerror or exc}")]


def _limit_v1(ctrl: str, path: Path, spec: SandboxSpec) -> None:
    if ctrl == "memory":
        limit = spec.memory_limit_mb << 20
        _write(path / "memory.limit_in_bytes", limit)
        _write(path / "memory.soft_limit_in_bytes", (spec.memory_request_mb or 0) << 20)
        if (path / "memory.memsw.limit_in_bytes").exists():  # no escaping the limit into swap
            _write(path / "memory.memsw.limit_in_bytes", limit)
        limit_tcp_v1(path, spec)
    elif ctrl == "pids":
        _write(path / "pids.max", spec.pids_limit)
    elif ctrl == "cpu":
        _write(path / "cpu.cfs_period_us", CPU_PERIOD_US)
        _write(path / "cpu.cfs_quota_us", max(1000, int(spec.cpu_limit * CPU_PERIOD_US)))
        _write(path / "cpu.shares", max(2, int((spec.cpu_request or 0) * 1024)))


def _create_v2(path: Path, spec: SandboxSpec) -> CgroupSet:
    try:
        parent = path.parent
        parent.mkdir(exist_ok=True)
        _write(parent / "cgroup.subtree_control", "+memory +pids +cpu")
        path.mkdir()
    except OSError as exc:
        reason = f"cgroup v2 {path}: {exc.strerror or exc} (not delegated to this process?)"
        return CgroupSet(dirs=[], report=LimitsReport(reasons=(reason, oom_reason("no memory cgroup"))))
    _write(path / "memory.max", spec.memory_limit_mb << 20)
    _write(path / "memory.low", (spec.memory_request_mb or 0) << 20)
    if (path / "memory.swap.max").exists():
        _write(path / "memory.swap.max", 0)
    _write(path / "pids.max", spec.pids_limit)
    _write(path / "cpu.max", f"{max(1000, int(spec.cpu_limit * CPU_PERIOD_US))} {CPU_PERIOD_US}")
    _write(path / "cpu.weight", max(1, min(10000, int((spec.cpu_request or 0) * 100))))
    daemon, cmds, why = _split_v2(path, spec)
    report = LimitsReport(cpu="cgroup-v2", memory="cgroup-v2", pids="cgroup-v2", reasons=why,
                          oom="cgroup" if cmds else "score")
    return CgroupSet(dirs=[path], report=report, cmds=cmds, daemon=daemon)


def _split_v2(path: Path, spec: SandboxSpec) -> tuple[Path | None, Path | None, tuple[str, ...]]:
    """(the daemon's leaf, the commands' cgroup, reasons) under the v2 cgroup `path` (S).

    v2 lets no process sit in a cgroup whose children have a controller on, so the daemon goes to
    the leaf S/daemon and commands to S/cmds (memory.max = `cmds_limit`; memory.oom.group: an OOM
    there ends every command, never a part of a pipeline). Where S/cmds gets no limit the daemon
    still needs the leaf once S's children have memory on. Untested: the machines this was written
    on mount v2 with no controller in it (v1 holds them), so only the v1 path ran.
    """
    daemon, cmds = path / DAEMON_LEAF, path / CMDS
    try:
        daemon.mkdir()
        cmds.mkdir()
        _write(path / "cgroup.subtree_control", "+memory")
    except OSError as exc:  # S keeps no controller for children: the daemon stays in S itself
        return None, None, (oom_reason(f"{cmds}: {exc.strerror or exc}"),)
    try:
        _write(cmds / "memory.max", cmds_limit(spec))
        _write(cmds / "memory.oom.group", 1)
        if (cmds / "memory.swap.max").exists():
            _write(cmds / "memory.swap.max", 0)
    except OSError as exc:
        return daemon, None, (oom_reason(f"{cmds}: {exc.strerror or exc}"),)
    return daemon, cmds, ()


def _subtree(top: Path) -> list[Path]:
    """`top` and the cgroups under it, deepest first."""
    try:
        children = sorted(p for p in top.iterdir() if p.is_dir())
    except OSError:
        children = []
    return [d for child in children for d in _subtree(child)] + [top]


def _procs(path: Path) -> list[int]:
    try:
        return [int(p) for p in (path / "cgroup.procs").read_text().split()]
    except OSError:
        return []


def kill_and_remove(dirs: list[str], timeout_s: float = GONE_WAIT_S) -> list[int]:
    """SIGKILL whatever is left in the cgroups and their children (S/cmds, S/daemon) until they
    are empty, then remove them, children first (rmdir of a cgroup with children fails); returns the
    pids still in them when `timeout_s` ran out ([] when every process is gone).

    Why a loop: in v1 a process may fork between the read of cgroup.procs and the kill; the
    pids limit bounds how long that can go on.
    """
    deadline = time.monotonic() + timeout_s
    left: list[int] = []
    for d in (sub for top in map(Path, dirs) for sub in _subtree(top)):
        if not d.exists():
            continue
        if (d / "cgroup.kill").exists():
            _write(d / "cgroup.kill", 1)
        while (pids := _procs(d)) and time.monotonic() < deadline:
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.01)
        while time.monotonic() < deadline:
            try:
                d.rmdir()
                break
            except FileNotFoundError:
                break
            except OSError:  # EBUSY until the killed processes are reaped
                time.sleep(0.01)
        left += _procs(d)
    return sorted(set(left))
