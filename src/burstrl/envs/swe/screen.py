"""Screening a patch before its tests run: the diff policy's verdict and the static scan.

Both run in the grading sandbox's terms (the test interpreter is asked about shadowing; the changed
files are read back after the patch) and decide before any code of the patch runs. The rules are
in `diffpolicy.py`, `scan.py` and `primitives.py`; this module feeds them the sandbox's facts and
turns the scan's policy-level findings into the diff policy's refusal (`refusal`).
"""

from __future__ import annotations

import io
import shlex
import tarfile
from collections.abc import Sequence

from burstrl.envs.swe import diffpolicy, primitives, scan
from burstrl.envs.swe.diffpolicy import DiffPolicy
from burstrl.envs.swe.integrity import nearest_test_dir
from burstrl.envs.swe.sandboxes import GradingSandbox
from burstrl.sandbox.client import SandboxError

SCAN_CAP = 4 * 1024 * 1024  # bytes of one changed .py file the static scan reads (a larger one is flagged)


class GradeInfraError(RuntimeError):
    """A grading step that cannot fail for a model's reason failed (resetting the fresh repo)."""


def scan_changes(sandbox: GradingSandbox, paths: Sequence[str], repo_tar: bytes, repo_dir: str,
                 tests: Sequence[str] = ()) -> list[str]:
    """`scan.added` over the changed Python files (read back from the sandbox after the patch; the
    base versions from the export): what the patch adds of a forgery's primitives. `tests`: the
    graded test files (code that names them is `test_access`). Policy-level findings come first,
    so that the record's cap never drops one."""
    found: list[str] = []
    with tarfile.open(fileobj=io.BytesIO(repo_tar)) as tar:
        names = set(tar.getnames())
        for path in paths:
            if not path.endswith(".py"):
                continue
            try:
                new = sandbox.read_file(f"{repo_dir}/{path}")
            except SandboxError as exc:
                if exc.status == 404:
                    continue  # deleted or renamed away
                if 400 <= exc.status < 500:  # over the cap (or not a regular file): nobody reviews that
                    found.append(f"{path}: unscannable ({exc.status})")
                    continue
                raise
            if len(new) > SCAN_CAP:
                found.append(f"{path}: unscannable (over {SCAN_CAP} bytes)")
                continue
            member = tar.extractfile(f"./{path}") if f"./{path}" in names else None
            base = member.read().decode("utf-8", "replace") if member is not None else None
            found += scan.added(base, new.decode("utf-8", "replace"), path, tests)
    found.sort(key=lambda f: not scan.policy_rule(f))
    return found[:50]


def refusal(findings: Sequence[str], policy: DiffPolicy) -> tuple[diffpolicy.Violation | None, list[str]]:
    """(the diff policy's refusal of the first policy-level finding the task set does not allow,
    the findings to record): allowed ones are dropped, the task set vouched for them."""
    refused: list[tuple[str, str, str]] = []
    kept: list[str] = []
    for finding in findings:
        rule = scan.policy_rule(finding)
        path, _, primitive = finding.rpartition(": ")
        if rule and policy.allows_primitive(path, primitive, rule):
            continue
        kept.append(finding)
        if rule:
            refused.append((rule, path, primitive))
    if not refused:
        return None, kept
    rule, path, primitive = refused[0]
    more = [f"{p}: {q}" for _, p, q in refused[1:4]]
    why = (f"{primitive}: {primitives.WHY.get(primitive, primitive)}"
           + (f" (and {', '.join(more)})" if more else "")
           + f"; no bug fix needs it (a task set whose fixes do: allow \"{primitive}:<glob>\" in "
           "orchestrator.swe.diff_allow or the task's extra.diff_policy)")
    return diffpolicy.Violation(rule, path, why), kept


def test_dirs(tests: Sequence[str]) -> set[str]:
    """The graded test files' directories and their test roots: where a conftest.py is a test file."""
    return {t.rpartition("/")[0] for t in tests} | {r for t in tests if (r := nearest_test_dir(t))}


def policy_violation(sandbox: GradingSandbox, patch: str, base_files: frozenset[str], tests: Sequence[str],
                     policy: DiffPolicy) -> diffpolicy.Violation | None:
    """The diff policy's verdict; `shadowing` asks the grading sandbox's `python3` (isolated mode,
    from `/`, the patch not yet applied) which new top-level names it already imports."""
    if not patch.strip():
        return None
    verdict = diffpolicy.check(patch, base_files, test_dirs(tests), policy)
    if verdict.violation is not None:
        return verdict.violation

    def importable(names: list[str]) -> set[str]:
        cmd = shlex.join(["python3", "-I", "-c", diffpolicy.IMPORTABLE_PROBE, *names])
        res = sandbox.exec(cmd, cwd="/", timeout=120)
        if res.exit_code != 0:
            raise GradeInfraError(f"could not ask the test interpreter which names it imports: {res.stderr[-2000:]}")
        return set(res.stdout.split())

    return diffpolicy.shadowing(verdict.new_top_level, importable)
