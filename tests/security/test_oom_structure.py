"""Issue 37: the daemon's OOM protection by structure. Where the harness makes the sandbox's memory
cgroup S (namespace as root, runc on cgroup v1), every command runs in S/cmds, limited to S's limit
less a reserve for the daemon, and the daemon stays outside it: an OOM there picks commands only,
whatever their oom_score_adj. Before, only the commands' score 1000 (lowered by any command, raised
again by the pid 1 daemon within 0.5 s) stood between a crowd of small processes and the daemon.

* The attack: many small processes that keep setting their own oom_score_adj back to 0 and together
  allocate past the limit. Without the structure the daemon (~19 MB, larger than each) was the OOM
  victim within a second; with it, the kills land in S/cmds and the daemon serves on.
* A command holds no fd of the cgroup (the shell prefix moved itself and closed it) and is in
  .../cmds; the daemon is not.
* close() removes S/cmds and S.
* In-process (no root, no cgroup): the runtime hands each command the fd at 9 and the prefix, shell
  or not, writes "0" there and closes it before the command runs; a move that fails runs nothing.

Backends without the structure (gVisor, whose sentry holds the cgroup; cgroup v2 under runc; an
ordinary user) skip with the report's reason.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

import pytest

from burstrl.sandbox import runtime
from burstrl.sandbox.backends.base import SandboxSpec, process_start_time, read_owner
from burstrl.sandbox.backends.cgroups import CMDS, DAEMON_LEAF
from burstrl.sandbox.protocol import ExecRequest
from burstrl.sandbox.runtime import Runtime
from tests.security.test_backends import _serving
from tests.waiting import wait_for

# Each child: its score back to 0 every 2 ms, MB of its own at once; the parent (also at 0) keeps
# K children alive, respawning the killed ones, until /tmp/attack.stop exists. Children leave when
# the stop file appears or their parent is gone, so the attack ends by itself however it went.
ATTACK = r"""
import os, sys, time
K, MB = int(sys.argv[1]), int(sys.argv[2])
STOP = "/tmp/attack.stop"


def lower(fd):
    try:
        os.lseek(fd, 0, 0)
        os.write(fd, b"0")
    except OSError:
        pass


def child(parent):
    fd = os.open("/proc/self/oom_score_adj", os.O_WRONLY)
    lower(fd)
    held = b"\x01" * (MB << 20)
    while os.getppid() == parent and not os.path.exists(STOP):
        lower(fd)
        time.sleep(0.002)
    return held


def spawn():
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:
        try:
            child(parent)
        finally:
            os._exit(0)
    return pid


open("/tmp/attack.started", "w").close()
own = os.open("/proc/self/oom_score_adj", os.O_WRONLY)
lower(own)
for _ in range(K):
    spawn()
while not os.path.exists(STOP):
    lower(own)
    try:
        pid, _ = os.waitpid(-1, os.WNOHANG)
    except ChildProcessError:
        pid = 0
    if pid:
        spawn()
    else:
        time.sleep(0.005)
"""
LIMIT_MB = 256
CHILDREN, CHILD_MB = 48, 6  # 48 x (6 MB + python's own) is well past 256 MB; each is smaller than the daemon
OOM_KILLS = 5


def _detached(cmd: str, started: str) -> str:
    """Run `cmd` in a session of its own, so it outlives the exec (whose process group goes when the
    exec returns); the exec returns once `started` (a file or a cmdline pattern) shows it running,
    by then in its new session: it is started by the setsid'd shell, not forked off this one."""
    return (f"(setsid sh -c '{cmd} </dev/null >>/tmp/detached.log 2>&1 &' &); "
            f"i=0; until {started} || [ $i -ge 2400 ]; do sleep 0.05; i=$((i+1)); done")


def _memory_cgroup(backend: Any, sb: Any) -> Path:
    """S: the sandbox's memory cgroup on the host (v1's memory one, or its v2 one: with a `cmds` child)."""
    if backend.name == "namespace":
        dirs = read_owner(sb.path).get("cgroups", [])
    else:
        from burstrl.sandbox.backends.oci import cgroup_dirs, cgroup_name

        dirs = cgroup_dirs(cgroup_name(backend.state_dir, sb.id))
    found = [Path(d) for d in dirs if (Path(d) / CMDS / "cgroup.procs").exists()]
    assert len(found) == 1, (dirs, found)
    return found[0]


def _oom_kills(cgroup: Path) -> int:
    """The `oom_kill` count of `cgroup` (v1 memory.oom_control, v2 memory.events; 0 once it is gone)."""
    for name in ("memory.oom_control", "memory.events"):
        with contextlib.suppress(OSError):
            text = (cgroup / name).read_text()
            return next((int(line.split()[1]) for line in text.splitlines() if line.startswith("oom_kill ")), 0)
    return 0


def _outside_cmds(s: Path) -> list[tuple[int, int | None]]:
    """(host pid, start time) of the processes in S itself (v1: not its children's) or, on v2, in
    its leaf S/daemon: the daemon (and, for the namespace backend, bwrap's monitor)."""
    leaf = s / DAEMON_LEAF if (s / DAEMON_LEAF).is_dir() else s
    try:
        pids = [int(p) for p in (leaf / "cgroup.procs").read_text().split()]
    except OSError:
        return []
    return sorted((pid, process_start_time(pid)) for pid in pids)


def _in_cmds(s: Path) -> list[str]:
    try:
        return (s / CMDS / "cgroup.procs").read_text().split()
    except OSError:
        return []


def _alive(processes: list[tuple[int, int | None]]) -> bool:
    """Whether every one of `processes` (host pid, start time) is still the process it was."""
    return all(process_start_time(pid) == start for pid, start in processes)


def _structured(backend: Any, **spec: Any) -> Any:
    sb = backend.create(SandboxSpec(**spec))
    if sb.limits.oom != "cgroup":
        sb.close()
        name = backend.name + (f"-{Path(backend.runtime).name}" if hasattr(backend, "runtime") else "")
        pytest.skip(f"{name}: no commands' memory cgroup here: " + "; ".join(sb.limits.reasons))
    return sb


def test_a_crowd_of_lowered_scores_cannot_get_the_daemon_killed(backend: Any) -> None:
    """Before the structure the daemon died in the first OOM (namespace and runc alike)."""
    sb = _structured(backend, memory_limit_mb=LIMIT_MB, pids_limit=256)
    try:
        s = _memory_cgroup(backend, sb)
        daemon = _outside_cmds(s)
        health_pid = sb.client.health().pid
        sb.client.write_file("/tmp/attack.py", ATTACK)
        sb.exec(_detached(f"python3 /tmp/attack.py {CHILDREN} {CHILD_MB}", "[ -e /tmp/attack.started ]"),
                timeout=180)
        # Until OOM_KILLS kills, or the attack ended after some (v2's oom.group ends all of it at
        # once; an OOM may also take the attack's parent), or the daemon died.
        try:
            wait_for(lambda: _oom_kills(s / CMDS) >= OOM_KILLS or not _alive(daemon)
                     or (_oom_kills(s / CMDS) and not _in_cmds(s)), 180, "OOM kills in the commands' cgroup")
        except AssertionError as exc:
            raise AssertionError(f"{exc}: {_oom_kills(s / CMDS)} so far, {len(_in_cmds(s))} processes in cmds, "
                                 f"log: {sb.read_file('/tmp/detached.log')[-2000:]!r}") from None
        kills, outside = _oom_kills(s / CMDS), _oom_kills(s)
        print(f"OOM kills: {kills} in cmds, {outside} counted in S")
        assert _alive(daemon), f"the daemon was killed: OOM kills {kills} in cmds, {outside} in S"
        assert kills >= 1 and outside in (0, kills), (outside, kills)  # counted where the victim was, or up the tree
        sb.client.write_file("/tmp/attack.stop", "")  # the daemon's own write: no command needed
        wait_for(lambda: not _in_cmds(s), 120, "the attack gone")
        assert sb.client.health().pid == health_pid
        _serving(sb)
        assert _outside_cmds(s) == daemon
    finally:
        sb.close()


def test_a_command_holds_no_cgroup_fd_and_runs_in_cmds(backend: Any) -> None:
    sb = _structured(backend, memory_limit_mb=LIMIT_MB)
    try:
        shell = sb.exec("ls /proc/self/fd; echo 1 >&9 && echo WROTE; cat /proc/self/cgroup")
        listed = sb.exec(["python3", "-c", "import os; print(' '.join(sorted(os.listdir('/proc/self/fd'))))"])
        daemon = sb.exec("cat /proc/1/cgroup")
    finally:
        sb.close()
    lines = shell.stdout.splitlines()
    assert "9" not in lines and "WROTE" not in lines, shell
    assert "9" not in listed.stdout.split(), listed
    assert _memory_path(shell.stdout).endswith("/" + CMDS), shell.stdout
    assert not _memory_path(daemon.stdout).endswith("/" + CMDS), daemon.stdout


def _memory_path(proc_cgroup: str) -> str:
    """The memory controller's path in a /proc/<pid>/cgroup text (v1's memory line, else v2's)."""
    paths = {}
    for line in proc_cgroup.splitlines():
        fields = line.split(":", 2)
        if len(fields) == 3:
            paths.update({ctrl: fields[2] for ctrl in fields[1].split(",")})
    assert "memory" in paths or "" in paths, proc_cgroup
    return paths["memory"] if "memory" in paths else paths[""]


def test_close_removes_both_cgroups(backend: Any) -> None:
    sb = _structured(backend, memory_limit_mb=LIMIT_MB)
    try:
        s = _memory_cgroup(backend, sb)
        # left in cmds: close must empty it before its rmdir
        sb.exec(_detached("sleep 4242", "grep -q 424[2] /proc/[0-9]*/cmdline 2>/dev/null"), timeout=180)
        wait_for(lambda: _in_cmds(s), 60, "the sleep in cmds")
    finally:
        sb.close()
    assert not (s / CMDS).exists() and not s.exists()


# ---- in-process: the fd handed to each command, with a pipe standing in for cgroup.procs ----


@pytest.fixture
def piped(tmp_path: Path) -> Any:
    """(runtime given a pipe's write end as its cgroup fd, the read end)."""
    read, write = os.pipe()
    os.set_blocking(read, False)
    rt = Runtime(root=str(tmp_path), cgroup_fd=write)
    yield rt, read
    rt.close()
    os.close(read)


def _written(read: int) -> bytes:
    try:
        return os.read(read, 4096)
    except BlockingIOError:
        return b""


def test_each_command_moves_itself_then_closes_the_fd(piped: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    rt, read = piped
    res = rt.exec(ExecRequest(cmd="ls /proc/self/fd; echo x >&9 || echo closed"))
    assert _written(read) == b"0\n" and "9" not in res.stdout.split() and "closed" in res.stdout, res
    res = rt.exec(ExecRequest(cmd=["ls", "/proc/self/fd"]))
    assert _written(read) == b"0\n" and "9" not in res.stdout.split(), res
    monkeypatch.setattr(runtime, "SHELL", "/no/shell/in/this/image")  # the python3 -c entry
    res = rt.exec(ExecRequest(cmd=["ls", "/proc/self/fd"]))
    assert _written(read) == b"0" and "9" not in res.stdout.split(), res


def test_a_command_that_cannot_move_does_not_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    read, write = os.pipe()
    os.close(write)
    rt = Runtime(root=str(tmp_path), cgroup_fd=read)  # a read-only fd: every move fails
    res = rt.exec(ExecRequest(cmd="echo ran"))
    assert res.exit_code == 125 and "ran" not in res.stdout and "commands cgroup" in res.stderr, res
    monkeypatch.setattr(runtime, "SHELL", "/no/shell/in/this/image")
    res = rt.exec(ExecRequest(cmd=["echo", "ran"]))
    assert res.exit_code == 125 and "ran" not in res.stdout and "commands cgroup" in res.stderr, res


def test_without_a_cgroup_fd_nothing_changes(tmp_path: Path) -> None:
    rt = Runtime(root=str(tmp_path))
    res = rt.exec(ExecRequest(cmd="ls /proc/self/fd; cat /proc/self/oom_score_adj"))
    assert "9" not in res.stdout.split() and res.stdout.endswith("1000\n"), res
