"""Issue 49, item 4: run by an ordinary user, a sandbox must not take the per-uid kernel counts the
harness (same user, outside any sandbox) needs, and `LimitsReport.uid` says what it shares with whom.

Before: bwrap mapped the sandbox to the harness's own uid, so a command holding 128 inotify
instances made the harness's inotify_init fail with EMFILE. Now each sandbox starts in a user
namespace of its own (`subids`): mapped to a leased subordinate uid where /etc/subuid and
/etc/subgid give the user a range (pipe pages, epoll watches and key quotas are then its own), and
with that namespace's own inotify maxima either way (inotify, like processes and pending signals,
is charged up to the namespace's owner, the harness's uid: measured, it does not become separate).
Control: ordinary commands, /work's files read back through the sandbox API, nothing left at close.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest

from burstrl.sandbox.backends import subids
from tests.security.test_namespace_root import ROOT, USER_UID, run_as_user

pytestmark = [
    pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap (bwrap) is not installed"),
    pytest.mark.filterwarnings("ignore:sandbox limits not fully enforced"),
]
NAME = f"burstrl-t{USER_UID}"
# Subordinate ids for the test user: its own block, below the root backend's ID_BLOCK (0x70000000).
SUB_FIRST, SUB_COUNT = 0x40000000 + (USER_UID - 60000) * 1024, 1024

# A command that leaves behind (in a session of its own, so it outlives the exec) a process holding
# as many inotify instances as it can get (up to 200) and ~1100 pipes (17,600 pages, past the
# per-uid fs.pipe-user-pages-soft of 16,384), and prints how many instances it got.
HOLD = r"""python3 -c '
import ctypes, os, resource, time
r, w = os.pipe()
if os.fork():
    os.close(w)
    print(os.read(r, 64).decode(), flush=True)
    os._exit(0)
os.setsid()
resource.setrlimit(resource.RLIMIT_NOFILE, (4096, 4096))
libc = ctypes.CDLL(None)
held = [fd for fd in (libc.inotify_init1(0) for _ in range(200)) if fd >= 0]
pipes = []
try:
    for _ in range(1100):
        pipes.append(os.pipe())
except OSError:
    pass
os.write(w, str(len(held)).encode())
time.sleep(60)
'"""
SCRIPT = """
import ctypes, fcntl, json, os, sys, tempfile, warnings
from pathlib import Path
sys.path.insert(0, SRC)
warnings.simplefilter("ignore")
from burstrl.sandbox.backends import make_backend
from burstrl.sandbox.backends.base import SandboxSpec
state = Path(tempfile.mkdtemp(prefix="sbx", dir="/tmp"))
libc = ctypes.CDLL(None, use_errno=True)
with make_backend("namespace", state_dir=state).create(SandboxSpec(pids_limit=64, memory_limit_mb=256)) as sb:
    held = sb.exec(HOLD, timeout=60)
    fds = [libc.inotify_init1(0) for _ in range(4)]
    errno = ctypes.get_errno()
    for fd in fds:
        if fd >= 0:
            os.close(fd)
    r, w = os.pipe()
    pipe_bytes = fcntl.fcntl(w, 1032)  # F_GETPIPE_SZ: one page once the uid is past its soft limit
    made = sb.exec("echo hi > /work/f && chmod 600 /work/f && mkdir -p /work/d/e && echo x > /work/d/e/g "
                   "&& chmod 000 /work/d && id -u")
    res = {"held": held.stdout.strip(), "held_err": held.stderr[-300:], "inotify_ok": min(fds) >= 0,
           "errno": errno, "pipe_bytes": pipe_bytes, "uid": getattr(sb.limits, "uid", ""), "made": made.exit_code,
           "inside_uid": made.stdout.strip(), "read": sb.read_file("/work/f").decode(),
           "host_owner": os.stat(sb.path / "work" / "f").st_uid, "me": os.getuid()}
res["left"] = os.listdir(state)
state.rmdir()
print(json.dumps(res))
"""


def _sh(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True, timeout=60)


@pytest.fixture
def subordinate_user() -> Iterator[None]:
    """The ordinary user `run_as_user` becomes, with a passwd entry (newuidmap needs one) and a
    range in /etc/subuid and /etc/subgid; all removed afterwards. Root only; skips where the tools
    are missing or the uid is taken. Run as an ordinary user: that user, where it has them."""
    if not ROOT:
        if subids.detect().sub is None:
            pytest.skip(f"this user has no subordinate ids that work here: {subids.detect().why}")
        yield
        return
    if not all(shutil.which(t) for t in ("useradd", "userdel", "groupadd", "usermod", "newuidmap")):
        pytest.skip("shadow's useradd/usermod or newuidmap (package uidmap) missing")
    if subprocess.run(["getent", "passwd", str(USER_UID)], capture_output=True, check=False).returncode == 0:
        pytest.skip(f"uid {USER_UID} already has a passwd entry")
    last = SUB_FIRST + SUB_COUNT - 1
    _sh("groupadd", "-g", str(USER_UID), NAME)
    try:
        _sh("useradd", "-M", "-N", "-u", str(USER_UID), "-g", str(USER_UID), "-s", "/usr/sbin/nologin", NAME)
        _sh("usermod", "--add-subuids", f"{SUB_FIRST}-{last}", "--add-subgids", f"{SUB_FIRST}-{last}", NAME)
        yield
    finally:
        subprocess.run(["userdel", NAME], capture_output=True, check=False)
        subprocess.run(["groupdel", NAME], capture_output=True, check=False)
        for path in ("/etc/subuid", "/etc/subgid"):  # userdel removes them; make sure
            subprocess.run(["sed", "-i", f"/^{NAME}:/d", path], capture_output=True, check=False)
        shutil.rmtree(f"/tmp/burstrl-subids-{USER_UID}", ignore_errors=True)  # its (released) leases


def _controls(res: dict[str, Any]) -> None:
    """What must hold either way: the harness keeps inotify instances, the sandbox got only its
    namespace's few, commands work, /work's files read back through the API, nothing is left."""
    assert res["inotify_ok"], res  # before: EMFILE (24), the sandbox held all 128
    assert res["held"].isdigit() and 0 < int(res["held"]) <= 8, res
    assert res["made"] == 0 and res["inside_uid"] == str(res["me"]), res
    assert res["read"] == "hi\n" and res["left"] == [], res


def test_a_sandbox_with_a_subordinate_uid_leaves_the_harness_its_counts(subordinate_user: None) -> None:
    res = run_as_user(SCRIPT, HOLD=HOLD)
    _controls(res)
    assert res["uid"].startswith("own subordinate uid "), res["uid"]
    sub = int(res["uid"].split()[3])
    assert SUB_FIRST <= sub < SUB_FIRST + SUB_COUNT and res["host_owner"] == sub != res["me"], res
    assert res["pipe_bytes"] == 65536, res  # pipe pages: charged to the subordinate uid


def test_without_subordinate_ids_the_report_says_what_is_shared() -> None:
    """`run_as_user`'s uid has no passwd entry, so newuidmap cannot serve it: the sandbox keeps the
    harness's uid and says so; what it shares is measured here (pipe pages), inotify still bounded."""
    if not ROOT and subids.detect().sub is not None:
        pytest.skip("this user has subordinate ids: the case above covers it")
    res = run_as_user(SCRIPT, HOLD=HOLD)
    _controls(res)
    assert res["uid"].startswith(f"shared with the harness's uid {res['me']} "), res["uid"]
    for shared in ("pipe pages", "inotify instances", "processes", "pending signals"):
        assert shared in res["uid"], (shared, res["uid"])
    assert res["pipe_bytes"] < 65536 and res["host_owner"] == res["me"], res  # shared, as the report says
