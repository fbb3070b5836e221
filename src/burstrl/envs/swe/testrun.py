"""One run of a task's graded tests inside a grading sandbox: sealed where it can be (`seal.py`),
otherwise through the end-marker wrapper and the grader's own JUnit report (`integrity`).

Why a module of its own: the grader (`grade.py`) decides what a run means; this module only runs
it and brings back what it said (log, exit status, the seal's verdict or the report's path).
"""

from __future__ import annotations

import re
import secrets
import shlex
import time
import xml.etree.ElementTree as ET
from collections.abc import Sequence

from burstrl.envs.swe.integrity import WRAPPER, GradingRun, new_report_dir, runner_kind, wrapped_command
from burstrl.envs.swe.sandboxes import GradingSandbox
from burstrl.envs.swe.screen import GradeInfraError
from burstrl.envs.swe.seal import BOOTSTRAP, read_verdict, sealed_command
from burstrl.envs.swe.task import SweTask
from burstrl.envs.swe.testlog import dotted_id, parse_junit_xml
from burstrl.sandbox.client import SandboxError
from burstrl.sandbox.protocol import ExecResult

REPO_DIR = "/work/repo"
SCRATCH = "/tmp/burstrl-grade"  # outside the repo: patches and logs never enter `git status`
LOG_CAP = 64 * 1024  # chars of test log kept in a result (head and tail)
LOG_READ_CAP = 8 * 1024 * 1024  # bytes of a test log read back (head and tail); the daemon reads <= 16 MiB
TEST_ENV = {"PYTHONDONTWRITEBYTECODE": "1", "PYTHONUNBUFFERED": "1"}  # unbuffered: the log keeps the real order
_JUNIT_OPT = re.compile(r"--junit-?xml[= ](\S+)")


def grading_command(task: SweTask, options: str = "", test_cmd: str = "") -> str:
    """`test_cmd` (the task's unless given; then the grader's `options`) followed by the target and
    existing test ids."""
    ids = unique(task.FAIL_TO_PASS) + [t for t in unique(task.PASS_TO_PASS) if t not in task.FAIL_TO_PASS]
    return " ".join([test_cmd or task.test_cmd, *([options] if options else []), *(shlex.quote(t) for t in ids)])


def run_tests(sandbox: GradingSandbox, task: SweTask, timeout_s: float, changed: Sequence[str] | None = None,
              test_files: Sequence[str] = ()) -> GradingRun:
    """One run of the graded tests: {text, timed_out, exit_code, seconds, report, nonce, seal}.

    `changed`: the paths the patch still changes when the tests run; given (not None), the run is
    sealed when its command allows (`seal`: the collector's verdict, None if it printed none);
    `test_files`: the graded tests' sources, which the patch's code may not read in a sealed run.
    Otherwise, in a fresh random directory (`integrity`): for pytest the grader's own JUnit report
    (`report`, with `-rA` added), and for a plain `python -m pytest|unittest` command the wrapper that
    ends the run with a marker holding `nonce` ("" when not wrapped). The log is stdout and stderr
    interleaved, through a file (exec output is capped and would drop the middle of a long log).
    """
    log = f"{SCRATCH}/test.log"
    rdir, nonce = new_report_dir(), secrets.token_hex(16)
    check(sandbox.exec(f"mkdir -m 700 {rdir}", timeout=60), "make the report directory")
    sealed = sealed_command(task.test_cmd, rdir, log) if changed is not None else None
    if sealed is not None:
        for name, text in BOOTSTRAP.items():
            sandbox.write_file(f"{rdir}/{name}", text.encode())
        sandbox.write_file(f"{rdir}/changed", "".join(f"{p}\n" for p in changed or ()).encode())
        sandbox.write_file(f"{rdir}/tests", "".join(f"{p}\n" for p in test_files).encode())
        graded = unique(task.FAIL_TO_PASS + task.PASS_TO_PASS)
        sandbox.write_file(f"{rdir}/graded", "".join(f"{t}\n{dotted_id(t)}\n" for t in graded).encode())
        options = "-rA" if runner_kind(task.test_cmd) == "pytest" else ""
        # Private: the verdict line is read from stdout, which no other process may then write.
        res, seconds = _timed(sandbox, grading_command(task, options, sealed), timeout_s, private=True)
        return {"text": read_log(sandbox, log), "timed_out": bool(res.timed_out), "exit_code": res.exit_code,
                "seconds": seconds, "report": "", "nonce": "", "seal": read_verdict(res.stdout)}
    options, report = "", junit_path(task)
    wrapped = wrapped_command(task.test_cmd, f"{rdir}/w.py") or ""
    prep = f"rm -f {shlex.quote(report)}; " if report else ""  # a committed fake report must not count
    if runner_kind(task.test_cmd) == "pytest":
        report, options, prep = f"{rdir}/report.xml", f"-rA --junitxml={rdir}/report.xml", ""
    if wrapped:
        sandbox.write_file(f"{rdir}/w.py", WRAPPER.encode())
        sandbox.write_file(f"{rdir}/nonce", nonce.encode())
    res, seconds = _timed(sandbox, f"{prep}{{ {grading_command(task, options, wrapped)} ; }} > {log} 2>&1", timeout_s)
    return {"text": read_log(sandbox, log), "timed_out": bool(res.timed_out), "exit_code": res.exit_code,
            "seconds": seconds, "report": report, "nonce": nonce if wrapped else "", "seal": None}


def _timed(sandbox: GradingSandbox, cmd: str, timeout_s: float, private: bool = False) -> tuple[ExecResult, float]:
    start = time.monotonic()
    res = sandbox.exec(cmd, cwd=REPO_DIR, timeout=timeout_s, env=TEST_ENV, private_output=private)
    return res, round(time.monotonic() - start, 3)


def read_log(sandbox: GradingSandbox, log: str) -> str:
    """The test log; over the daemon's read limit (16 MiB) its head and tail, where the statuses are."""
    sandbox.exec(f"if [ $(stat -c %s {log} 2>/dev/null || echo 0) -gt {LOG_READ_CAP} ]; then {{ head -c "
                 f"{LOG_READ_CAP // 2} {log}; echo; echo '... [elided] ...'; tail -c {LOG_READ_CAP // 2} {log}; }} "
                 f"> {log}.cut && mv {log}.cut {log}; fi", timeout=60)
    try:
        return sandbox.read_file(log).decode("utf-8", "replace")
    except SandboxError as exc:
        if not 400 <= exc.status < 500:  # no log (the run was killed before it began): nothing said
            raise
        return ""


def junit_path(task: SweTask) -> str:
    """Where the test command writes a JUnit XML report (`--junitxml=PATH`), absolute; "" if not."""
    m = _JUNIT_OPT.search(task.test_cmd)
    if m is None:
        return ""
    return m.group(1) if m.group(1).startswith("/") else f"{REPO_DIR}/{m.group(1)}"


def read_report(sandbox: GradingSandbox, path: str) -> dict[str, str] | None:
    """Statuses from the JUnit report at `path`; None if there is none or it is torn (a crashed run)."""
    if not path:
        return None
    try:
        return parse_junit_xml(sandbox.read_file(path).decode("utf-8", "replace"))
    except (SandboxError, ET.ParseError):
        return None


def cap_log(text: str, cap: int = LOG_CAP) -> str:
    """Head and tail of a long log: the start says what ran, the end says how it ended."""
    if len(text) <= cap:
        return text
    half = cap // 2
    return f"{text[:half]}\n... [{len(text) - cap} chars elided] ...\n{text[-half:]}"


def check(res: ExecResult, what: str) -> None:
    if res.exit_code != 0:
        raise GradeInfraError(f"could not {what}: {(res.stderr or res.stdout).strip()[-2000:]}")


def unique(ids: Sequence[str]) -> list[str]:
    return list(dict.fromkeys(ids))
