"""Issue 37: `close()` returns only when every process of the sandbox is gone, or raises
`SandboxNotGone` naming the ones that are not, on every backend and as an ordinary user (whose
namespace sandbox has no cgroup to empty: its close returned while a double-forked command lived on).

A sandbox's host processes are its pid namespace's members (namespace backend) or its cgroups'
(oci: under gVisor the sentry's and gofer's, which hold the commands).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from burstrl.sandbox.backends import namespace
from burstrl.sandbox.backends.base import Sandbox, SandboxNotGone, SandboxSpec, process_start_time, read_owner
from burstrl.sandbox.backends.namespace import PidNamespace, members, namespace_init
from tests.security.test_sandbox_limits import run_as_user
from tests.waiting import wait_for

# A background command and a double-forked one in a session of its own (out of the daemon's
# reach by process group): what close must still end. The command waits until the second runs
# (the daemon kills the command's group when it ends, which the subshell is in until setsid).
LEAVE_BEHIND = ("sleep 4242 >/dev/null 2>&1 & (setsid sh -c 'sleep 4343 >/dev/null 2>&1 &' &); "
                "until grep -q '434[3]' /proc/[0-9]*/cmdline 2>/dev/null; do sleep 0.05; done")


def _host_processes(backend: Any, sb: Sandbox) -> list[tuple[int, int | None]]:
    """(host pid, start time) of every process of `sb` the host sees."""
    if backend.name == "namespace":
        pid_ns = PidNamespace(namespace_init(read_owner(sb.path)["pid"]))
        pids = members(pid_ns.ns)
        pid_ns.close()
    else:
        from burstrl.sandbox.backends.oci import cgroup_dirs, cgroup_name

        files = [Path(d) / "cgroup.procs" for d in cgroup_dirs(cgroup_name(backend.state_dir, sb.id))]
        pids = sorted({int(p) for f in files if f.exists() for p in f.read_text().split()})
    return [(pid, process_start_time(pid)) for pid in pids]


def _left_inside(sb: Sandbox) -> bool:
    return "4343" in sb.exec("cat /proc/[0-9]*/cmdline 2>/dev/null | tr '\\0' ' '").stdout


def test_close_returns_when_every_process_is_gone(backend: Any) -> None:
    sb = backend.create(SandboxSpec(memory_limit_mb=256))
    try:
        sb.exec(LEAVE_BEHIND, timeout=120)
        wait_for(lambda: _left_inside(sb), 60, "the double-forked sleep running")
        before = _host_processes(backend, sb)
        assert before, "no host process of the sandbox found"
    finally:
        sb.close()
    alive = [pid for pid, start in before if _running(pid, start)]
    assert alive == [], alive


def _running(pid: int, start: int | None, stat: str | None = None) -> bool:
    """Whether the process that had `pid` and `start` still runs (a zombie is gone: it holds
    nothing but its pid until its new parent, the host's init here, reaps it); `stat` as read
    from /proc/PID/stat then, or now."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text() if stat is None else stat
    except OSError:
        return False
    fields = stat.rsplit(")", 1)[1].split() if stat else ["Z"]
    return fields[0] != "Z" and int(fields[19]) == start


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap (bwrap) is not installed")
@pytest.mark.filterwarnings("ignore:sandbox limits not fully enforced")
def test_an_ordinary_users_close_waits_too() -> None:
    """The same with no cgroup at all: the daemon's pidfd turns readable only once the kernel
    has ended every other process of its pid namespace."""
    res = run_as_user(AS_USER, LEAVE_BEHIND=LEAVE_BEHIND, ROUNDS=3)  # without the wait, 2 in 3 closes failed
    assert sum("4343" in cmd for _, _, cmd in res["before"]) == 3, res
    pairs = zip(res["before"], res["after"], strict=True)
    left = [pid for (pid, start, _), stat in pairs if _running(pid, start, stat)]
    assert left == [], res


AS_USER = """
import json, os, sys, tempfile, time, warnings
from pathlib import Path
sys.path.insert(0, SRC)
warnings.simplefilter("ignore")
from burstrl.sandbox.backends import make_backend
from burstrl.sandbox.backends.base import SandboxSpec, process_start_time, read_owner
from burstrl.sandbox.backends.namespace import PidNamespace, members, namespace_init
def read(path):
    try:
        return open(path, "rb").read().replace(b"\\0", b" ").decode()
    except OSError:
        return ""
def cmdline(pid):
    return read(f"/proc/{pid}/cmdline")
def one(backend):
    sb = backend.create(SandboxSpec(memory_limit_mb=256))
    try:
        sb.exec(LEAVE_BEHIND, timeout=120)
        ns = PidNamespace(namespace_init(read_owner(sb.path)["pid"])).ns
        end = time.monotonic() + 60
        while not any("4343" in cmdline(p) for p in members(ns)) and time.monotonic() < end:
            time.sleep(0.05)
        before = [(p, process_start_time(p), cmdline(p)) for p in members(ns)]
    finally:
        sb.close()
    return before, [read(f"/proc/{p}/stat") for p, _, _ in before]
backend = make_backend("namespace", state_dir=Path(tempfile.mkdtemp(prefix="sbx", dir="/tmp")))
rounds = [one(backend) for _ in range(ROUNDS)]
print(json.dumps({"before": [b for r in rounds for b in r[0]], "after": [a for r in rounds for a in r[1]]}))
"""


def test_a_process_that_outlives_the_kill_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where a process of the sandbox is still there after the wait, close removes the rest
    and raises with its pid (here one the kill is made to report)."""
    from tests.security.conftest import open_backend

    backend, state = open_backend("namespace")
    real = namespace._kill
    monkeypatch.setattr(namespace, "_kill", lambda st: [*real(st), 4_000_000])
    sb = backend.create(SandboxSpec(memory_limit_mb=128))
    with pytest.raises(SandboxNotGone) as exc:
        sb.close()
    assert exc.value.pids == [4_000_000] and not sb.path.exists()
    shutil.rmtree(state, ignore_errors=True)


@pytest.mark.skipif(shutil.which("unshare") is None, reason="util-linux unshare is not installed")
def test_pid_namespace_names_what_is_left_until_killed() -> None:
    """A pid namespace's init never killed is reported (with its host pid); once killed, the
    wait ends with nothing left."""
    proc = subprocess.Popen(["unshare", "--user", "--map-root-user", "--pid", "--fork", "sleep", "600"])
    try:
        init = wait_for(lambda: _init_or_none(proc.pid), 60, "the namespace's init")
        ns = PidNamespace(init)
        assert ns.wait_gone(timeout=0.2) == [init]
        ns.kill()
        assert ns.wait_gone() == []
        ns.close()
    finally:
        proc.kill()
        proc.wait()


def _init_or_none(pid: int) -> int | None:
    try:
        return namespace_init(pid)
    except RuntimeError:
        return None
