"""Reward integrity: what the grader trusts, what it resets, and what it calls tampering.

RL optimises whatever the grader rewards, so the grader is attacked by the very thing it grades.
The attacker is the model's patch: any file it commits, run inside the grading sandbox by the
task's test command, in the same process as the test runner (the tests import the code).

Before any of the channels below, the diff policy (`diffpolicy.py`) refuses as `tampered` what
may not enter the test run at all (binaries, bytecode, packaging metadata, runner-only
configuration, new config files, symlinks, shadowing modules, new files outside the source tree).

Threat model and the rule for each channel:

1. **The log** (stdout and stderr of the test command). The code under test writes into it
   freely: a few lines in a package's `__init__.py` with `atexit` printing `PASSED <id>` for every
   id on `sys.argv` used to score resolved=1. Now (a) when one test is reported twice the worst
   status wins (`testlog`), so a printed PASSED never overrides the runner's own FAILED; (b) for
   a runner we know (pytest, unittest) a status line for a graded test after the runner's final
   summary (pytest's `== ... in 0.12s ==`, unittest's `Ran N tests`) is `tampered`: nothing
   legitimate prints a test status after the run is over; (c) without that final summary the run
   did not finish, and nothing it printed is credited (`run_incomplete`).
2. **The report**. For pytest the grader adds `-rA --junitxml=/tmp/burstrl-<nonce>/report.xml`:
   a directory with a fresh 128-bit random name made in the grading sandbox right before the run,
   so no committed file, no guess and no background process left from the agent's own sandbox
   (the grading sandbox is a new one) can be that report. The report and the log must agree on
   every graded test: present in both with the same status. A disagreement where either side
   says "passed" is `tampered`; a missing or unreadable report denies every pass
   (`run_incomplete`: the runner did not finish).
3. **The harness**. Files that configure the run are the task's, not the model's: a committed
   `conftest.py` (any depth), `pytest.ini`, `tox.ini`, `setup.cfg`, `pyproject.toml`,
   `sitecustomize.py`, `usercustomize.py`, `*.pth`, the `__init__.py` of a graded test's
   directory, every file under a graded test's test directory (the nearest ancestor named
   `tests`, `test` or `testing`: helpers and data the tests import; SWE-bench keeps test changes
   out of gold patches, so a fix never needs them), and a new module at the repository root or
   beside a graded test that shadows the runner or the standard library (`unittest/`,
   `pytest.py`, `traceback.py`: `python -m` puts the working directory first on `sys.path`). Each such path the patch touches is reset to the base
   (removed if new) before the tests run and listed in `reset_files`. Not a tamper verdict: a real
   fix may touch `setup.cfg`; the list is reported so a user sees a policy reaching for them.
4. **The end marker**. When the test command is `[VAR=value ...] python3 -m pytest|unittest ...`
   the grader runs the same runner through a wrapper it writes into the random directory
   (`WRAPPER`): the wrapper reads a second 128-bit nonce from a file and deletes the file and
   itself before it imports the runner, and after the runner RETURNS it writes
   `burstrl-end <nonce> exit=<code>` straight to fd 2. A patch that prints a complete fake run
   (statuses and summary) and then `os._exit(0)`s before the real tests ran leaves the summary
   without the marker: `tampered`. The nonce lives only in a local variable of the wrapper's
   frame while the code under test runs (no file, no argv, no environment).
5. **The ids**. The graded ids are the task's (`FAIL_TO_PASS`, `PASS_TO_PASS`), fixed before the
   patch is applied; a result for any other id is ignored, a graded id the run never reports
   counts as failed.

What this does NOT stop, said plainly: code running inside the test process can do anything the
runner can. It can read `sys.argv` (or /proc/self/cmdline) and find the report path, monkeypatch
pytest's or unittest's result objects so the runner itself prints and writes "passed" (log,
report and marker then all agree), or dig the end-marker nonce out of the wrapper's frame
(`sys._getframe`, `gc`) and print a complete fake run with it. No nonce hides a path from the
process that must write to it, nor a value from code in the same interpreter. A command the
wrapper does not reproduce (`cd sub && pytest`, `tox`, a custom runner) gets no end marker, and a
runner other than pytest gets no report cross-check. Those attacks need deliberate code aimed at
the harness's internals, so the static scan (AST of the changed files) refuses in every mode what
no bug fix adds (`primitives.py`: frames, `gc`, `ctypes`, closure cells, `__subclasses__`, writes
into `sys.modules` or the runner, values that equal everything, imports of the tests), and records
the rest of a forgery's primitives (`scan.py`: `atexit`, `os._exit`, `/proc/self`, writes into
`builtins`, `marshal`, pytest imports), which under `orchestrator.swe.suspicious = "zero"`
(training's default) score 0 too. The
sealed run (`seal.py`) closes these channels for the commands it can run (a plain
`python -m pytest|unittest`, the runner not the code under test): results signed by an audit hook
and collected out of the code's reach, the primitives above refused; the channels here then serve
only the runs it cannot seal.
"""

from __future__ import annotations

import os
import re
import secrets
import shlex
import sys
from collections.abc import Iterable, Sequence
from typing import Any, TypedDict

from burstrl.envs.swe.testlog import SEVERITY, coarse, parse_test_log, status_of

CONFIG_NAMES = frozenset({"conftest.py", "pytest.ini", ".pytest.ini", "tox.ini", "setup.cfg", "pyproject.toml",
                          "sitecustomize.py", "usercustomize.py"})
TEST_DIR_NAMES = frozenset({"tests", "test", "testing"})
RUNNER_MODULES = frozenset({"unittest", "pytest", "_pytest", "pluggy", "iniconfig", "py", "xdist", "nose",
                            "nose2", "coverage", "site", "sitecustomize", "usercustomize"})
# pytest's last line: "==== 1 failed, 2 passed in 0.12s ====", bare with -q ("2 passed in 0.02s"),
# also "no tests ran in 0.01s" and a "(0:01:02)" duration.
_PYTEST_FINAL = re.compile(r"^=*\s*(?:no tests ran|\d+ (?:passed|failed|errors?|skipped|deselected|xfailed|xpassed|"
                           r"warnings?|rerun)\b.*?) in [\d.]+s\b.*?=*$")
_UNITTEST_FINAL = re.compile(r"^Ran \d+ tests? in [\d.]+s$")

def runner_kind(test_cmd: str) -> str:
    """"pytest", "unittest" or "" (a runner whose output format the grader does not know)."""
    words = shlex.split(test_cmd)
    if any(w in ("pytest", "py.test") or w.endswith("/pytest") for w in words):
        return "pytest"
    if "unittest" in words:
        return "unittest"
    return ""


def new_report_dir() -> str:
    """A fresh, unguessable directory for this run's report (128 random bits)."""
    return f"/tmp/burstrl-{secrets.token_hex(16)}"


WRAPPER = '''"""burstrl's grading wrapper: run the test runner as `python -m` would, then an end marker."""
import os
import sys


def _run():
    here = os.path.dirname(os.path.abspath(__file__))
    with open(os.path.join(here, "nonce")) as f:
        nonce = f.read().strip()
    os.unlink(os.path.join(here, "nonce"))
    os.unlink(os.path.abspath(__file__))
    runner = sys.argv[1]
    sys.argv = ["python -m " + runner, *sys.argv[2:]]
    sys.path[0] = os.getcwd()  # as `python -m` has it: the working directory first, not this directory
    if runner == "pytest":
        import pytest
        code = int(pytest.main(sys.argv[1:]))
    else:
        import unittest
        program = unittest.main(module=None, argv=sys.argv, exit=False)
        code = 0 if program.result.wasSuccessful() else 1
    return nonce, code


_nonce, _code = _run()  # an exception or an exit inside the runner never reaches the marker
sys.stdout.flush()
sys.stderr.flush()
os.write(2, ("\\nburstrl-end %s exit=%d\\n" % (_nonce, _code)).encode())
sys.exit(_code)
'''
_ASSIGN = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


def wrapped_command(test_cmd: str, wrapper: str) -> str | None:
    """`test_cmd` run through the grader's wrapper script, or None when it is not of the plain
    form `[VAR=value ...] python[3] -m pytest|unittest ARGS` the wrapper reproduces exactly."""
    try:
        words = shlex.split(test_cmd)
    except ValueError:
        return None
    i = 0
    while i < len(words) and _ASSIGN.match(words[i]):
        i += 1
    if len(words) < i + 3 or not re.fullmatch(r"python3?(\.\d+)?", os.path.basename(words[i])) \
            or words[i + 1] != "-m" or words[i + 2] not in ("pytest", "unittest"):
        return None
    return shlex.join([*words[:i + 1], wrapper, words[i + 2], *words[i + 3:]])


def end_marker(text: str, nonce: str) -> int | None:
    """The runner's exit code from the wrapper's end marker, None if the marker is not in `text`."""
    m = re.search(rf"^burstrl-end {re.escape(nonce)} exit=(-?\d+)$", text, re.M)
    return int(m.group(1)) if m else None


def harness_files(paths: Iterable[str], test_files: Sequence[str], new_paths: Iterable[str]) -> list[str]:
    """The paths among `paths` (those a patch touches) that configure or shadow the test harness.

    `test_files` are the graded test files (their directories' `__init__.py` and modules beside
    them are harness); `new_paths` are the touched paths the base lacks (only new files can
    shadow a module: the base's own top-level modules are the task's)."""
    test_dirs = {p.rsplit("/", 1)[0] if "/" in p else "" for p in test_files}
    test_roots = {root for p in test_files if (root := nearest_test_dir(p))}
    new = set(new_paths)
    out: list[str] = []
    for path in paths:
        parent, _, name = path.rpartition("/")
        top = _module_name(path.split("/", 1)[0])  # the module a root-level file or package would be
        hit = (name in CONFIG_NAMES or name.endswith(".pth")
               or any(path.startswith(root + "/") for root in test_roots)
               or (name == "__init__.py" and parent in test_dirs and parent != "")
               or top in RUNNER_MODULES
               or (parent in test_dirs and _module_name(name) in RUNNER_MODULES))
        if not hit and path in new:
            hit = top in _stdlib() or (parent in test_dirs and _module_name(name) in _stdlib())
        if hit and path not in out:
            out.append(path)
    return out


def nearest_test_dir(test_file: str) -> str:
    """The nearest ancestor directory of `test_file` named like a test directory, "" if none."""
    parts = test_file.split("/")[:-1]
    for i in range(len(parts), 0, -1):
        if parts[i - 1] in TEST_DIR_NAMES:
            return "/".join(parts[:i])
    return ""


def _module_name(name: str) -> str:
    return name[:-3] if name.endswith(".py") else name


def _stdlib() -> frozenset[str]:
    return frozenset(getattr(sys, "stdlib_module_names", ())) | RUNNER_MODULES


def final_summary_line(lines: Sequence[str], kind: str) -> int | None:
    """Index of the runner's final summary line (the last one), None if the run never printed it."""
    pattern = _PYTEST_FINAL if kind == "pytest" else _UNITTEST_FINAL if kind == "unittest" else None
    if pattern is None:
        return None
    for i in range(len(lines) - 1, -1, -1):
        if pattern.match(lines[i].strip()):
            return i
    return None


def check_log(text: str, kind: str, graded: Sequence[str]) -> tuple[str, bool]:
    """("" or why the log is tampered, whether the runner printed its final summary).

    A status line for a graded test after the final summary is tampering; unittest's summary is
    followed by one verdict line ("OK" / "FAILED (failures=1)"), which is not a status line.
    """
    if not kind:
        return "", True
    lines = text.splitlines()
    at = final_summary_line(lines, kind)
    if at is None:
        return "", False
    late = parse_test_log("\n".join(lines[at + 1:]))
    claimed = [t for t in graded if status_of(late, t) != "missing"]
    if claimed:
        return f"test statuses printed after the runner's final summary: {', '.join(claimed[:5])}", True
    return "", True


def cross_check(log: dict[str, str], report: dict[str, str] | None, graded: Sequence[str],
                strict: bool) -> tuple[dict[str, str], str]:
    """Per-test statuses from the log and the report, and "" or why they are tampered.

    `strict` (pytest with the grader's own report and `-rA`): every graded test must be in both
    with one status. Otherwise (a task's own report, or none) a test both mention must agree;
    where only one mentions it, that one counts. Either way the worse status is the result.
    """
    out: dict[str, str] = {}
    bad: list[str] = []
    for tid in graded:
        a = status_of(log, tid)
        b = status_of(report, tid) if report is not None else "missing"
        ca, cb = coarse(a), coarse(b)  # the report cannot say XPASS; xfail outcomes agree as passes here
        if ca != cb and "passed" in (ca, cb) and (strict or "missing" not in (a, b)):
            bad.append(f"{tid} (log {a}, report {b})")
        present = [s for s in (a, b) if s != "missing"]
        out[tid] = max(present, key=lambda s: SEVERITY[s]) if present else "missing"
    if bad:
        return out, f"the log and the report disagree: {'; '.join(bad[:5])}"
    return out, ""


class GradingRun(TypedDict):
    """One run of the graded tests, as `grade.run_tests` returns it and `verdict` judges it."""

    text: str  # the log: stdout and stderr interleaved (head and tail if it was long)
    timed_out: bool
    exit_code: int
    seconds: float
    report: str  # where the JUnit report was written ("" if none)
    nonce: str  # the secret of the wrapper's end marker ("" when the command was not wrapped)
    seal: dict[str, Any] | None  # the sealed run's verdict (seal.py); None when unsealed or it printed none


def verdict(test_cmd: str, run: GradingRun, report: dict[str, str] | None,
            graded: Sequence[str]) -> tuple[dict[str, str], str, bool]:
    """(statuses of the graded tests, "" or why the run is tampered, whether the run finished).

    Finished: the runner's final summary is in the log, and its report (pytest) and the wrapper's
    end marker (`run["nonce"]`) are there. A summary without the marker while a graded test
    "passed" is tampering: the process ended before the runner returned."""
    kind = runner_kind(test_cmd)
    strict = kind == "pytest" and report is not None  # the grader's own report, and -rA in the log
    statuses, tampered = cross_check(parse_test_log(run["text"]), report, graded, strict)
    summary = finished = True
    if not tampered:
        tampered, summary = check_log(run["text"], kind, graded)
        finished = summary and (kind != "pytest" or report is not None)
    if run.get("nonce") and end_marker(run["text"], run["nonce"]) is None:
        finished = False
        if summary and not tampered and not run["timed_out"] and "passed" in map(coarse, statuses.values()):
            tampered = ("the runner's final summary is in the log but the grader's end marker is not: "
                        "the process ended before the runner returned")
    return statuses, tampered, finished


def runner_error(text: str, exit_code: int, statuses: dict[str, str], graded: Sequence[str]) -> str:
    """The runner's own error when it did not run a single graded test ("" if it ran some).

    Why: a missing runner (`No module named pytest`) or a stale id (`not found`) makes every
    attempt fail; that is a fact about the task, and must not read as a model that fixed nothing.
    The grader re-runs the tests without the patch to tell the two apart.
    """
    if exit_code == 0 or any(statuses.get(t, "missing") != "missing" for t in graded):
        return ""
    tail = [line for line in text.strip().splitlines() if line.strip()][-12:]
    return f"exit {exit_code}: " + " | ".join(tail)[-1500:] if tail else f"exit {exit_code}, no output"
