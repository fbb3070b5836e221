"""The sealed run's verdict cannot be written by anything else in the sandbox (issue 37 review).

Found in this session: the collector prints its verdict on the exec's stdout, a pipe. A process the
code under test starts (no audit hook there) could reopen that pipe through /proc/<pid>/fd/1 of
any same-uid process holding it (the `sh -c` wrapper; under gVisor the daemon itself, whose
non-dumpable flag the sentry ignores) and write a verdict of its own after the real one: the
grader reads the last verdict line, so the forged one won, on runc and runsc (namespace held only
because its wrapper exec'd the collector). Now the grader's sealed run takes its output through
sockets (`ExecRequest.private_output`), which /proc cannot reopen, and a second verdict line is
itself a tamper verdict. Through the real grader in real sandboxes, on every backend.

Under gVisor a command can also open the daemon's own fds through /proc/1/fd (the sentry ignores
the non-dumpable flag). The daemon used to start commands with `subprocess`, whose exec-error pipe
was among them: a write there failed the exec being started (500 SubprocessError). It now spawns
with posix_spawn, which has no such pipe (issue 37): every exec here must run.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from burstrl.envs.swe.diffpolicy import DiffPolicy
from burstrl.envs.swe.grade import grade, reward_of
from burstrl.envs.swe.seal import TAG, judge, read_verdict
from burstrl.envs.swe.task import SweTask
from burstrl.sandbox.backends.base import SandboxSpec
from burstrl.sandbox.pool import SandboxPool
from tests.security import test_reward_hacks as reward_hacks
from tests.security.test_reward_hacks import CALC, patch_of

py = reward_hacks.py  # the pytest fixture repository (its runner vendored into the repo)

# Started by calc.py at import, in a session of its own: for ~20 s it writes a verdict with every
# graded test passed into every pipe it can open through /proc (fds 1 and 2 of every process, and
# every fd of pid 1), so its line comes after the collector's.
FORGER = r"""
import json, os, time
line = (TAG + json.dumps({"complete": True, "exit": 0, "tampered": [],
                          "statuses": {t: "passed" for t in IDS}}) + "\n").encode()
held, end = {}, time.monotonic() + 20
while time.monotonic() < end:
    for pid in (p for p in os.listdir("/proc") if p.isdigit() and int(p) != os.getpid()):
        try:
            fds = os.listdir(f"/proc/{pid}/fd") if pid == "1" else ["1", "2"]
        except OSError:
            fds = ["1", "2"]
        for fd in fds:
            path = f"/proc/{pid}/fd/{fd}"
            try:
                if (pid, fd) not in held and os.readlink(path).startswith("pipe:"):
                    held[(pid, fd)] = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
            except OSError:
                pass
    for f in held.values():
        try:
            os.write(f, line)
        except OSError:
            pass
    time.sleep(0.05)
"""


def _forging_patch(task: SweTask) -> str:
    code = (f"\nimport subprocess as _sp, sys as _sys\n"
            f"_sp.Popen([_sys.executable, '-c', {('TAG, IDS = ' + repr((TAG, task.FAIL_TO_PASS + task.PASS_TO_PASS)) + chr(10) + FORGER)!r}],"
            f" stdin=_sp.DEVNULL, stdout=_sp.DEVNULL, stderr=_sp.DEVNULL, start_new_session=True)\n")
    return patch_of(Path(task.repo), {"calc.py": CALC + code})


def test_a_process_in_the_sandbox_cannot_write_the_verdict(backend: Any, py: SweTask) -> None:
    with SandboxPool(backend, max_concurrent=2) as pool:  # the diff policy lifted: the sealed output alone is tested
        r = grade(py, _forging_patch(py), pool, timeout_s=90, policy=DiffPolicy(allow=("*:*",)))
    seen = {k: v for k, v in vars(r).items() if k != "log"}
    assert not r.infra_error and not r.resolved, seen
    assert [reward_of(r, k) for k in ("binary", "f2p", "strict")] == [0.0, 0.0, 0.0]
    assert not r.model_error and r.sealed and r.statuses[py.FAIL_TO_PASS[0]] == "failed", seen


def test_a_private_exec_keeps_its_output_and_a_plain_one_its_dev_stdout(backend: Any) -> None:
    """The channel itself, at the daemon: a forger holding every pipe it can open writes nothing
    into a private exec's output; a plain exec still has pipes, so `echo > /dev/stdout` works."""
    with backend.create(SandboxSpec(memory_limit_mb=256)) as sb:
        sb.client.write_file("/tmp/forger.py", f"TAG, IDS = 'FORGED ', []\n{FORGER}")
        sb.exec("(setsid python3 /tmp/forger.py </dev/null >/dev/null 2>&1 &); sleep 0.5", timeout=60)
        private = sb.client.exec("sleep 2; echo mine; echo err >&2", timeout=60, private_output=True)
        plain = sb.exec("echo to-dev-stdout > /dev/stdout; echo to-dev-stderr > /dev/stderr", timeout=60)
        starts = [sb.exec(["true"], timeout=60).exit_code for _ in range(20)]  # none broken by the forger
    assert (private.stdout, private.stderr, private.exit_code) == ("mine\n", "err\n", 0), private
    # A plain exec's pipes are open to the forger (under gVisor even through the daemon's own fds,
    # the daemon's own fds), so its lines may be mixed in: what must hold is that /dev/stdout works.
    assert "to-dev-stdout\n" in plain.stdout.splitlines(keepends=True) and plain.exit_code == 0, plain
    assert starts == [0] * 20


def test_a_second_verdict_line_is_a_forgery() -> None:
    verdict = {"complete": True, "exit": 1, "tampered": [], "statuses": {"t": "failed"}}
    one = TAG + json.dumps(verdict) + "\n"
    assert read_verdict(one) == verdict
    forged = read_verdict(one + TAG + json.dumps(dict(verdict, statuses={"t": "passed"})) + "\n")
    statuses, why, complete = judge(forged, ["t"])
    assert why.startswith("sealed run forged_verdict: ") and statuses == {"t": "failed"}, (statuses, why)

