"""Issue 49, findings 1 and 2: what a command receives from its daemon, on every backend (as root,
and the namespace backend as an ordinary user).

1. Fds: a command holds exactly the fds its spawn names (0-2; a private-output exec's stdout and
   stderr are still 1 and 2). Before, every command held the daemon's inherited listening socket
   (fd 11 on namespace, 3 on runc) and could accept() the harness's next connections.
2. Environment: built from the allow-list (`runtime.DEFAULT_ENV`, HOME, the spec's and image's
   Env, the request's env) and the PWD a shell sets; nothing of the harness's or the daemon's.
   Before, the command prefix's `cd` exported OLDPWD.
"""

from __future__ import annotations

import json
import os
import socket
import time
from typing import Any

import pytest

from burstrl.sandbox.backends.base import SOCKET_NAME, SandboxSpec
from tests.security.test_namespace_root import run_as_user

# Prints the fds still open after listing /proc/self/fd (the listing's own fd is closed by then),
# each with what it points to.
LIST_FDS = ("python3 -c 'import json, os\n"
            "out = {}\n"
            "for n in os.listdir(\"/proc/self/fd\"):\n"
            "    try:\n        out[n] = os.readlink(\"/proc/self/fd/\" + n)\n"
            "    except OSError:\n        pass\n"
            "print(json.dumps(out))'")
SHELL_SET = {"PWD"}  # what the command's shell itself exports
HOST_VAR = "BURSTRL_HARNESS_ONLY"
SPEC_ENV = {"SPEC_VAR": "spec"}
REQUEST_ENV = {"REQUEST_VAR": "request"}
# Forks a session of its own (so it outlives the exec), then accept()s on every socket fd it holds
# for a few seconds, one blocked thread per fd, and answers each connection it gets, marked STOLEN.
ACCEPT_ALL = r"""
import os, socket, stat, threading, time
r, w = os.pipe()
if os.fork():
    os.read(r, 1)  # the child has left the exec's process group, which is killed when we exit
    os._exit(0)
os.setsid()
os.write(w, b"x")
os.close(r)
os.close(w)
def serve(s):
    while True:
        try:
            conn, _ = s.accept()
        except OSError:
            return
        conn.recv(65536)
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 7\r\nConnection: close\r\n\r\nSTOLEN\n")
        conn.close()
        with open("/tmp/stolen", "a") as f:
            f.write("x")
n_socks = 0
for n in os.listdir("/proc/self/fd"):
    try:
        if stat.S_ISSOCK(os.fstat(int(n)).st_mode):
            threading.Thread(target=serve, args=(socket.socket(fileno=os.dup(int(n))),), daemon=True).start()
            n_socks += 1
    except OSError:
        pass
open("/tmp/accept.ready", "w").write(str(n_socks))
time.sleep(6)
"""


def _fds(sb: Any, private_output: bool = False) -> dict[str, str]:
    r = sb.exec(LIST_FDS, private_output=private_output)
    assert r.exit_code == 0, r.stderr
    return json.loads(r.stdout)


def _env_names(sb: Any) -> set[str]:
    r = sb.exec("env", env=REQUEST_ENV)
    assert r.exit_code == 0, r.stderr
    return {line.split("=", 1)[0] for line in r.stdout.splitlines() if "=" in line}


def test_the_runtime_passes_no_fd_of_its_own(tmp_path: Any) -> None:
    """The mechanism without a sandbox: an fd the daemon's process holds inheritable (as the
    listening socket a runtime hands over is) reaches no command, plain or private-output, and the
    command's env has no OLDPWD."""
    from burstrl.sandbox.protocol import ExecRequest
    from burstrl.sandbox.runtime import Runtime

    read, write = os.pipe()
    os.set_inheritable(write, True)
    try:
        rt = Runtime(root=str(tmp_path))
        for private in (False, True):
            r = rt.exec(ExecRequest(cmd=LIST_FDS, private_output=private))
            assert sorted(json.loads(r.stdout)) == ["0", "1", "2"], (private, r.stdout, r.stderr)
        names = {line.split("=", 1)[0] for line in rt.exec(ExecRequest(cmd="env")).stdout.splitlines()}
        assert "OLDPWD" not in names, names
    finally:
        os.close(read)
        os.close(write)


def test_a_command_holds_only_the_fds_its_spawn_names(backend: Any) -> None:
    with backend.create(SandboxSpec(memory_limit_mb=256)) as sb:
        for private in (False, True):
            fds = _fds(sb, private)
            assert sorted(fds) == ["0", "1", "2"], (private, fds)
            if private:
                assert all(fds[n].startswith("socket:") for n in ("1", "2")), fds


def test_a_command_gets_only_the_allowed_env(backend: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(HOST_VAR, "leaked")
    monkeypatch.setenv("OLDPWD", "/leaked")
    with backend.create(SandboxSpec(memory_limit_mb=256, env=SPEC_ENV)) as sb:
        names = _env_names(sb)
    allowed = {"PATH", "HOME", "LANG", *SPEC_ENV, *REQUEST_ENV, *SHELL_SET}
    assert names <= allowed, names - allowed
    assert {"PATH", *SPEC_ENV, *REQUEST_ENV} <= names, names


def test_a_command_cannot_accept_the_harness_connections(backend: Any) -> None:
    """The attack: accept() on every fd a command holds while the harness connects anew; every
    connection must reach the daemon (whatever it answers without a token), none the command."""
    with backend.create(SandboxSpec(memory_limit_mb=256)) as sb:
        sb.write_file("/tmp/accept.py", ACCEPT_ALL)
        assert sb.exec("python3 /tmp/accept.py").exit_code == 0
        _wait_file(sb, "/tmp/accept.ready")
        answers = [_raw_health(str(sb.path / "run" / SOCKET_NAME)) for _ in range(20)]
        stolen = sb.exec("cat /tmp/stolen 2>/dev/null; true").stdout
    assert not any(b"STOLEN" in a for a in answers), answers
    assert stolen == "", f"{len(stolen)} connections accepted by a command"


def _wait_file(sb: Any, path: str) -> None:
    for _ in range(100):
        if sb.exec(f"test -e {path}").exit_code == 0:
            return
        time.sleep(0.05)
    raise AssertionError(f"{path} never appeared")


def _raw_health(path: str) -> bytes:
    """One new connection to the daemon's socket and what comes back on it."""
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(5)
        s.connect(path)
        s.sendall(b"GET /health HTTP/1.1\r\nHost: sandbox\r\nConnection: close\r\n\r\n")
        out = b""
        while chunk := s.recv(65536):
            out += chunk
        return out


USER_SCRIPT = """
import json, os, sys, tempfile, warnings
from pathlib import Path
sys.path.insert(0, SRC)
warnings.simplefilter("ignore")
os.environ[HOST_VAR] = "leaked"
os.environ["OLDPWD"] = "/leaked"
from burstrl.sandbox.backends import make_backend
from burstrl.sandbox.backends.base import SandboxSpec
state = Path(tempfile.mkdtemp(prefix="sbx", dir="/tmp"))
with make_backend("namespace", state_dir=state).create(SandboxSpec(memory_limit_mb=256, env=SPEC_ENV)) as sb:
    fds = [json.loads(sb.exec(LIST_FDS, private_output=p).stdout) for p in (False, True)]
    env = sb.exec("env", env=REQUEST_ENV).stdout
    uid = sb.exec("id -u").stdout.strip()
print(json.dumps({"fds": fds, "env": env, "uid": uid}))
"""


def test_the_same_as_an_ordinary_user() -> None:
    if os.geteuid() != 0:
        pytest.skip("run as an ordinary user already: the tests above are that case")
    res = run_as_user(USER_SCRIPT, HOST_VAR=HOST_VAR, LIST_FDS=LIST_FDS, SPEC_ENV=SPEC_ENV,
                      REQUEST_ENV=REQUEST_ENV)
    assert res["uid"] != "0"
    for fds in res["fds"]:
        assert sorted(fds) == ["0", "1", "2"], fds
    names = {line.split("=", 1)[0] for line in res["env"].splitlines() if "=" in line}
    allowed = {"PATH", "HOME", "LANG", *SPEC_ENV, *REQUEST_ENV, *SHELL_SET}
    assert names <= allowed, names - allowed
