"""`burstrl tasks check` for functions tasks: the stub fails every case, the gold body passes every
case, each of `extra.variants` (other correct bodies) passes too, and, with `--hacks`, no body of
the hack battery (`hacks.py`) earns reward.

Why its own check: functions tasks are graded by `grade.py` (the candidate apart from the expected
values), not by the SWE grader, so the check is that grader run on the task's own bodies. On the
host (`--host`) the runner runs as a plain subprocess: only the task's own code runs there.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from burstrl.envs.functions.cases import Case, task_cases
from burstrl.envs.functions.grade import GRADE_TIMEOUT_S, FunctionResult, grade, job_files, score, stub_source
from burstrl.envs.functions.tasks import apply_patch
from burstrl.envs.swe.checkresult import MAX_PROBLEMS, CheckResult
from burstrl.envs.swe.task import SweTask, TaskError

Grader = Callable[[SweTask, str], FunctionResult]


def check_function_task(task: SweTask, sandbox: bool = True, timeout: float = GRADE_TIMEOUT_S,
                        backend: Any = "namespace", hacks: bool = False) -> CheckResult:
    """Check one functions task (see the module docstring); problems are listed, never raised.
    `timeout`: at most training's default attempt limit (`tasks check` passes the SWE test command's
    300 s, which would give each case of an endless hack 25 s)."""
    start = time.monotonic()
    timeout = min(timeout, GRADE_TIMEOUT_S)
    result = CheckResult(task.instance_id, ok=False)
    run: Grader = (lambda t, s: grade(t, s, backend, timeout_s=timeout)) if sandbox else \
        (lambda t, s: run_on_host(t, s, timeout))
    try:
        task_cases(task)
        stub = stub_source(task)
        gold = apply_patch(stub, task.patch)
        variants = [apply_patch(stub, v) for v in task.extra.get("variants") or []]
    except (TaskError, ValueError, KeyError) as exc:
        result.problems.append(f"{type(exc).__name__}: {exc}" if not isinstance(exc, TaskError) else str(exc))
    else:
        result.problems += _check(task, run, stub, gold, variants, result)
        if hacks and sandbox and not result.problems:
            from burstrl.envs.functions.hacks import check_hacks

            result.problems += check_hacks(task, backend, timeout)[0]
    if len(result.problems) > MAX_PROBLEMS:
        result.problems = result.problems[:MAX_PROBLEMS] + [f"... and {len(result.problems) - MAX_PROBLEMS} more"]
    result.ok = not result.problems
    result.seconds = time.monotonic() - start
    return result


def _check(task: SweTask, run: Grader, stub: str, gold: str, variants: list[str], result: CheckResult) -> list[str]:
    at_base = run(task, stub)
    if at_base.infra_error:
        return [f"without any patch: {at_base.infra_error}"]
    at_gold = run(task, gold)
    result.at_base, result.at_gold = at_base.statuses, at_gold.statuses
    if at_gold.infra_error or at_gold.model_error or at_gold.reason:
        return [f"with the gold patch: {at_gold.infra_error or at_gold.model_error or at_gold.reason}"]
    if at_gold.import_error:
        return [f"the gold module does not import: {at_gold.import_error}"]
    problems = [f"FAIL_TO_PASS {tid} passes at the base" for tid, s in at_base.statuses.items() if s == "passed"]
    problems += [f"FAIL_TO_PASS {tid} is {s} with the gold patch" for tid, s in at_gold.statuses.items()
                 if s != "passed"]
    for i, source in enumerate(variants):  # other correct bodies the task names
        other = run(task, source)
        if not other.infra_error and not other.resolved:
            problems.append(f"the tests reject a correct variant of the fix (extra.variants[{i}]: "
                            f"{other.reason or other.import_error or other.statuses})")
    return problems


def run_on_host(task: SweTask, source: str, timeout: float) -> FunctionResult:
    """The runner as a subprocess of this machine, for `tasks check --host` (the task's own bodies only)."""
    cases: list[Case] = task_cases(task)
    result = FunctionResult(task.instance_id, total=len(cases))
    with tempfile.TemporaryDirectory(prefix="burstrl-fn-check-") as tmp:
        for name, data in job_files(task, source, cases, timeout).items():
            (Path(tmp) / name).write_bytes(data)
        try:
            proc = subprocess.run([sys.executable, "-E", "-s", "-B", str(Path(tmp) / "runner.py"), tmp],
                                  capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            result.infra_error = f"the runner ran past {timeout:g}s"
            return result
        results = Path(tmp) / "results"
        text = results.read_text("utf-8", "replace") if results.exists() else ""
    score(result, cases, text)
    if not text:
        result.infra_error = f"the runner gave no result: {proc.stderr[-300:]}"
    return result
