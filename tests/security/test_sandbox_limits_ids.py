"""Issue 37, finding 3: the kernel counts inotify instances (and watches, pending signals, message
queue bytes, processes...) per host uid across user namespaces, so while every sandbox ran as
nobody one sandbox holding 128 inotify instances made `inotify_init` fail in every other one.
Run as root, the namespace and runc backends now give each sandbox a host uid of its own (leased
from a block: `ids.IdLease`); gVisor counts in its own kernel, one per sandbox.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

from burstrl.sandbox.backends.base import SandboxSpec
from burstrl.sandbox.backends.ids import LEASE_DIR
from tests.waiting import wait_for

ROOT = os.geteuid() == 0

# Takes every inotify instance it can (its open-file limit raised to the hard one first, so the
# per-uid count, not the fd table, is what stops it), says how many, and holds them until released.
HOLD = r"""
import ctypes, os, resource, time
resource.setrlimit(resource.RLIMIT_NOFILE, (resource.getrlimit(resource.RLIMIT_NOFILE)[1],) * 2)
libc = ctypes.CDLL(None, use_errno=True)
held = []
while len(held) < 4000 and (fd := libc.inotify_init()) >= 0:
    held.append(fd)
with open("/tmp/held.part", "w") as f:
    f.write(f"{len(held)} {ctypes.get_errno()}")
os.rename("/tmp/held.part", "/tmp/held")
end = time.monotonic() + 300
while not os.path.exists("/tmp/release") and time.monotonic() < end:
    time.sleep(0.05)
"""
INIT = "import ctypes; print(ctypes.CDLL(None, use_errno=True).inotify_init() >= 0)"


def _held(sb: Any) -> str | None:
    r = sb.exec("cat /tmp/held 2>/dev/null")
    return r.stdout or None


def test_inotify_instances_held_in_one_sandbox_leave_another_its_own(backend: Any) -> None:
    if not ROOT:
        pytest.skip("a uid per sandbox needs root: run by an ordinary user every sandbox is that user")
    spec = SandboxSpec(memory_limit_mb=256)
    with backend.create(spec) as hog, backend.create(spec) as other:
        hog.client.write_file("/tmp/hold.py", HOLD)
        # The command waits for the hog: the daemon kills its process group when it ends, and the
        # hog's subshell is in that group until setsid.
        hog.exec("(setsid python3 /tmp/hold.py >/dev/null 2>&1 &); until [ -e /tmp/held ]; do sleep 0.05; done",
                 timeout=120)
        held = int(wait_for(lambda: _held(hog), 60, "the hog's inotify instances").split()[0])
        got = other.exec(["python3", "-c", INIT], timeout=60).stdout.strip()
        hog.client.write_file("/tmp/release", "")
    assert held >= 1 and got == "True", (held, got)


@pytest.mark.parametrize("name", ["namespace", "oci-runc"])
def test_each_sandbox_runs_as_a_host_uid_of_its_own(name: str) -> None:
    """Three sandboxes at once run as three host uids, none of them root or the harness's, each
    let go when its sandbox closes. Inside, a namespace sandbox reads as nobody (its user
    namespace maps the uid); runc has no user namespace, so its commands read the leased number."""
    if not ROOT:
        pytest.skip("a uid per sandbox needs root")
    from tests.security.conftest import open_backend

    backend, _ = open_backend(name)
    sandboxes = [backend.create(SandboxSpec(memory_limit_mb=128)) for _ in range(3)]
    try:
        uids = {_daemon_uid(sb) for sb in sandboxes}
        inside = {sb.exec("id -u").stdout.strip() for sb in sandboxes}
    finally:
        for sb in sandboxes:
            sb.close()
    assert len(uids) == 3 and 0 not in uids and os.getuid() not in uids, uids
    assert inside == ({"65534"} if name == "namespace" else {str(u) for u in uids}), (inside, uids)
    assert not any((LEASE_DIR / str(u)).exists() for u in uids), "a closed sandbox kept its uid leased"


def _daemon_uid(sb: Any) -> int:
    """The host uid the sandbox's commands run as: the host owner of a file one of them made in
    /work (the host dir `<sandbox>/work`, bound there on every backend)."""
    assert sb.exec("touch /work/.owner").exit_code == 0
    return (sb.path / "work" / ".owner").stat().st_uid
