"""What a sandbox node has and what its sandboxes use: allocatable resources, and per-sandbox CPU,
memory and OOM-kill counters read from the sandbox's cgroups or, where a counter has no cgroup,
from /proc of its processes. Each reading says which source it came from.

Why both sources: on a cgroup v1 host whose `cpu` and `cpuacct` controllers are mounted apart
(this machine), a sandbox's `cpu` cgroup holds its quota but no usage counter, so CPU comes from
the utime/stime of its processes; memory still comes from the cgroup (`memory.usage_in_bytes`),
which also counts page cache and tmpfs pages, as the kernel does when it OOM-kills. /proc's RSS
sums count shared pages once per process, so that fallback overstates memory.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

CLK_TCK = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")


@dataclass(frozen=True)
class Allocatable:
    """What the node may give its sandboxes: vCPU, memory bytes, pids."""

    cpu: float
    mem: int
    pids: int


def meminfo() -> dict[str, int]:
    """/proc/meminfo in bytes (MemTotal, MemAvailable, ...)."""
    out = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        key, _, rest = line.partition(":")
        fields = rest.split()
        if fields:
            out[key] = int(fields[0]) * (1024 if len(fields) > 1 else 1)
    return out


def node_allocatable(cpu: float | None = None, mem_bytes: int | None = None) -> Allocatable:
    """The CPUs this process may run on, MemTotal and kernel.pid_max, unless overridden (several
    agents on one test machine each claim a share)."""
    cpus = float(len(os.sched_getaffinity(0))) if cpu is None else cpu
    mem = meminfo()["MemTotal"] if mem_bytes is None else mem_bytes
    pids = int(Path("/proc/sys/kernel/pid_max").read_text())
    return Allocatable(cpus, mem, pids)


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _keyed(path: Path) -> dict[str, int]:
    """A flat-keyed cgroup file (`cpu.stat`, `memory.events`, `memory.oom_control`)."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return {}
    return {k: int(v) for k, v in (line.split()[:2] for line in lines if len(line.split()) >= 2)
            if v.lstrip("-").isdigit()}


class ProcTable:
    """One scan of /proc per sampling tick: each process's parent and CPU ticks, for descendants."""

    def __init__(self) -> None:
        self.children: dict[int, list[int]] = {}
        self.stat: dict[int, list[str]] = {}
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                text = Path(entry.path, "stat").read_text()
            except OSError:  # exited between the listing and the read
                continue
            fields = text.rsplit(")", 1)[1].split()
            pid = int(entry.name)
            self.stat[pid] = fields
            self.children.setdefault(int(fields[1]), []).append(pid)

    def tree(self, root: int) -> list[int]:
        out, todo = [], [root]
        while todo:
            pid = todo.pop()
            if pid in self.stat:
                out.append(pid)
                todo += self.children.get(pid, [])
        return out

    def cpu_seconds(self, root: int) -> float:
        """utime+stime of the live tree plus what it reaped (cutime+cstime): a counter like cpuacct."""
        ticks = sum(sum(int(x) for x in self.stat[p][11:15]) for p in self.tree(root))
        return ticks / CLK_TCK

    def rss_bytes(self, root: int) -> int:
        return sum(int(self.stat[p][21]) * PAGE for p in self.tree(root))


@dataclass
class Reading:
    """One sample of one sandbox: cumulative CPU seconds, memory bytes, OOM kills so far, sources."""

    cpu_seconds: float
    mem_bytes: int
    oom_kills: int
    cpu_source: str
    mem_source: str


def read_sandbox(cgroup_dirs: list[str], pid: int | None, procs: ProcTable) -> Reading:
    """The sandbox's counters from its cgroup dirs (v2: one dir; v1: one per controller), each
    missing one from /proc of the process tree under its entry `pid`."""
    cpu: float | None = None
    mem: int | None = None
    oom = 0
    cpu_src = mem_src = "none"
    for d in map(Path, cgroup_dirs):
        if (d / "cpu.stat").exists() and "usage_usec" in (stat := _keyed(d / "cpu.stat")):  # v2
            cpu, cpu_src = stat["usage_usec"] / 1e6, "cgroup-v2"
        if (d / "cpuacct.usage").exists():
            cpu, cpu_src = (_read_int(d / "cpuacct.usage") or 0) / 1e9, "cgroup-v1"
        if (d / "memory.current").exists():
            mem, mem_src = _read_int(d / "memory.current"), "cgroup-v2"
            oom = _keyed(d / "memory.events").get("oom_kill", 0)
        elif (d / "memory.usage_in_bytes").exists():
            mem, mem_src = _read_int(d / "memory.usage_in_bytes"), "cgroup-v1"
            oom = _keyed(d / "memory.oom_control").get("oom_kill", 0)
    if cpu is None and pid is not None:
        cpu, cpu_src = procs.cpu_seconds(pid), "proc"
    if mem is None and pid is not None:
        mem, mem_src = procs.rss_bytes(pid), "proc"
    return Reading(cpu or 0.0, mem or 0, oom, cpu_src, mem_src)
