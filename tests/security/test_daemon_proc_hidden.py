"""Issue 49, finding 3: nothing of the daemon's process can be read or opened by a command, on every
backend (namespace, oci-runc, oci-runsc).

Before, under gVisor a command read the daemon's (pid 1's) /proc/1/environ, maps, auxv and its threads'
environ, and opened its fds 0-2 and two of its pipes for reading and writing: the sentry applies
neither non-dumpability nor (runsc 20221219) OCI maskedPaths there. Now commands under runsc live in a
pid namespace of their own (`sandbox.cmdns`), whose pid 1 is a bare init with an empty env; elsewhere
pid 1 may be the daemon, made non-dumpable, whose files the kernel then refuses.

What is checked, from inside: pid 1's environ, maps, auxv, its threads' environ (through
/proc/1/task and /proc/<tid>) and /proc/1/fd/0-31 opened for reading and writing; where pid 1 is not
the daemon, no process of the command's /proc is the daemon and pid 1's fds are /dev/null only. And
anywhere under /proc: neither the daemon's token nor its SANDBOXD_ENV in any file a command can read.
The controls show that ordinary work with processes still works, and `kill -9 1` / `kill -9 -1` from a
command leave the sandbox serving.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

from burstrl.sandbox.backends.base import SandboxSpec

DAEMON_MARK = "burstrl.sandbox.daemon"  # in the daemon's command line (its bootstrap), nowhere else
# Reads what a command can of pid 1 and of every process in its /proc; prints a JSON report.
PROBE = r"""
import errno, json, os, sys
token, mark = open(sys.argv[1]).read(), "burstrl.sandbox." + "daemon"  # never in this probe's argv
os.unlink(sys.argv[1])
def read(path):
    try:
        with open(path, "rb") as f:
            return f.read(1 << 20)
    except OSError as exc:
        return None
def cmdline(pid):
    return (read(f"/proc/{pid}/cmdline") or b"").replace(b"\0", b" ").decode(errors="replace")
out = {"pid1_cmdline": cmdline(1), "readable": {}, "opened_fds": {}, "daemon_pids": [], "leaks": []}
for name in ("environ", "maps", "auxv"):
    out["readable"][name] = read(f"/proc/1/{name}") is not None
try:
    tids = os.listdir("/proc/1/task")
except OSError:
    tids = []
out["readable"]["task_environ"] = [t for t in tids if read(f"/proc/1/task/{t}/environ") is not None]
out["readable"]["tid_environ"] = [t for t in tids if t != "1" and read(f"/proc/{t}/environ") is not None]
for n in range(32):
    for mode, flag in (("r", os.O_RDONLY), ("w", os.O_WRONLY)):
        try:
            fd = os.open(f"/proc/1/fd/{n}", flag | os.O_NONBLOCK | os.O_NOCTTY)
        except OSError:
            continue
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            target = "?"
        os.close(fd)
        out["opened_fds"][f"{n}{mode}"] = target
pids = [p for p in os.listdir("/proc") if p.isdigit()]
for pid in pids:
    if mark in cmdline(pid):
        out["daemon_pids"].append(pid)
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        tasks = []
    paths = [f"/proc/{pid}/{n}" for n in ("environ", "cmdline", "maps", "auxv", "status", "stat", "comm",
                                          "limits", "mountinfo", "io", "smaps")]
    paths += [f"/proc/{pid}/task/{t}/{n}" for t in tasks for n in ("environ", "cmdline", "comm")]
    for path in paths:
        data = read(path)
        if data is not None and (token.encode() in data or b"SANDBOXD_ENV" in data):
            out["leaks"].append(path)
print(json.dumps(out))
"""


def _probe(sb: Any) -> dict[str, Any]:
    sb.write_file("/tmp/probe.py", PROBE)
    sb.write_file("/tmp/token", sb.client.token)  # a file: in argv or env the probe itself would hold it
    r = sb.exec(["python3", "/tmp/probe.py", "/tmp/token"], timeout=120)
    assert r.exit_code == 0, (r.stdout, r.stderr)
    return json.loads(r.stdout)


def test_a_command_reads_and_opens_nothing_of_the_daemon(backend: Any) -> None:
    with backend.create(SandboxSpec(memory_limit_mb=256)) as sb:
        sb.exec("sleep 0.1")  # the daemon has run commands (and started its threads) by now
        got = _probe(sb)
    assert got["leaks"] == [], got["leaks"]
    if DAEMON_MARK in got["pid1_cmdline"]:  # pid 1 is the daemon: the kernel refuses all of it
        readable = got["readable"]
        assert not any(readable[n] for n in ("environ", "maps", "auxv")), readable
        assert readable["task_environ"] == [] and readable["tid_environ"] == [], readable
        assert got["opened_fds"] == {}, got["opened_fds"]
    else:  # pid 1 is the commands' init: the daemon is nowhere in sight, and the init holds nothing
        assert got["daemon_pids"] == [], got
        assert set(got["opened_fds"].values()) <= {"/dev/null"}, got["opened_fds"]


def test_kill_everything_from_a_command_leaves_the_sandbox_serving(backend: Any) -> None:
    with backend.create(SandboxSpec(memory_limit_mb=256)) as sb:
        for cmd in ("kill -9 1", "kill -9 -1", "kill -STOP 1", "kill -9 -1; kill -9 1"):
            sb.exec(cmd, timeout=30)
            r = sb.exec("echo alive", timeout=30)
            assert (r.exit_code, r.stdout) == (0, "alive\n"), (cmd, r)


# What commands do with processes, which must keep working: ps, /proc/self, a pipeline, a
# background job, a child killed by pid and waited for, a process group of their own (setsid)
# killed whole and its members reaped (kill -0 succeeds on a zombie).
CONTROL = r"""
set -e
ps -ef | grep -q "[p]s -ef"
[ "$(sleep 0.2 | sleep 0.2 | echo piped | cat)" = piped ]
test -r /proc/self/status && grep -q '^Pid:' /proc/self/status && test -r /proc/self/maps
python3 -c 'import os; print("py", os.getpid() > 0)'
sleep 30 & child=$!
kill -0 $child && kill $child && ! wait $child 2>/dev/null
setsid sh -c 'sleep 31 & echo $! >/tmp/g1; sleep 32 & echo $! >/tmp/g2; wait' &
until [ -s /tmp/g1 ] && [ -s /tmp/g2 ]; do sleep 0.05; done
pgid=$(ps -o pgid= -p "$(cat /tmp/g1)" | tr -d ' ')
[ -n "$pgid" ] && [ "$pgid" = "$(ps -o pgid= -p "$(cat /tmp/g2)" | tr -d ' ')" ] && [ "$pgid" != "$(ps -o pgid= -p $$ | tr -d ' ')" ]
kill -9 "-$pgid"
while kill -0 "$(cat /tmp/g1)" 2>/dev/null || kill -0 "$(cat /tmp/g2)" 2>/dev/null; do sleep 0.05; done
echo done
"""


def test_commands_still_manage_their_own_processes(backend: Any) -> None:
    """The default pids limit: under gVisor the host's pids cgroup counts the sentry's threads (~15
    per process inside), so 128 leaves room for only a few processes at once, before as now."""
    with backend.create(SandboxSpec(memory_limit_mb=256)) as sb:
        r = sb.exec(CONTROL, timeout=60)
        assert r.exit_code == 0 and r.stdout.endswith("py True\ndone\n"), (r.exit_code, r.stdout, r.stderr)
        start = time.monotonic()
        r = sb.exec("sleep 30", timeout=1)
        assert r.timed_out and time.monotonic() - start < 10, r
        r = sb.exec("sleep 31 & echo $!")  # a background job ends with its exec
        assert r.exit_code == 0 and not _running(sb, "sleep 31"), r


def test_close_ends_a_running_exec_and_what_escaped(backend: Any) -> None:
    sb = backend.create(SandboxSpec(memory_limit_mb=256))
    done = threading.Event()
    try:
        # The exec waits for it: its group is killed when it ends, which the subshell is in until setsid.
        # (`44""44`: only the sleep's own command line reads "sleep 4444".)
        sb.exec("""(setsid sh -c 'sleep 44""44 >/dev/null 2>&1 &' &); """
                """until cat /proc/[0-9]*/cmdline | tr '\\0' ' ' | grep -q 'sleep 444[4]'; do sleep 0.05; done""",
                timeout=60)
        assert _running(sb, "sleep 4444")

        def long_exec() -> None:
            try:
                sb.exec("sleep 600", timeout=600)
            except Exception:  # the sandbox went away under it: what close must do
                pass
            done.set()

        threading.Thread(target=long_exec, daemon=True).start()
        time.sleep(0.5)
    finally:
        sb.close()  # raises SandboxNotGone where a process outlived it
    assert done.wait(30), "the running exec outlived close"


def _running(sb: Any, text: str) -> bool:
    pattern = text[:-1] + "[" + text[-1] + "]"  # not the grep itself
    return sb.exec(f"cat /proc/[0-9]*/cmdline 2>/dev/null | tr '\\0' ' ' | grep -q '{pattern}'").exit_code == 0
