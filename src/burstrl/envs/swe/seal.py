"""The sealed test run, the grader's side: when a run can be sealed, the command that runs it, and
how its verdict is read. The bootstrap that runs in the sandbox is `sealboot.py` (read its
docstring first).

Why: the code under test runs in the test runner's process, so anything the runner writes (log,
JUnit report, exit status, an end marker) the code can write too, before or after the runner. The
seal takes results as they happen, signed by an audit hook the code cannot remove, and hands them to
a collector process whose output nothing else in the sandbox holds; the log is kept for people
only. An attempt whose code reaches for a forgery's primitives ends at once, `tampered` with the
seal's rule (`tampered: sealed run <rule>: ...`).

What the seal trusts (`sealtrust.py`): what the task's image provides, i.e. the interpreter's install
and every `sys.path` entry present at the start (a test runner in an image layer on PYTHONPATH, a
virtualenv, `/opt`), for files older than the run; the repository's files the patch did not change;
nothing the patch wrote or the run wrote (a file in a trusted place written at run time, or one of
the patch's files seen through a link, stays the patch's).

What the seal covers (each a test in tests/security/test_sealed_run.py and test_seal_classes.py):
- the runner changed: every function and class of pytest, pluggy and unittest and every method of
  their classes, and from the freeze before the first test the graded test modules' functions and
  classes, by identity at every result (before pytest loads the repository's conftests its own
  legacypath plugin and installed plugins may patch it with trusted code; after that, any change);
  every pytest hook implementation is trusted code (a plugin of the patch's registered through an
  object it found);
- forged results: a result is signed only when the runner's own protocol made it for that test (a
  live frame of pytest's `call_and_report` holding that report, of unittest's `TestCase.run` for
  that test), its sender is the seal's own reporting with nothing of the patch's on the stack, and
  the key is out of reach of any walk of Python objects (`sealhook.py`); a pass for a test whose call
  raised; unittest's `_ShouldStop` from the code under test (the runner would count a pass: now an
  error of that part);
- the tests replaced or questioned: a test whose function, class or assertion overrides are not the
  repository's (a class built or swapped by the patch, an assertion replaced on the instance); a
  test of the repository called by the patch's code or outside the runner's run of it (a fake
  `self` that records what the test expects); the graded tests' sources opened by the patch's code;
- the primitives: frames (`sys._getframe`, and through any function of `inspect` or `traceback`:
  `extract_stack`, `format_stack`, `stack`), traceback and generator frames; the heap (`gc`); trace
  and profile hooks (also through `threading`); more audit hooks; `ctypes` imported by the patch's
  code, and memory read or written through it; the process's /proc entries and the seal's own
  directory; a function's `__code__` replaced; code compiled, built or unmarshalled by the patch's
  code that claims a trusted file; bytecode written during the run; bytes written on the results
  pipe, signed messages replayed or sent from a forked process; exit handlers (they never run); a
  run that ends early (no end message: `run_incomplete`, reward 0).

What it does not cover, said plainly: it attributes a primitive to the code that called it (or,
for the heap, /proc and ctypes' helpers, to the nearest code outside the Python installation), so
an installed library that hands out frames or heap objects on the patch's behalf is a proxy it does
not see through (asyncio's `Task.get_stack`; logging's `stacklevel` hands the caller's line to a
handler); a signal handler receives the interrupted frame (no audit event); `linecache`'s cache of a
test file pytest already formatted is read without opening it; objects reachable from module
globals (pytest's config through the assertion-rewriting import hook in `sys.meta_path`) can be
changed where they are instances, not classes; ctypes a library already imported, used through
calls that raise no audit event; a file of the repository rewritten at run time by a subprocess
with its stat restored; values that lie (an object whose `__eq__` is always true): the diff policy's
static rule refuses the constructs (`diffpolicy`/`primitives`), the tests' own assertions must catch
the rest. Processes the tests start run without the hook (they cannot reach the results pipe: it is
close-on-exec and `subprocess` closes fds). A task whose patch changes the runner's own code (the
repository is pytest or pluggy), a command that is not a plain `[VAR=value ...] python[3] -m
pytest|unittest ...`, or pytest-xdist is run unsealed, with the log, report and end-marker checks of
`integrity`; the result says so (`sealed` false). A task whose command names an interpreter by path
(`/opt/venv/bin/python -m pytest`) is sealed like any other.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from burstrl.envs.swe.integrity import wrapped_command

# the bootstrap's files, as the grader writes them into the seal's directory (name -> text)
BOOTSTRAP = {name: (Path(__file__).parent / source).read_text()
             for name, source in (("seal.py", "sealboot.py"), ("sealhook.py", "sealhook.py"),
                                  ("sealtrust.py", "sealtrust.py"))}
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
