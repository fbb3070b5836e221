"""Issue 37: every sandbox starts with the rlimits of one table (`limits.RLIMITS`), on every backend
and for the namespace backend also as an ordinary user, instead of the harness's own (namespace
sandboxes inherited its 20,000 open files; runc and runsc got 1,024 and nothing else).

What a command sees is read inside with `resource.getrlimit` (gVisor has no /proc/self/limits).
"""

from __future__ import annotations

import json
import resource
import shutil
from typing import Any

import pytest

from burstrl.sandbox.backends.base import SandboxSpec
from burstrl.sandbox.backends.limits import RLIMITS
from tests.security.test_namespace_root import run_as_user

NAMES = [r.name for r in RLIMITS] + ["RLIMIT_NPROC"]
READ = ("import json, resource\n"
        f"print(json.dumps({{n: resource.getrlimit(getattr(resource, n)) for n in {NAMES!r}}}))\n")
PIDS = 96


def _expected(nproc: bool, own_hard: bool = False) -> dict[str, list[int]]:
    """The table as a command must see it; `nproc`: RLIMIT_NPROC is the pids limit (no pids
    cgroup holds the sandbox's processes); `own_hard`: each hard limit at most the harness's own
    (an ordinary user cannot raise one)."""
    want = {r.name: [r.soft, r.hard] for r in RLIMITS}
    if nproc:
        want["RLIMIT_NPROC"] = [PIDS, PIDS]
    if own_hard:
        for name, (soft, hard) in want.items():
            own = resource.getrlimit(getattr(resource, name))[1]
            if own != resource.RLIM_INFINITY and own < hard:
                want[name] = [min(soft, own), own]
    return want


def test_commands_get_the_tables_rlimits(backend: Any) -> None:
    """Open files, locked memory, message queue bytes, pending signals and core size are the
    table's on each backend; processes too where no cgroup counts them (an ordinary user's
    namespace sandbox, and gVisor, whose host cgroup holds the sentry, not the commands)."""
    with backend.create(SandboxSpec(memory_limit_mb=256, pids_limit=PIDS)) as sb:
        r = sb.exec(["python3", "-c", READ], timeout=60)
        assert r.exit_code == 0, r.stderr
        got = json.loads(r.stdout)
        nofile = sb.exec("ulimit -n").stdout.strip()
        nproc = sb.limits.pids == "rlimit" or getattr(backend, "gvisor", False)
    want = _expected(nproc)
    assert {k: got[k] for k in want} == want, got
    assert nofile == str(want["RLIMIT_NOFILE"][0])
    if not nproc:  # a cgroup counts them: the uid-wide rlimit is not set to the sandbox's pids limit
        assert got["RLIMIT_NPROC"] != [PIDS, PIDS]


RUN_AS_USER = """
import json, sys, tempfile, warnings
from pathlib import Path
sys.path.insert(0, SRC)
warnings.simplefilter("ignore")
from burstrl.sandbox.backends import make_backend
from burstrl.sandbox.backends.base import SandboxSpec
state = Path(tempfile.mkdtemp(prefix="sbx", dir="/tmp"))
with make_backend("namespace", state_dir=state).create(SandboxSpec(pids_limit=PIDS, memory_limit_mb=256)) as sb:
    r = sb.exec(["python3", "-c", READ])
    print(json.dumps({"limits": json.loads(r.stdout), "pids": sb.limits.pids}))
"""


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap (bwrap) is not installed")
@pytest.mark.filterwarnings("ignore:sandbox limits not fully enforced")
def test_an_ordinary_users_sandbox_gets_them_too() -> None:
    """Run by an ordinary user (no cgroups: processes by RLIMIT_NPROC), the same table, each hard
    limit at most the user's own."""
    res = run_as_user(RUN_AS_USER, PIDS=PIDS, READ=READ)
    want = _expected(nproc=res["pids"] == "rlimit", own_hard=True)
    assert {k: res["limits"][k] for k in want} == want, res
