"""`burstrl tasks check`: does each task hold? (target tests fail at the base and pass with the gold
patch; existing tests pass both ways.)

Why: a flawed task (a target test that already passes, a gold patch that does not fix, an existing
test that is flaky or broken) gives rewards that mean nothing, and SWE-bench-style sets have them.
The check runs as grading does: the base is exported without history on the host (`repo`), then
uploaded into a fresh sandbox (no network, the task's image, CPU and memory) where the test patch
and then the gold patch are applied with `git apply` and the task's `test_cmd` runs with the target
and existing test ids appended. A sandbox starts in ~0.2 s, so this costs little over running on the
host; `sandbox=False` runs the same steps on the host, for machines without bubblewrap.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from burstrl.envs.swe.repo import export_base
from burstrl.envs.swe.task import SweTask
from burstrl.envs.swe.testlog import parse_test_log

SANDBOX_ROOT = "/work"
MAX_PROBLEMS = 12


@dataclass
class CheckResult:
    instance_id: str
    ok: bool
    problems: list[str] = field(default_factory=list)
    seconds: float = 0.0
    at_base: dict[str, str] = field(default_factory=dict)  # test id -> status, test patch applied
    at_gold: dict[str, str] = field(default_factory=dict)  # ... and the gold patch too


# (command, cwd) -> (exit code, output); one per place the steps run.
Exec = Callable[[str, str], tuple[int, str]]


def _host_exec(timeout: float) -> Exec:
    def run(cmd: str, cwd: str) -> tuple[int, str]:
        proc = subprocess.run(["bash", "-c", cmd], cwd=cwd, capture_output=True, text=True,
                              timeout=timeout, env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
        return proc.returncode, proc.stdout + proc.stderr
    return run


def _sandbox_exec(sb, timeout: float) -> Exec:
    def run(cmd: str, cwd: str) -> tuple[int, str]:
        # Output goes to a file: sandboxd caps exec output, and a long test log must stay whole.
        res = sb.exec(f"({cmd}) > {SANDBOX_ROOT}/.out 2>&1", timeout=timeout, cwd=cwd,
                      env={"PYTHONDONTWRITEBYTECODE": "1"})
        text = sb.read_file(f"{SANDBOX_ROOT}/.out").decode(errors="replace")
        return (124 if res.timed_out else res.exit_code), text
    return run


def _test_command(task: SweTask) -> str:
    ids = task.FAIL_TO_PASS + task.PASS_TO_PASS
    return " ".join([task.test_cmd, *(shlex.quote(t) for t in ids)])


def _apply(run: Exec, repo: str, patches: str, name: str) -> str | None:
    """Apply the patch file `name` (under `patches`); None, or the problem."""
    code, out = run(f"git apply --binary --whitespace=nowarn {patches}/{name}", repo)
    return None if code == 0 else f"{name} does not apply: {out.strip()[:300]}"


def _judge(task: SweTask, base: dict[str, str], gold: dict[str, str]) -> list[str]:
    problems = []
    if not task.FAIL_TO_PASS:
        problems.append("FAIL_TO_PASS is empty")
    for t in task.FAIL_TO_PASS:
        if base.get(t) == "passed":
            problems.append(f"FAIL_TO_PASS {t} passes at the base")
        if gold.get(t) != "passed":
            problems.append(f"FAIL_TO_PASS {t} is {gold.get(t, 'not run')} with the gold patch")
    for t in task.PASS_TO_PASS:
        for where, status in (("at the base", base), ("with the gold patch", gold)):
            if status.get(t) != "passed":
                problems.append(f"PASS_TO_PASS {t} is {status.get(t, 'not run')} {where}")
    if len(problems) > MAX_PROBLEMS:
        problems = problems[:MAX_PROBLEMS] + [f"... and {len(problems) - MAX_PROBLEMS} more"]
    return problems


def _steps(task: SweTask, run: Exec, repo: str, patches: str, result: CheckResult) -> None:
    """Test patch, tests, gold patch, tests; fills `result`."""
    if task.test_patch.strip() and (problem := _apply(run, repo, patches, "test.patch")):
        result.problems.append(problem)
        return
    result.at_base = parse_test_log(run(_test_command(task), repo)[1])
    if problem := _apply(run, repo, patches, "gold.patch"):
        result.problems.append(problem)
        return
    result.at_gold = parse_test_log(run(_test_command(task), repo)[1])
    result.problems += _judge(task, result.at_base, result.at_gold)


def _patch_texts(task: SweTask) -> dict[str, str]:
    return {name: text if text.endswith("\n") else text + "\n"
            for name, text in (("gold.patch", task.patch), ("test.patch", task.test_patch))}


def check_task(task: SweTask, workdir: Path, sandbox: bool = True, timeout: float = 300) -> CheckResult:
    """Check one task in a fresh export under `workdir`; a repository that will not export is a
    problem of the task, reported like the others."""
    start = time.monotonic()
    result = CheckResult(task.instance_id, ok=False)
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
    if sandbox:
        _check_in_sandbox(task, local, result, timeout)
    else:
        _steps(task, _host_exec(timeout), str(local / "repo"), str(local), result)
    result.ok = not result.problems
    result.seconds = time.monotonic() - start
    return result


def _check_in_sandbox(task: SweTask, local: Path, result: CheckResult, timeout: float) -> None:
    from burstrl.sandbox import open_sandbox

    sb = open_sandbox(image=task.image or None, cpu_limit=task.cpu, memory_limit_mb=task.memory)
    try:
        sb.upload(local, SANDBOX_ROOT)
        _steps(task, _sandbox_exec(sb, timeout), f"{SANDBOX_ROOT}/repo", SANDBOX_ROOT, result)
    finally:
        sb.close()


def check_tasks(tasks: list[SweTask], workdir: Path | str, sandbox: bool = True, jobs: int = 1,
                timeout: float = 300) -> list[CheckResult]:
    """Check every task (up to `jobs` at once); results in the order of `tasks`."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        return list(pool.map(lambda t: check_task(t, workdir, sandbox, timeout), tasks))


def format_results(results: list[CheckResult]) -> str:
    """A plain table: one row per task, then its problems indented."""
    width = max([len(r.instance_id) for r in results] + [7])
    lines = [f"{'task':<{width}}  status  seconds"]
    for r in results:
        lines.append(f"{r.instance_id:<{width}}  {'ok' if r.ok else 'FLAWED':<6}  {r.seconds:7.2f}")
        lines += [f"    - {p}" for p in r.problems]
    bad = sum(not r.ok for r in results)
    lines.append(f"{len(results) - bad} ok, {bad} flawed, {len(results)} tasks")
    return "\n".join(lines)
