"""Attacks from inside that must fail the same way on every backend (issue 15, items 3, 6, 9).

Each test runs a model-written command in a real sandbox and checks that the daemon, the harness's
only channel, is still there and still the real one afterwards: `kill -9 -1` cannot reach it (it is
pid 1 of the sandbox), filling /tmp ends in ENOSPC (a sized tmpfs) instead of the memory cgroup's
OOM killer picking the daemon, and a socket swapped in from inside is refused by the client.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from burstrl.sandbox.backends import make_backend
from burstrl.sandbox.backends.base import SandboxSpec
from burstrl.sandbox.client import SandboxError

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap (bwrap) is not installed")


@pytest.fixture(scope="module", params=["namespace", "oci"])
def backend(request: pytest.FixtureRequest) -> Iterator[object]:
    """Each backend with a short state dir under /tmp; oci skips with runc's own error where it cannot run."""
    state = Path(tempfile.mkdtemp(prefix="sbx", dir="/tmp"))
    if request.param == "oci":
        from burstrl.sandbox.backends.oci import runtime_works

        ok, reason = runtime_works("runc", state)
        if not ok:
            shutil.rmtree(state, ignore_errors=True)
            pytest.skip(reason)
        yield make_backend("oci", state_dir=state, runtime="runc")
    else:
        yield make_backend("namespace", state_dir=state)
    shutil.rmtree(state, ignore_errors=True)


@pytest.fixture
def sandbox(backend) -> Iterator[object]:
    sb = backend.create(SandboxSpec(memory_limit_mb=256, env={"TASK_SECRET_FREE": "visible"}))
    yield sb
    sb.close()


def test_kill_everything_leaves_the_daemon_serving(sandbox, backend) -> None:
    if backend.__class__.__name__ == "OciBackend":
        pytest.xfail("oci: tini is pid 1 and the daemon its child with the commands' uid, so kill -9 -1 "
                     "reaches it; needs the daemon as pid 1 (it reaps) with tini's parent-death signal")
    sandbox.exec("kill -9 -1; sleep 0.2", timeout=20)
    assert sandbox.client.health().status == "ok"
    assert sandbox.exec("echo alive").stdout == "alive\n"


def test_filling_tmp_is_enospc_not_an_oom_of_the_daemon(sandbox) -> None:
    r = sandbox.exec("head -c 400M /dev/zero > /tmp/fill; echo rc=$?; df -k /tmp | tail -1", timeout=60)
    assert "rc=1" in r.stdout and "No space left" in r.stderr, (r.stdout, r.stderr)
    assert sandbox.client.health().status == "ok"
    assert sandbox.exec("rm -f /tmp/fill && echo ok").stdout == "ok\n"


def test_spec_env_reaches_commands(sandbox) -> None:
    assert sandbox.exec("echo $TASK_SECRET_FREE").stdout == "visible\n"
    assert "SANDBOX_TOKEN" not in sandbox.exec("env").stdout


def test_a_socket_swapped_from_inside_is_refused(sandbox) -> None:
    """Commands cannot replace the daemon's socket with their own server: the client checks the
    listener's pid (SO_PEERCRED) against the daemon's, recorded when the sandbox started."""
    script = ("import os, socket, time\n"
              "p = '/run/sandbox/sandboxd.sock'\n"
              "try:\n    os.unlink(p)\nexcept OSError as e:\n    print('unlink', e.errno)\n"
              "s = socket.socket(socket.AF_UNIX)\n"
              "try:\n    s.bind(p); s.listen(8); print('bound', flush=True); time.sleep(30)\n"
              "except OSError as e:\n    print('bind', e.errno)\n")
    sandbox.client.write_file("/work/impostor.py", script)
    sandbox.exec("python3 /work/impostor.py > /work/impostor.log 2>&1 &", timeout=10)
    try:
        sandbox.exec("sleep 1", timeout=10)
        answered = True
    except SandboxError as exc:
        answered = False
        assert exc.status in (502, 503), exc  # refused as untrusted, or the real one is gone: never believed
    if answered:  # the real daemon still answers: the swap did not happen (socket dir not writable)
        assert sandbox.client.health().status == "ok"
