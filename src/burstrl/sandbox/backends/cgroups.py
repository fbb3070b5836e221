"""Per-sandbox cgroups (v2 where mounted and delegated, else the v1 memory, pids and cpu
controllers), made under this process's own cgroup so that a container's limits still apply.

Why under our own cgroup and not the hierarchy root: inside a container the root is usually
not ours to write, and nesting keeps the harness's own limits above every sandbox's.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from burstrl.sandbox.backends.base import GONE_WAIT_S, LimitsReport, SandboxSpec

CPU_PERIOD_US = 100_000
V1_CONTROLLERS = ("memory", "pids", "cpu")


@dataclass
class CgroupSet:
    """The cgroup dirs of one sandbox (one per v1 controller, or one v2 dir)."""

    dirs: list[Path]
    report: LimitsReport

    @property
    def procs_files(self) -> list[Path]:
        return [d / "cgroup.procs" for d in self.dirs]

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


def _create_v1(name: str, spec: SandboxSpec, mounts: dict, own: dict[str, str]) -> CgroupSet:
    done: dict[str, str] = {}
    dirs: list[Path] = []
    reasons: list[str] = []
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
    report = LimitsReport(cpu=done.get("cpu", "none"), memory=done.get("memory", "none"),
                          pids=done.get("pids", "none"), reasons=tuple(reasons))
    return CgroupSet(dirs=dirs, report=report)


def _limit_v1(ctrl: str, path: Path, spec: SandboxSpec) -> None:
    if ctrl == "memory":
        limit = spec.memory_limit_mb << 20
        _write(path / "memory.limit_in_bytes", limit)
        _write(path / "memory.soft_limit_in_bytes", (spec.memory_request_mb or 0) << 20)
        if (path / "memory.memsw.limit_in_bytes").exists():  # no escaping the limit into swap
            _write(path / "memory.memsw.limit_in_bytes", limit)
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
        return CgroupSet(dirs=[], report=LimitsReport(reasons=(reason,)))
    _write(path / "memory.max", spec.memory_limit_mb << 20)
    _write(path / "memory.low", (spec.memory_request_mb or 0) << 20)
    if (path / "memory.swap.max").exists():
        _write(path / "memory.swap.max", 0)
    _write(path / "pids.max", spec.pids_limit)
    _write(path / "cpu.max", f"{max(1000, int(spec.cpu_limit * CPU_PERIOD_US))} {CPU_PERIOD_US}")
    _write(path / "cpu.weight", max(1, min(10000, int((spec.cpu_request or 0) * 100))))
    report = LimitsReport(cpu="cgroup-v2", memory="cgroup-v2", pids="cgroup-v2")
    return CgroupSet(dirs=[path], report=report)


def _procs(path: Path) -> list[int]:
    try:
        return [int(p) for p in (path / "cgroup.procs").read_text().split()]
    except OSError:
        return []


def kill_and_remove(dirs: list[str], timeout_s: float = GONE_WAIT_S) -> list[int]:
    """SIGKILL whatever is left in the cgroups until they are empty, then remove them; returns
    the pids still in them when `timeout_s` ran out ([] when every process is gone).

    Why a loop: in v1 a process may fork between the read of cgroup.procs and the kill; the
    pids limit bounds how long that can go on.
    """
    deadline = time.monotonic() + timeout_s
    left: list[int] = []
    for d in map(Path, dirs):
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
