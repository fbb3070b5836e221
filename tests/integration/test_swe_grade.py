"""Commit-only grading in real sandboxes, on a hand-made toy task (a real git repo, unittest tests).

The task: `calc.add` subtracts (the bug); `tests.test_calc.TestAdd.test_add` is the target test,
`tests.test_calc.TestMul.test_mul` an existing one that passes both ways.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from burstrl.envs.swe.diffpolicy import DiffPolicy
from burstrl.envs.swe.grade import extract_patch, grade, reward_of
from burstrl.envs.swe.repo import BASE_TAG, commit_all, export_base, init_repo
from burstrl.envs.swe.task import SweTask
from burstrl.sandbox.pool import SandboxPool
from tests.benchmark_modules import load_benchmark

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None,
                                reason="bubblewrap (bwrap) is not installed: `make system-deps` as root")

CALC = "def add(a, b):\n    return a - b\n\n\ndef mul(a, b):\n    return a * b\n"
TESTS = """import unittest

from calc import add, mul


class TestAdd(unittest.TestCase):
    def test_add(self):
        self.assertEqual(add(2, 3), 5)


class TestMul(unittest.TestCase):
    def test_mul(self):
        self.assertEqual(mul(2, 3), 6)
"""
GOLD_CALC = CALC.replace("a - b", "a + b")
BREAKS_MUL_CALC = GOLD_CALC.replace("a * b", "a ** b")  # fixes add, breaks mul (an existing test)
STALE_CALC = CALC.replace("a - b", "a // b")


def diff_of(repo: Path, path: str, text: str) -> str:
    """The git diff that turns `path` into `text` at HEAD (the tree is left as it was)."""
    old = (repo / path).read_text()
    (repo / path).write_text(text)
    patch = subprocess.run(["git", "-C", str(repo), "diff"], capture_output=True, text=True, check=True).stdout
    (repo / path).write_text(old)
    return patch


@pytest.fixture(scope="module")
def patches(task: SweTask, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    repo = Path(task.repo)
    stale_repo = tmp_path_factory.mktemp("stale")
    (stale_repo / "calc.py").write_text(STALE_CALC)
    init_repo(stale_repo)
    commit_all(stale_repo, "other base")
    return {"gold": task.patch, "breaks_mul": diff_of(repo, "calc.py", BREAKS_MUL_CALC),
            "stale": diff_of(stale_repo, "calc.py", GOLD_CALC)}


def make_task(root: Path, name: str = "toy-1") -> SweTask:
    repo = root / name
    init_repo(repo)
    (repo / "tests").mkdir()
    (repo / "calc.py").write_text(CALC)
    (repo / "tests" / "__init__.py").write_text("")
    (repo / "tests" / "test_calc.py").write_text(TESTS)
    base = commit_all(repo, "buggy base")
    gold = diff_of(repo, "calc.py", GOLD_CALC)
    return SweTask(instance_id=name, repo=str(repo), base_commit=base, problem_statement="add() subtracts",
                   FAIL_TO_PASS=["tests.test_calc.TestAdd.test_add"],
                   PASS_TO_PASS=["tests.test_calc.TestMul.test_mul"], patch=gold,
                   test_cmd="python3 -m unittest -v", cpu=1.0, memory=512)


@pytest.fixture(scope="module")
def pool():
    with SandboxPool("namespace", max_concurrent=8) as p:
        yield p


@pytest.fixture(scope="module")
def task(tmp_path_factory: pytest.TempPathFactory) -> SweTask:
    return make_task(tmp_path_factory.mktemp("tasks"))


def test_gold_patch_is_resolved(task: SweTask, pool: SandboxPool) -> None:
    r = grade(task, task.patch, pool, timeout_s=60)
    assert r.infra_error == "" and r.apply_ok
    assert r.resolved and r.f2p == 1.0 and r.strict == 1.0, r.log
    assert (r.f2p_passed, r.f2p_total, r.p2p_failed, r.p2p_total) == (1, 1, 0, 1)
    assert reward_of(r) == 1.0 and "test_add" in r.log and r.duration_s > 0


def test_empty_patch_is_not_resolved(task: SweTask, pool: SandboxPool) -> None:
    r = grade(task, "", pool, timeout_s=60)
    assert r.apply_ok and r.infra_error == ""
    assert not r.resolved and r.f2p == 0.0 and r.p2p_failed == 0
    assert reward_of(r) == 0.0


def test_breaking_an_existing_test_zeroes_strict(task: SweTask, pool: SandboxPool,
                                                 patches: dict[str, str]) -> None:
    r = grade(task, patches["breaks_mul"], pool, timeout_s=60)
    assert r.apply_ok and r.f2p == 1.0
    assert r.strict == 0.0 and not r.resolved and r.p2p_failed == 1
    assert r.statuses == {"tests.test_calc.TestAdd.test_add": "passed", "tests.test_calc.TestMul.test_mul": "failed"}


def test_patch_that_does_not_apply_scores_zero(task: SweTask, pool: SandboxPool,
                                               patches: dict[str, str]) -> None:
    r = grade(task, patches["stale"], pool, timeout_s=60)
    assert not r.apply_ok and r.apply_error and r.infra_error == ""
    assert [reward_of(r, k) for k in ("binary", "f2p", "strict")] == [0.0, 0.0, 0.0]
    assert r.log == ""  # no tests were run


def test_test_patch_is_applied_over_the_models_edits(task: SweTask, pool: SandboxPool) -> None:
    """The hidden test patch adds a target test; the model's edit of that test file is undone."""
    tests_py = "tests/test_calc.py"
    new_test = "\n    def test_add_negative(self):\n        self.assertEqual(add(-2, -3), -5)\n"
    hidden = diff_of(Path(task.repo), tests_py, TESTS.replace("5)\n", "5)\n" + new_test, 1))
    cheat = diff_of(Path(task.repo), tests_py, TESTS.replace("add(2, 3), 5)", "add(2, 3), -1)"))
    hidden_task = SweTask(**{**task.to_json(), "test_patch": hidden,
                             "FAIL_TO_PASS": task.FAIL_TO_PASS + ["tests.test_calc.TestAdd.test_add_negative"]})
    assert grade(hidden_task, task.patch, pool, timeout_s=60).resolved
    r = grade(hidden_task, cheat, pool, timeout_s=60)
    assert r.apply_ok and r.f2p == 0.0 and not r.resolved


def test_editing_a_graded_test_in_the_repo_does_not_count(task: SweTask, pool: SandboxPool) -> None:
    """With the tests in the repo (toy tasks, no test patch), the test files are reset before running."""
    cheat = diff_of(Path(task.repo), "tests/test_calc.py", TESTS.replace("add(2, 3), 5)", "add(2, 3), -1)"))
    r = grade(task, cheat, pool, timeout_s=60)
    assert r.apply_ok and r.f2p == 0.0 and not r.resolved


# A test runner that prints nothing parseable and writes a JUnit XML report: statuses come from it.
JUNIT_RUNNER = """import os, sys, unittest
from xml.sax.saxutils import quoteattr
cases = []
for tid in sys.argv[2:]:
    result = unittest.TestResult()
    unittest.defaultTestLoader.loadTestsFromName(tid).run(result)
    inner = "<failure message='x'/>" if result.failures else "<error message='x'/>" if result.errors else ""
    cls, name = tid.rsplit(".", 1)
    cases.append(f"<testcase classname={quoteattr(cls)} name={quoteattr(name)}>{inner}</testcase>")
out = sys.argv[1].split("=", 1)[1]
os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
open(out, "w").write("<testsuite>" + "".join(cases) + "</testsuite>")
"""


def test_junit_report_is_used_and_a_committed_fake_is_not(task: SweTask, pool: SandboxPool,
                                                          tmp_path: Path) -> None:
    repo = tmp_path / "junit-repo"
    subprocess.run(["git", "clone", "-q", task.repo, str(repo)], check=True)
    init_repo(repo)
    (repo / "junit_run.py").write_text(JUNIT_RUNNER)
    base = commit_all(repo, "with a junit runner")
    jtask = SweTask(**{**task.to_json(), "repo": str(repo), "base_commit": base,
                       "test_cmd": "python3 junit_run.py --junitxml=out/report.xml"})
    fake = ("<testsuite><testcase classname='tests.test_calc.TestAdd' name='test_add'/>"
            "<testcase classname='tests.test_calc.TestMul' name='test_mul'/></testsuite>")
    (repo / "out").mkdir()
    (repo / "out" / "report.xml").write_text(fake)
    (repo / "calc.py").write_text("import sys\nsys.exit(0)\n" + CALC)  # the run ends before its report
    subprocess.run(["git", "-C", str(repo), "add", "-N", "out/report.xml"], check=True)
    cheat = subprocess.run(["git", "-C", str(repo), "diff"], capture_output=True, text=True, check=True).stdout
    gold = grade(jtask, task.patch, pool, timeout_s=60)
    assert gold.resolved and gold.log == "", (gold.log, gold.statuses)
    refused = grade(jtask, cheat, pool, timeout_s=60)  # a new file outside the source directories
    assert refused.policy_rule == "outside_source" and not refused.resolved
    faked = grade(jtask, cheat, pool, timeout_s=60, policy=DiffPolicy(allow=("out/*",)))  # the report path's rule
    assert faked.apply_ok and not faked.resolved and faked.f2p == 0.0


def test_timeout_is_an_infra_error(task: SweTask, pool: SandboxPool) -> None:
    slow = SweTask(**{**task.to_json(), "test_cmd": "sleep 30; python3 -m unittest -v"})
    r = grade(slow, task.patch, pool, timeout_s=1)
    assert r.timed_out and "ran past" in r.infra_error
    with pytest.raises(ValueError, match="infra"):
        reward_of(r)


def test_extract_patch_counts_committed_changes_only(task: SweTask, pool: SandboxPool, tmp_path: Path) -> None:
    base = export_base(task, tmp_path / "repo")
    sb = pool.create()
    try:
        sb.upload(str(tmp_path / "repo"), "/work/repo")
        assert extract_patch(sb) == ""  # nothing committed yet
        steps = [
            "sed -i 's/a - b/a + b/' calc.py && git commit -qam 'fix add'",
            "sed -i 's/a \\* b/a * b * 1/' calc.py",  # uncommitted edit of a tracked file
            "echo 'print(1)' > untracked.py && echo x > tests/notes.txt",  # untracked files
            "git add tests/notes.txt",  # staged but not committed
            "git config diff.noprefix true && git config color.diff always",  # hostile config
        ]
        for cmd in steps:
            res = sb.exec(cmd, cwd="/work/repo", timeout=30)
            assert res.exit_code == 0, res.stderr
        patch = extract_patch(sb)
        assert extract_patch(sb, base=base) == patch
    finally:
        sb.close()
    assert "+    return a + b" in patch and "a * b * 1" not in patch
    assert "untracked.py" not in patch and "notes.txt" not in patch and "\x1b[" not in patch
    assert grade(task, patch, pool, timeout_s=60).resolved


def test_extract_patch_of_a_broken_repo_is_empty(task: SweTask, pool: SandboxPool, tmp_path: Path) -> None:
    export_base(task, tmp_path / "repo")
    with pool.create() as sb:
        sb.upload(str(tmp_path / "repo"), "/work/repo")
        sb.exec("rm -rf .git", cwd="/work/repo", timeout=30)
        assert extract_patch(sb) == ""


def test_tag_is_in_the_export(task: SweTask, tmp_path: Path) -> None:
    base = export_base(task, tmp_path / "repo")
    tag = subprocess.run(["git", "-C", str(tmp_path / "repo"), "rev-parse", BASE_TAG], capture_output=True,
                         text=True, check=True).stdout.strip()
    assert tag == base


@pytest.fixture(scope="module")
def toy_tasks(tmp_path_factory: pytest.TempPathFactory) -> list[SweTask]:
    from burstrl.envs.swe.toygen import make_toy_tasks

    return make_toy_tasks(tmp_path_factory.mktemp("toygen"), 2, seed=3, difficulty=2)


def test_generated_toy_task_gold_resolves_and_empty_does_not(toy_tasks: list[SweTask], pool: SandboxPool) -> None:
    for task in toy_tasks:
        gold = grade(task, task.patch, pool, timeout_s=60)
        assert gold.resolved and gold.f2p == 1.0 and gold.strict == 1.0, gold.log
        assert gold.p2p_total == len(set(task.PASS_TO_PASS)) and gold.p2p_failed == 0
        empty = grade(task, "", pool, timeout_s=60)
        assert empty.infra_error == "" and not empty.resolved and empty.f2p == 0.0 and empty.p2p_failed == 0


def test_grading_throughput_runs_in_parallel(toy_tasks: list[SweTask], pool: SandboxPool,
                                              task: SweTask, patches: dict[str, str]) -> None:
    tasks = [*toy_tasks, task, task]
    graded = [tasks[0].patch, "", task.patch, patches["breaks_mul"]]
    stats = load_benchmark("swe").grading_throughput(tasks, graded, pool, n=4, timeout_s=60)
    assert stats["attempts"] == 4 and stats["resolved"] == 2 and stats["infra_errors"] == 0, stats
    assert stats["per_minute"] > 0
