"""Issue 37 from inside a sandbox, on every backend (namespace, oci-runc, oci-runsc) and, for the
namespace backend, as an ordinary user: kernel channels that namespaces do not divide.

* vsock (finding 1) and the other refused socket families fail; unix, inet, inet6 and
  NETLINK_ROUTE still work (a loopback TCP connection, a socketpair, the interface list).
* io_setup (finding 2) fails inside while the host's own io_setup still works, so a sandbox can
  no longer take the host's whole `fs.aio-max-nr`.
* TCP buffers (one host-wide pool, net.ipv4.tcp_mem; cgroup v1 charges them to no memory limit
  unless told): 64 loopback connections never read held 239 MB in one sandbox; now at most the
  sandbox's TCP limit (32 MiB) on namespace and runc. Under gVisor the sentry's netstack holds them,
  in the sandbox's own memory, not the host's pool.
* A command cannot lower the daemon's rlimits (prlimit on pid 1 left the daemon unable to start
  any command) and a command that lowers its own oom_score_adj is raised back to 1000.

Under gVisor the sentry answers every seccomp refusal with EPERM, whatever the profile's errno.
"""

from __future__ import annotations

import ctypes
import errno
import json
import platform
from typing import Any

import pytest

from burstrl.sandbox.backends import seccomp
from tests.security import test_backends
from tests.security.test_backends import _gvisor, _serving
from tests.security.test_namespace_root import RUN_AS_USER, run_as_user

ARCH = {"amd64": "x86_64", "arm64": "aarch64"}.get(platform.machine().lower(), platform.machine())
NR = {"x86_64": seccomp._X86_64, "aarch64": seccomp._AARCH64}.get(ARCH, {})
pytestmark = pytest.mark.skipif(not NR, reason=f"no seccomp filter for {ARCH}")
sandbox = test_backends.sandbox  # the same fixture: a fresh sandbox of the module's backend per test

# name -> (family, type, protocol, socketpair?, the errno the filter gives)
REFUSED = {
    "vsock": (40, 1, 0, False, errno.EAFNOSUPPORT),
    "vsock_dgram": (40, 2, 0, False, errno.EAFNOSUPPORT),
    "vsock_pair": (40, 1, 0, True, errno.EAFNOSUPPORT),
    "packet": (17, 2, 0, False, errno.EAFNOSUPPORT),
    "alg": (38, 5, 0, False, errno.EAFNOSUPPORT),
    "key": (15, 3, 2, False, errno.EAFNOSUPPORT),
    "bluetooth": (31, 1, 3, False, errno.EAFNOSUPPORT),
    "netlink_sock_diag": (16, 3, 4, False, errno.EPROTONOSUPPORT),
    "netlink_uevent": (16, 3, 15, False, errno.EPROTONOSUPPORT),
}

FAMILIES = r"""
import json, socket, sys
out = {}
for name, (f, t, p, pair, _) in json.loads(sys.argv[1]).items():
    try:
        (socket.socketpair if pair else socket.socket)(f, t, p)
        out[name] = 0
    except OSError as e:
        out[name] = e.errno
print(json.dumps(out))
"""

ALLOWED = r"""
import json, socket
def talk(family, host):
    srv = socket.socket(family)
    srv.bind((host, 0))
    srv.listen(1)
    c = socket.create_connection(srv.getsockname()[:2], timeout=10)
    a, _ = srv.accept()
    c.sendall(b"ping")
    return a.recv(4) == b"ping"
a, b = socket.socketpair()
a.sendall(b"x")
out = {"tcp4": talk(socket.AF_INET, "127.0.0.1"), "tcp6": talk(socket.AF_INET6, "::1"),
       "unix_pair": b.recv(1) == b"x", "netlink_route": "lo" in [n for _, n in socket.if_nameindex()]}
print(json.dumps(out))
"""

# Tries to take the host's AIO pool, writes what it got, then holds any context it has until
# released (so the host's io_setup below runs while the attempt is held).
AIO = r"""
import ctypes, json, os, sys, time
nr = json.loads(sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)
got = []
for _ in range(4):
    ctx = ctypes.c_ulong(0)
    r = libc.syscall(ctypes.c_long(nr["io_setup"]), ctypes.c_long(32768), ctypes.byref(ctx))
    got.append(0 if r == 0 else ctypes.get_errno())
with open("/tmp/aio.json.part", "w") as f:
    json.dump(got, f)
os.rename("/tmp/aio.json.part", "/tmp/aio.json")
end = time.monotonic() + 120
while not os.path.exists("/tmp/aio.release") and time.monotonic() < end:
    time.sleep(0.05)
"""

PRLIMIT = r"""
import ctypes, json, resource
libc = ctypes.CDLL(None, use_errno=True)
class Limit(ctypes.Structure):
    _fields_ = [("cur", ctypes.c_ulong), ("max", ctypes.c_ulong)]
low, old = Limit(4, 4), Limit()
r = libc.prlimit(1, resource.RLIMIT_NOFILE, ctypes.byref(low), None)
out = {"set_daemon": 0 if r == 0 else ctypes.get_errno()}
out["read_daemon"] = libc.prlimit(1, resource.RLIMIT_NOFILE, None, ctypes.byref(old)) == 0
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.prlimit(0, resource.RLIMIT_NOFILE, (min(soft, 64), hard))  # its own: allowed
out["set_own"] = resource.getrlimit(resource.RLIMIT_NOFILE)[0] == min(soft, 64)
print(json.dumps(out))
"""

# Lowers its own oom_score_adj (commands start at 1000), then waits for the daemon to raise it.
OOM = r"""
import time
with open("/proc/self/oom_score_adj", "w") as f:
    f.write("0")
end, value = time.monotonic() + 30, "0"
while value != "1000" and time.monotonic() < end:
    time.sleep(0.05)
    with open("/proc/self/oom_score_adj") as f:
        value = f.read().strip()
print(value)
"""


# Opens N loopback connections and fills each one's buffers (the reader never reads) until the
# kernel refuses more: the bytes the sandbox got the host to hold.
TCP_HOARD = r"""
import json, socket, sys
n, total, held = int(sys.argv[1]), 0, []
srv = socket.socket()
srv.bind(("127.0.0.1", 0))
srv.listen(n)
for _ in range(n):
    c = socket.create_connection(srv.getsockname())
    held += [c, srv.accept()[0]]
    c.setblocking(False)
    while True:
        try:
            total += c.send(b"x" * 65536)
        except OSError:
            break
print(json.dumps({"connections": n, "held_mib": total / 2**20}))
"""


def _refused(backend: Any, want: int) -> set[int]:
    """The errnos a refusal may show: the filter's own, or EPERM from gVisor's sentry."""
    return {want, errno.EPERM} if _gvisor(backend) else {want}


def _run(sb: Any, code: str, *args: str, timeout: float = 60) -> Any:
    """Run `code` inside with `args`; its stdout (JSON) decoded."""
    sb.client.write_file("/tmp/probe.py", code)
    r = sb.exec(["python3", "/tmp/probe.py", *args], timeout=timeout)
    assert r.exit_code == 0, (r.stdout, r.stderr)
    return json.loads(r.stdout)


def test_refused_socket_families_fail_inside(sandbox: Any, backend: Any) -> None:
    """Finding 1: socket(AF_VSOCK) passed the filter, and vsock has one port space for the machine."""
    out = _run(sandbox, FAMILIES, json.dumps(REFUSED))
    for name, (*_, want) in REFUSED.items():
        assert out[name] in _refused(backend, want), (name, out)
    _serving(sandbox)


def test_allowed_families_still_work(sandbox: Any) -> None:
    out = _run(sandbox, ALLOWED)
    assert out == {"tcp4": True, "tcp6": True, "unix_pair": True, "netlink_route": True}, out


def _host_io_setup() -> int:
    """The host's own io_setup(1): 0, or its errno."""
    libc = ctypes.CDLL(None, use_errno=True)
    ctx = ctypes.c_ulong(0)
    if libc.syscall(ctypes.c_long(NR["io_setup"]), ctypes.c_long(1), ctypes.byref(ctx)) != 0:
        return ctypes.get_errno()
    libc.syscall(ctypes.c_long(NR["io_destroy"]), ctx)
    return 0


def test_the_hosts_aio_pool_is_out_of_reach(sandbox: Any, backend: Any) -> None:
    """Finding 2: two io_setup calls inside took all of fs.aio-max-nr and the host's own failed."""
    if _host_io_setup() != 0:
        pytest.skip(f"io_setup does not work on this host: errno {_host_io_setup()}")
    sandbox.client.write_file("/tmp/aio.py", AIO)
    # In its own session, so it outlives this exec (whose process group goes when the exec
    # returns); the exec returns once the attacker has reported, then holds what it got.
    started = sandbox.exec(f"setsid python3 /tmp/aio.py '{json.dumps(NR)}' </dev/null >/tmp/aio.log 2>&1 & "
                           "i=0; until [ -e /tmp/aio.json ] || [ $i -ge 1200 ]; do sleep 0.05; i=$((i+1)); done; "
                           "cat /tmp/aio.json /tmp/aio.log", timeout=120)
    try:
        got = json.loads(started.stdout.splitlines()[0])
        assert _host_io_setup() == 0  # while the attacker holds whatever it got
    finally:
        sandbox.client.write_file("/tmp/aio.release", "")
    assert set(got) <= _refused(backend, errno.ENOSYS), got
    _serving(sandbox)


def test_tcp_buffers_a_sandbox_holds_are_bounded(sandbox: Any, backend: Any) -> None:
    out = _run(sandbox, TCP_HOARD, "64", timeout=120)
    assert out["connections"] == 64
    if not _gvisor(backend):  # 32 MiB (`cgroups.TCP_LIMIT`) and what the last send got past it
        assert out["held_mib"] <= 40, out


def test_commands_cannot_change_the_daemons_limits(sandbox: Any, backend: Any) -> None:
    """prlimit(1, RLIMIT_NOFILE, 4) from a command (the daemon's uid) left the daemon unable to
    open the pipes of any later exec; a process still sets its own limits."""
    out = _run(sandbox, PRLIMIT)
    assert out["set_daemon"] in _refused(backend, errno.EPERM), out
    # Under gVisor pid 1 is the commands' init (`sandbox.cmdns`), of another uid: not even readable.
    assert (out["read_daemon"] or _gvisor(backend)) and out["set_own"], out
    _serving(sandbox)


def test_a_lowered_oom_score_is_raised_again(sandbox: Any) -> None:
    """A command may set its oom_score_adj back to 0 (the floor it inherited); the daemon, pid 1,
    raises it to 1000 again within its reap interval."""
    sandbox.client.write_file("/tmp/oom.py", OOM)
    assert sandbox.exec("python3 /tmp/oom.py", timeout=60).stdout == "1000\n"


def _user_attacks() -> dict[str, str]:
    """Shell commands for RUN_AS_USER: each prints "refused"/"ok" for what must happen, "BAD" else."""
    py = "python3 -c 'import sys; exec(sys.argv[1])' "
    refuse = ("import socket, sys\ntry:\n    {call}\n    print('BAD')\n"
              "except OSError as e:\n    print('refused', e.errno)")
    io_setup = (f"import ctypes\nc = ctypes.c_ulong()\nr = ctypes.CDLL(None).syscall({NR['io_setup']}, 1, "
                "ctypes.byref(c))\nprint('BAD' if r == 0 else 'refused')")
    prlimit = ("import ctypes\nl = (ctypes.c_ulong * 2)(4, 4)\n"
               "print('BAD' if ctypes.CDLL(None).prlimit(1, 7, l, None) == 0 else 'refused')")
    checks = {"vsock": refuse.format(call="socket.socket(40, 1)"),
              "packet": refuse.format(call="socket.socket(17, 2)"),
              "netlink_diag": refuse.format(call="socket.socket(16, 3, 4)"),
              "io_setup": io_setup, "prlimit_daemon": prlimit,
              "allowed": ALLOWED + "print('ok' if all(out.values()) else 'BAD')",
              "oom": OOM + "print('ok' if value == '1000' else 'BAD')"}
    return {name: py + _quote(code) for name, code in checks.items()}


def _quote(code: str) -> str:
    return "'" + code.replace("'", "'\\''") + "'"


def test_the_same_as_an_ordinary_user() -> None:
    """The namespace backend run by an ordinary user (as test_namespace_root does): every refusal
    holds there too, the allowed families work, and the daemon keeps serving after each."""
    res = run_as_user(RUN_AS_USER, ATTACKS=_user_attacks())
    assert res["rc"] == 0 and res["out"].split()[0] != "0", res
    for name, got in res["attacks"].items():
        assert got["alive"] and "BAD" not in got["out"], (name, got)
        assert ("refused" if name not in ("allowed", "oom") else "ok") in got["out"], (name, got)
