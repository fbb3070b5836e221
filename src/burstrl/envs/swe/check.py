"""`burstrl tasks check`: does each task hold? (target tests fail at the base and pass with the gold
patch; existing tests pass both ways.)

Why: a flawed task (a target test that already passes, a gold patch that does not fix, an existing
test that is flaky or broken, a test runner the image lacks) gives rewards that mean nothing, and
SWE-bench-style sets have them. In sandboxes the check IS grading: `grade` of the empty patch (the
base) and of the gold patch, so every step is the grader's (test files and test configuration
reset after the gold patch, the test patch on top, the JUnit cross-check). A "gold" patch that only
edits tests is reported flawed here, not found later as a task that always scores 0. When the
runner itself fails (`No module named pytest`, a stale id) that error is the one problem reported,
not one "not run" line per test id. `sandbox=False` runs the same steps with plain git on the host,
for machines without bubblewrap (no integrity checks there: nothing untrusted runs).
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from burstrl.envs.swe import diffpolicy
from burstrl.envs.swe.checkresult import MAX_PROBLEMS, CheckResult
from burstrl.envs.swe.diffpolicy import DiffPolicy
from burstrl.envs.swe.grade import base_tar, grade, graded_test_files, patch_paths
from burstrl.envs.swe.integrity import harness_files, runner_error
from burstrl.envs.swe.repo import export_base
from burstrl.envs.swe.screen import test_dirs
from burstrl.envs.swe.task import SweTask
from burstrl.envs.swe.testlog import EXPECTED, parse_test_log, status_of

# (command, cwd) -> (exit code, output); one per place the steps run.
Exec = Callable[[str, str], tuple[int, str]]


def _host_exec(timeout: float) -> Exec:
    def run(cmd: str, cwd: str) -> tuple[int, str]:
        proc = subprocess.run(["bash", "-c", cmd], cwd=cwd, capture_output=True, text=True,
                              timeout=timeout, env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
        return proc.returncode, proc.stdout + proc.stderr
    return run


def _test_command(task: SweTask) -> str:
    ids = task.FAIL_TO_PASS + task.PASS_TO_PASS
    return " ".join([task.test_cmd, *(shlex.quote(t) for t in ids)])


def _apply(run: Exec, repo: str, patches: str, name: str) -> str | None:
    """Apply the patch file `name` (under `patches`); None, or the problem."""
    code, out = run(f"git apply --binary --whitespace=nowarn {patches}/{name}", repo)
    return None if code == 0 else f"{name} does not apply: {out.strip()[:300]}"


def _judge(task: SweTask, base: dict[str, str], gold: dict[str, str]) -> list[str]:
    """Target tests fail at the base and pass with the gold patch; existing ones pass both ways.
    An xfailed/xpassed outcome passes where the gold run shows the same (as grading credits it)."""
    def st(statuses: dict[str, str], t: str) -> str:
        s = status_of(statuses, t)
        return "not run" if s == "missing" else s

    def passes(statuses: dict[str, str], t: str) -> bool:
        s = st(statuses, t)
        return s == "passed" or (s in EXPECTED and s == st(gold, t))

    problems = []
    if not task.FAIL_TO_PASS:
        problems.append("FAIL_TO_PASS is empty")
    for t in task.FAIL_TO_PASS:
        if passes(base, t):
            problems.append(f"FAIL_TO_PASS {t} passes at the base")
        if not passes(gold, t):
            problems.append(f"FAIL_TO_PASS {t} is {st(gold, t)} with the gold patch")
    for t in task.PASS_TO_PASS:
        for where, status in (("at the base", base), ("with the gold patch", gold)):
            if not passes(status, t):
                problems.append(f"PASS_TO_PASS {t} is {st(status, t)} {where}")
    if len(problems) > MAX_PROBLEMS:
        problems = problems[:MAX_PROBLEMS] + [f"... and {len(problems) - MAX_PROBLEMS} more"]
    return problems


def _steps(task: SweTask, run: Exec, repo: str, patches: str, result: CheckResult) -> None:
    """On the host, grading's steps with plain git: test patch, tests; back to the base, gold
    patch, the files grading resets reset, test patch, tests. Fills `result`."""
    if task.test_patch.strip() and (problem := _apply(run, repo, patches, "test.patch")):
        result.problems.append(problem)
        return
    code, out = run(_test_command(task), repo)
    result.at_base = parse_test_log(out)
    if err := runner_error(out, code, result.at_base, task.FAIL_TO_PASS + task.PASS_TO_PASS):
        result.problems.append(f"the test runner fails without any patch: {err}")
        return
    run("git reset -q --hard && git clean -fdq", repo)
    base_files = frozenset(run("git ls-files", repo)[1].split())
    dirs = test_dirs(graded_test_files(task, base_files))
    verdict = diffpolicy.check(task.patch, base_files, dirs, DiffPolicy.of(task.extra.get("diff_policy")))
    if verdict.violation is not None:  # (on the host no interpreter is asked about shadowing)
        result.problems.append(_refused(str(verdict.violation)))
        return
    if problem := _apply(run, repo, patches, "gold.patch"):
        result.problems.append(problem)
        return
    files = run("git ls-files", repo)[1].split()
    tests, touched = graded_test_files(task, frozenset(files)), patch_paths(task.patch)
    protected = tests + patch_paths(task.test_patch) + harness_files(touched, tests, set(touched) - set(files))
    for f in dict.fromkeys(protected):
        run(f"git checkout -q HEAD -- {shlex.quote(f)} 2>/dev/null || rm -rf -- {shlex.quote(f)}", repo)
    if task.test_patch.strip() and (problem := _apply(run, repo, patches, "test.patch")):
        result.problems.append(problem)
        return
    result.at_gold = parse_test_log(run(_test_command(task), repo)[1])
    result.problems += _judge(task, result.at_base, result.at_gold)
    if (reset := [p for p in touched if p in protected]) and result.problems:
        result.problems.append(f"the gold patch edits files grading resets: {', '.join(reset[:8])}")


def _refused(violation: str) -> str:
    return (f"the gold patch is refused by the diff policy ({violation}); if a fix needs such paths, allow "
            "them with orchestrator.swe.diff_allow or the task's extra.diff_policy")


def _patch_texts(task: SweTask) -> dict[str, str]:
    return {name: text if text.endswith("\n") else text + "\n"
            for name, text in (("gold.patch", task.patch), ("test.patch", task.test_patch))}


def check_task(task: SweTask, workdir: Path, sandbox: bool = True, timeout: float = 300,
               backend: Any = "namespace", hacks: str = "") -> CheckResult:
    """Check one task (in sandboxes: by grading it; on the host: in a fresh export under `workdir`);
    a repository that will not export is a problem of the task, reported like the others. `hacks`
    (sandboxes only; "zero" or "flag", the static scan's setting of training): a task that holds is
    also graded against `hacks.HACKS`, and any hack that scores above 0 is a problem."""
    from burstrl.envs.functions.cases import is_functions_task

    if is_functions_task(task):  # graded apart from the candidate, not by this grader: envs/functions/check.py
        from burstrl.envs.functions.check import check_function_task

        return check_function_task(task, sandbox, timeout, backend, hacks=bool(hacks))
    start = time.monotonic()
    result = CheckResult(task.instance_id, ok=False)
    if sandbox:
        try:
            base_tar(task)
        except (OSError, RuntimeError) as exc:
            result.problems.append(f"export of {task.repo}@{task.base_commit} failed: {exc}")
        else:
            _check_by_grading(task, result, timeout, backend)
            if hacks and not result.problems:
                from burstrl.envs.swe.hacks import check_hacks

                result.problems += check_hacks(task, backend, timeout, suspicious=hacks)[0]
        result.ok = not result.problems
        result.seconds = time.monotonic() - start
        return result
    local = Path(workdir) / task.instance_id
    shutil.rmtree(local, ignore_errors=True)
    try:
        export_base(task, local / "repo")
    except (OSError, RuntimeError) as exc:
        result.problems.append(f"export of {task.repo}@{task.base_commit} failed: {exc}")
        result.seconds = time.monotonic() - start
        return result
    for name, text in _patch_texts(task).items():
        (local / name).write_text(text)
    _steps(task, _host_exec(timeout), str(local / "repo"), str(local), result)
    result.ok = not result.problems
    result.seconds = time.monotonic() - start
    return result


def _check_by_grading(task: SweTask, result: CheckResult, timeout: float, backend: Any) -> None:
    """The base (empty patch) and the gold patch, each graded exactly as an attempt is."""
    at_base = grade(task, "", backend, timeout_s=timeout)
    if at_base.infra_error:
        result.problems.append(f"without any patch: {at_base.infra_error}")
        return
    if at_base.reason.startswith("tampered: sealed run"):  # no patch at all: only the grader can be at fault
        result.problems.append(_sealed_tamper_problem("", "without any patch", at_base.tampered))
        return
    gold = grade(task, task.patch, backend, timeout_s=timeout, gold=True)
    result.at_base, result.at_gold = at_base.statuses, gold.statuses
    if gold.policy_rule:
        result.problems.append(_refused(gold.tampered))
        return
    if not gold.apply_ok:
        result.problems.append(f"gold.patch does not apply: {gold.apply_error[:300]}")
        return
    if gold.reason.startswith("tampered: sealed run") and not (gold.infra_error or gold.model_error):
        result.problems.append(_sealed_tamper_problem(task.patch, "with the gold patch", gold.tampered))
        return
    if gold.infra_error or gold.model_error or gold.reason:
        result.problems.append(f"with the gold patch: {gold.infra_error or gold.model_error or gold.reason}")
        return
    if gold.runner_error:  # one line with the runner's own words, not one "not run" per test
        result.problems.append(f"the test runner runs no graded test with the gold patch: {gold.runner_error}")
        return
    result.problems += _judge(task, result.at_base, result.at_gold)
    if gold.suspicious:  # training (suspicious = "zero") would score the gold fix 0
        result.problems.append(f"the static scan flags what the gold patch adds: {', '.join(gold.suspicious[:5])} "
                               "(train this task set with orchestrator.swe.suspicious = \"flag\")")
    if gold.reset_files and not gold.resolved:
        result.problems.append(f"the gold patch edits files grading resets: {', '.join(gold.reset_files[:8])}")
    for i, variant in enumerate(task.extra.get("variants") or []):  # other correct fixes the task names
        other = grade(task, variant, backend, timeout_s=timeout)
        if not other.infra_error and not other.resolved:
            result.problems.append(f"the tests reject a correct variant of the fix (extra.variants[{i}]: "
                                   f"{other.reason or other.statuses})")


GRADER_BUG = "GRADER BUG"


def _sealed_tamper_problem(patch: str, when: str, tampered: str) -> str:
    """The problem to report when the sealed run calls the base run (`patch` "") or the gold
    patch tampered.

    Why its own message: an honest upstream fix, or no patch at all, that the seal refuses is not a
    flawed task but the grader failing (issue 48: pytest from PYTHONPATH read as the patch's code),
    which would score every correct attempt 0; a user must report it, not drop the task. Only where
    the seal names a file the gold patch itself changes is it the fix's own code reaching for a
    refused primitive (frames, gc, ctypes): a task the seal cannot grade, said so."""
    import re

    from burstrl.envs.swe.testrun import REPO_DIR

    rule = tampered.removeprefix("sealed run ").split(":", 1)[0].strip() or "?"
    found = re.findall(r"\(from ([^()]*)\)", tampered)
    where = found[-1] if found else "?"
    path = re.sub(r":\d+$", "", where).removeprefix(REPO_DIR + "/")
    if patch and path in patch_paths(patch):
        return (f"{when}: the seal refuses what the gold patch's own code does (rule {rule} at {where}): "
                f"{tampered}; the fix uses a primitive the sealed run forbids, so this task cannot be graded sealed")
    return (f"{GRADER_BUG} (report it; the task may well be fine): {when}, the sealed run is called tampered by "
            f"the seal's rule {rule} at {where}, which is no code of the gold patch: {tampered}. Honest code is "
            "never tampered; please report this line with the task's image and test_cmd")


def check_tasks(tasks: list[SweTask], workdir: Path | str, sandbox: bool = True, jobs: int = 1,
                timeout: float = 300, backend: str = "namespace", hacks: str = "") -> list[CheckResult]:
    """Check every task (up to `jobs` at once); results in the order of `tasks`."""
    if hacks and not sandbox:
        raise ValueError("the hack battery runs the model's side of grading: it needs sandboxes, not --host")
    from burstrl.sandbox.pool import SandboxPool

    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    sandboxes = SandboxPool(backend, max_concurrent=None) if sandbox else None
    try:
        with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
            return list(pool.map(lambda t: check_task(t, workdir, sandbox, timeout, sandboxes, hacks), tasks))
    finally:
        if sandboxes is not None:
            sandboxes.close_all()


def format_results(results: list[CheckResult]) -> str:
    """A plain table: one row per task, then its problems indented."""
    def status(r: CheckResult) -> str:  # a grader bug is not the task's flaw: it gets its own status
        return "ok" if r.ok else GRADER_BUG if any(p.startswith(GRADER_BUG) for p in r.problems) else "FLAWED"

    width = max([len(r.instance_id) for r in results] + [7])
    swidth = max([len(status(r)) for r in results] + [6])
    lines = [f"{'task':<{width}}  {'status':<{swidth}}  seconds"]
    for r in results:
        lines.append(f"{r.instance_id:<{width}}  {status(r):<{swidth}}  {r.seconds:7.2f}")
        lines += [f"    - {p}" for p in r.problems]
    bad = sum(not r.ok for r in results)
    bugs = sum(status(r) == GRADER_BUG for r in results)
    lines.append(f"{len(results) - bad} ok, {bad} flawed, {len(results)} tasks"
                 + (f"; {bugs} of them by a grader bug, not the task: please report it" if bugs else ""))
    return "\n".join(lines)
