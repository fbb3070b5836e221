"""Issue 37, finding 4: under gVisor a command could open the daemon's host fds through
/proc/1/fd (its stdout, the pipe the harness copied into daemon.log, and its stderr, daemon.log
itself), so a write inside grew a host file without bound. Now, on every backend: no process of
the sandbox holds a host fd once it is ready, a command that writes to every fd of every process
it can open grows nothing outside, and the harness keeps at most `DAEMON_LOG_MAX` bytes of a
sandbox's output whatever it writes.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from burstrl.sandbox.backends.base import SandboxSpec
from burstrl.sandbox.backends.launch import DAEMON_LOG_MAX, spawn, wait_ready
from tests.waiting import wait_for

# Opens every /proc/<pid>/fd/<n> it can (write-only and read-write, and connect for sockets),
# writes up to 4 MiB to each, and leaves what it saw in /tmp/fds.json (its own output goes nowhere,
# so the exec's output cap is not what bounds the test).
ATTACK = r"""
import json, os, socket
def attack(path):
    res = {}
    try:
        res["link"] = os.readlink(path)
    except OSError as e:
        res["link"] = "unreadable"
    for name, flags in (("w", os.O_WRONLY), ("rw", os.O_RDWR)):
        try:
            fd = os.open(path, flags | os.O_NONBLOCK | os.O_APPEND)
        except OSError as e:
            res[name] = -e.errno
            continue
        n = 0
        try:
            while n < 4 << 20:
                n += os.write(fd, b"x" * 65536)
        except OSError:
            pass
        os.close(fd)
        res[name] = n
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(3)
    try:
        s.connect(path)
        res["connect"] = "connected"
    except OSError as e:
        res["connect"] = -e.errno
    s.close()
    return res
out = {}
for pid in [p for p in os.listdir("/proc") if p.isdigit()] + ["self"]:
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        continue
    for fd in fds:
        out[f"{pid}/{fd}"] = attack(f"/proc/{pid}/fd/{fd}")
with open("/tmp/fds.json", "w") as f:
    json.dump(out, f)
"""


def test_no_fd_inside_reaches_a_host_file(backend: Any) -> None:
    with backend.create(SandboxSpec(memory_limit_mb=256)) as sb:
        log = sb.path / "daemon.log"
        before = log.stat().st_size
        sb.client.write_file("/tmp/attack.py", ATTACK)
        r = sb.exec("python3 /tmp/attack.py >/dev/null 2>&1", timeout=120)
        assert r.exit_code == 0, r.stderr
        seen = json.loads(sb.read_file("/tmp/fds.json"))
        grew = log.stat().st_size - before
        alive = sb.exec("echo alive").stdout
    assert seen, "the attack saw no fd at all"
    host = {k: v for k, v in seen.items() if v["link"].startswith("host:")}
    assert host == {}, host  # gVisor names a host-backed fd `host:[n]`: none is left inside
    assert grew < 64 << 10, f"daemon.log grew by {grew} bytes"
    assert alive == "alive\n"


CHATTY = r"""
import sys
sys.stderr.write("a runtime's warning\n")
sys.stderr.flush()
print('{"event": "ready", "pid": 1}', flush=True)
for _ in range(48):
    sys.stdout.write("o" * 65536)
    sys.stderr.write("e" * 65536)
"""


def test_the_harness_keeps_a_bounded_copy_of_sandbox_output(tmp_path: Path) -> None:
    """A daemon (here a stand-in) writing 6 MiB after its ready line leaves a log of at most
    `DAEMON_LOG_MAX` bytes and a note of what was dropped; lines before the ready line (stderr
    shares the pipe) are kept, not taken for a bad ready line."""
    log = tmp_path / "daemon.log"
    proc = spawn([sys.executable, "-c", CHATTY], {}, log)
    event = wait_ready(proc, 60, log)
    assert event == {"event": "ready", "pid": 1}
    assert proc.wait(timeout=60) == 0
    text = wait_for(lambda: (t := log.read_bytes()).endswith(b"dropped]\n") and t, 60, "the drained log")
    assert text.startswith(b"a runtime's warning\n")
    assert DAEMON_LOG_MAX <= len(text) < DAEMON_LOG_MAX + 200, len(text)
