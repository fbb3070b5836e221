"""The sealed test run, the grader's side: when a run can be sealed, the command that runs it, and
how its verdict is read. The bootstrap that runs in the sandbox is `sealboot.py` (read its
docstring first).

Why: the code under test runs in the test runner's process, so anything the runner writes (log,
JUnit report, exit status, an end marker) the code can write too, before or after the runner. The
seal takes results as they happen, signed by an audit hook the code cannot remove, and hands them to
a collector process whose output nothing else in the sandbox holds; the log is kept for people
only. An attempt whose code reaches for a forgery's primitives ends at once, `tampered` with the
seal's rule (`tampered: sealed run <rule>: ...`).

What the seal covers (each a test in tests/security/test_sealed_run.py): results forged by rewriting
pytest's report construction or any other function or class of pytest, pluggy or unittest (checked
by identity at every result: replaced only by functions of trusted code, as pytest's own legacypath
plugin does); a pass for a test whose call raised; plugins registered through objects found on the
heap (`gc`) or in other frames (`sys._getframe`, `inspect`, traceback and generator frames); trace
and profile hooks (also through `threading`); more audit hooks; `ctypes` imported by the patch's
code, and memory read or written through it; the process's /proc entries (cmdline, environ, mem,
fd, maps...) and the seal's own directory; a function's `__code__` replaced; code compiled, built or
unmarshalled by the patch's code that claims a trusted file; bytes written on the results pipe
(brute-forcing fds), signed messages replayed or sent from a forked process; exit handlers (they
never run: the test process ends with `os._exit` once its end message is out); a run that ends
early (no end message: `run_incomplete`, reward 0).

What it does not cover, said plainly: it attributes a primitive to the code that called it (or,
for the heap, /proc and ctypes' helpers, to the nearest code outside the Python installation), so
an installed library that hands out frames or heap objects on the patch's behalf is a proxy it does
not see through; ctypes a library already imported, used through calls that raise no audit event
(`cast` to `py_object`); a file of the repository rewritten at run time by a subprocess with its
stat restored; values that lie (an object whose `__eq__` is always true): the tests' own assertions
must catch those. Processes the tests start run without the hook (they cannot reach the results
pipe: it is close-on-exec and `subprocess` closes fds). A task whose patch changes the runner's
own code (the repository is pytest or pluggy), a command that is not a plain
`[VAR=value ...] python[3] -m pytest|unittest ...`, or pytest-xdist is run unsealed, with the log,
report and end-marker checks of `integrity`; the result says so (`sealed` false).
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from burstrl.envs.swe.integrity import wrapped_command

BOOTSTRAP = (Path(__file__).parent / "sealboot.py").read_text()
TAG = "burstrl-seal "
RUNNER_PACKAGES = frozenset({"_pytest", "pluggy"})
_XDIST = ("-n", "--numprocesses", "--dist", "-d", "--tx", "--looponfail", "-f")


def sealed_command(test_cmd: str, rdir: str, log: str) -> str | None:
    """The test command run through the seal's bootstrap (`rdir/seal.py`), or None when it is not
    of the plain `[VAR=value ...] python[3] -m pytest|unittest ARGS` form or runs pytest-xdist."""
    wrapped = wrapped_command(test_cmd, "@SEAL@")
    if wrapped is None:
        return None
    words = shlex.split(wrapped)
    at = words.index("@SEAL@")
    if any(w in _XDIST or w.startswith(("--numprocesses=", "--dist=", "-n=")) or (w.startswith("-n") and w[2:].isdigit())
           for w in words[at + 1:]):
        return None
    return shlex.join([*words[:at], f"{rdir}/seal.py", rdir, log, *words[at + 1:]])


def seal_off(test_cmd: str, changed: Sequence[str], base_files: frozenset[str]) -> str:
    """Why this run cannot be sealed, "" when it can."""
    if sealed_command(test_cmd, "/x", "/x") is None:
        return "the test command is not a plain `python -m pytest|unittest` (or runs pytest-xdist)"
    for path in changed:
        if path in base_files and RUNNER_PACKAGES & set(path.split("/")[:-1]):
            return f"the patch changes the test runner's own code ({path})"
    return ""


def read_verdict(stdout: str) -> dict[str, Any] | None:
    """The collector's verdict from its stdout, None if there is none (the run was killed).

    The collector prints exactly one verdict line, and the run's stdout is private (a socket no
    other process can reopen: `runtime`, "Private output"); a second line means something else
    wrote there, so the first is taken and the run is tampered (`forged_verdict`) whatever it says."""
    lines = [line for line in stdout.splitlines() if line.startswith(TAG)]
    if not lines:
        return None
    try:
        verdict = json.loads(lines[0][len(TAG):])
    except ValueError:
        return None
    if not isinstance(verdict, dict):
        return None
    if len(lines) > 1:
        why = f"forged_verdict: {len(lines)} verdict lines on the collector's stdout, where it prints one"
        verdict["tampered"] = [why, *list(verdict.get("tampered") or [])]
    return verdict


def judge(verdict: dict[str, Any] | None, graded: Sequence[str]) -> tuple[dict[str, str], str, bool]:
    """(statuses of the graded tests, "" or why the run is tampered, whether it finished), as
    `integrity.verdict` returns them for an unsealed run. Ids are matched as the log's are."""
    from burstrl.envs.swe.testlog import status_of

    if verdict is None:
        return {t: "missing" for t in graded}, "", False
    reported = {str(k): str(v) for k, v in dict(verdict.get("statuses") or {}).items()}
    statuses = {t: status_of(reported, t) for t in graded}
    tampered = [str(t) for t in verdict.get("tampered") or []]
    why = ""
    if tampered:
        rule, _, detail = tampered[0].partition(": ")
        why = f"sealed run {rule}: {detail}" + (f" (+{len(tampered) - 1} more)" if len(tampered) > 1 else "")
    return statuses, why, bool(verdict.get("complete"))
