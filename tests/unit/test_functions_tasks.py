"""The functions task family (issues 35, 48): distinct problems, held-out splits, stubs, cases as data
(what grading compares), the same cases as unittest files (for people), and patches."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from burstrl.envs.functions.env import function_body
from burstrl.envs.functions.tasks import attempt_patch, hidden_tests, make_function_tasks, make_problems, stub
from burstrl.envs.functions.templates import TEMPLATES, TEST_CONSTS, TRAIN_CONSTS


def test_a_few_hundred_distinct_problems_per_split() -> None:
    for split in ("train", "test"):
        problems = make_problems(300, 0, split)
        assert len({(p.name, p.args, p.body) for p in problems}) == 300
        assert all(len(p.cases) >= 3 for p in problems)
    assert make_problems(20, 0, "train") == make_problems(20, 0, "train")  # fixed by the seed
    assert make_problems(20, 1, "train") != make_problems(20, 0, "train")
    with pytest.raises(ValueError, match="distinct"):
        make_problems(5000, 0, "train")


def test_the_held_out_split_has_unseen_templates_and_unseen_constants() -> None:
    held = {t.key for t in TEMPLATES if t.held_out}
    train, test = make_problems(300, 0, "train"), make_problems(300, 0, "test")
    assert held and not held & {p.template for p in train}
    assert held & {p.template for p in test}
    train_bodies = {p.body for p in train}
    assert not train_bodies & {p.body for p in test}  # no test problem's reference is a training one's
    for p in train:  # constants of training come from the training range only
        assert not any(f"{c}" in p.body.split() or f" {c}" in p.body for c in TEST_CONSTS if c > 9), p.body
    assert any(any(f" {c}" in p.body for c in TRAIN_CONSTS) for p in train)


def test_the_reference_passes_its_tests_and_the_stub_fails_them(tmp_path: Path) -> None:
    """Every hidden test passes on the reference and on the other correct body (the variant), and
    fails on the stub (one unittest run each way)."""
    problems = make_problems(60, 3, "test") + make_problems(60, 3, "train")
    assert all(p.variant for p in problems)
    for which, ok in (("solution", True), ("variant_solution", True), ("stub", False)):
        root = tmp_path / which
        (root / "fns").mkdir(parents=True)
        (root / "fns" / "__init__.py").write_text("")
        for i, p in enumerate(problems):
            (root / "fns" / f"m{i}.py").write_text(getattr(p, which) if ok else stub(p))
            (root / f"test_m{i}.py").write_text(hidden_tests(f"m{i}", p))
        res = subprocess.run([sys.executable, "-m", "unittest", "discover", "-p", "test_m*.py"], cwd=root,
                             capture_output=True, text=True, timeout=300)
        ran = sum(len(p.cases) for p in problems)
        assert f"Ran {ran} tests" in res.stderr, res.stderr[-500:]
        assert (res.returncode == 0) == ok and (ok or f"errors={ran})" in res.stderr), res.stderr[-1500:]


@pytest.mark.parametrize("split", ["train", "test"])
def test_the_cases_hold_for_the_reference_and_the_variant_and_not_the_stub(split: str, tmp_path: Path) -> None:
    """What grading compares (`extra.cases`, through the runner, as `tasks check --host` runs it): the
    gold body and the variant pass every case, the stub none."""
    from burstrl.envs.functions.check import check_function_task

    tasks = make_function_tasks(tmp_path / split, 16, 5, split)
    assert all(t.extra["variants"] for t in tasks)
    for t in tasks:
        result = check_function_task(t, sandbox=False, timeout=20)
        assert result.ok, (t.instance_id, result.problems)
        assert set(result.at_gold.values()) == {"passed"} and "passed" not in result.at_base.values()


def test_function_body_stops_at_the_end_of_the_function() -> None:
    assert function_body("    return x * 3\n\ndef other():\n    pass\n") == "    return x * 3\n"
    assert function_body("    if n:\n        return 1\n    return 0\nprint(f(2))") == \
        "    if n:\n        return 1\n    return 0\n"
    assert function_body("return x") == ""  # not indented: not a body
    assert function_body("") == "" and function_body("\n\n") == ""


@pytest.mark.parametrize("body", ["    return x * 3\n", "    return 'a\x0bb'  \n", "    return 1",
                                  "    s = '''\n\n'''\n    return s\n"])
def test_an_attempt_patch_applies_with_git(body: str, tmp_path: Path) -> None:
    [task] = make_function_tasks(tmp_path / "set", 1, 0, "train")
    path = task.extra["file"]
    repo = Path(task.repo)
    old = (repo / path).read_text()
    new = task.extra["prompt"] + body
    patch = attempt_patch(path, old, new)
    res = subprocess.run(["git", "apply", "--check", "-"], cwd=repo, input=patch, text=True, capture_output=True)
    assert res.returncode == 0, (res.stderr, patch)
    subprocess.run(["git", "apply", "-"], cwd=repo, input=patch, text=True, check=True)
    assert (repo / path).read_text() == new


def test_eval_options_reach_the_functions_env(tmp_path: Path) -> None:
    """`burstrl eval --env functions --env-option KEY=VALUE` fills the env's own options (validated by it)."""
    from typer.testing import CliRunner

    from burstrl.cli import app

    ok = CliRunner().invoke(app, ["eval", "--model", str(tmp_path), "--env", "functions", "--env-option",
                                  "n_tasks=50", "--dry-run"])
    assert ok.exit_code == 0 and "[options]" in ok.output and "n_tasks = 50" in ok.output, ok.output
