"""`tasks check` on generated toy tasks (they hold) and on deliberately flawed ones (flagged),
in real sandboxes and on the host, and through the CLI."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from burstrl.cli import app
from burstrl.envs.swe.check import check_tasks
from burstrl.envs.swe.task import SweTask, dump_tasks
from burstrl.envs.swe.toygen import make_toy_tasks

needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None,
                                 reason="bubblewrap (bwrap) is not installed: `make system-deps` as root")


@pytest.fixture(scope="module")
def tasks(tmp_path_factory: pytest.TempPathFactory) -> list[SweTask]:
    out = tmp_path_factory.mktemp("toy")
    return (make_toy_tasks(out / "a", 1, seed=1, difficulty=1, split="train")
            + make_toy_tasks(out / "b", 1, seed=1, difficulty=3, split="test"))


def _flawed(task: SweTask) -> list[SweTask]:
    """Ways a task goes wrong: a target test that already passes, a gold patch that does not fix
    (a new notes file, which the task's own diff policy allows), a gold patch the default diff
    policy refuses (that file, not allowed), a gold patch that does not apply, no repository."""
    readme_only = ("diff --git a/NOTES.md b/NOTES.md\nnew file mode 100644\n--- /dev/null\n+++ b/NOTES.md\n"
                   "@@ -0,0 +1 @@\n+nothing fixed here\n")
    allowed = {**task.extra, "diff_policy": {"allow": ["NOTES.md"]}}
    return [
        dataclasses.replace(task, instance_id="passes-at-base", FAIL_TO_PASS=task.FAIL_TO_PASS + task.PASS_TO_PASS[:1]),
        dataclasses.replace(task, instance_id="no-fix", patch=readme_only, extra=allowed),
        dataclasses.replace(task, instance_id="refused", patch=readme_only),
        dataclasses.replace(task, instance_id="garbage", patch="not a patch\n"),
        dataclasses.replace(task, instance_id="no-repo", repo=str(Path(task.repo).parent / "missing")),
    ]


def _assert_flagged(results) -> None:
    by_id = {r.instance_id: r for r in results}
    assert not any(r.ok for r in results)
    assert any("passes at the base" in p for p in by_id["passes-at-base"].problems)
    assert any("with the gold patch" in p for p in by_id["no-fix"].problems)
    assert any("refused by the diff policy (diff policy outside_source: NOTES.md" in p
               for p in by_id["refused"].problems), by_id["refused"].problems
    assert any("does not apply" in p for p in by_id["garbage"].problems)
    assert any("export" in p for p in by_id["no-repo"].problems)


@needs_bwrap
def test_generated_tasks_hold_in_sandboxes(tasks: list[SweTask], tmp_path: Path) -> None:
    results = check_tasks(tasks, tmp_path)
    assert [r.problems for r in results] == [[], []]
    for task, r in zip(tasks, results, strict=False):
        assert all(r.at_base[t] != "passed" and r.at_gold[t] == "passed" for t in task.FAIL_TO_PASS)


@needs_bwrap
def test_flawed_tasks_are_flagged_in_sandboxes(tasks: list[SweTask], tmp_path: Path) -> None:
    _assert_flagged(check_tasks(_flawed(tasks[0]), tmp_path))


def test_host_mode_agrees(tasks: list[SweTask], tmp_path: Path) -> None:
    results = check_tasks(tasks + _flawed(tasks[1]), tmp_path, sandbox=False)
    assert results[0].ok and results[1].ok
    _assert_flagged(results[2:])


def test_cli_check_exits_1_on_a_flawed_task(tasks: list[SweTask], tmp_path: Path) -> None:
    good, bad = tmp_path / "good.jsonl", tmp_path / "bad.jsonl"
    dump_tasks(tasks[:1], good)
    dump_tasks(tasks[:1] + _flawed(tasks[0])[1:2], bad)
    runner = CliRunner()
    res = runner.invoke(app, ["tasks", "check", str(good), "--host"])
    assert res.exit_code == 0, res.output
    assert "1 ok, 0 flawed" in res.output
    res = runner.invoke(app, ["tasks", "check", str(bad), "--host", "--flawed-out", str(tmp_path / "flawed.txt")])
    assert res.exit_code == 1 and "FLAWED" in res.output
    assert (tmp_path / "flawed.txt").read_text() == "no-fix\n"


def test_cli_make_toy(tmp_path: Path) -> None:
    res = CliRunner().invoke(app, ["tasks", "make-toy", str(tmp_path / "t"), "--n", "1", "--split", "test"])
    assert res.exit_code == 0, res.output
    assert (tmp_path / "t" / "tasks.jsonl").exists()
    res = CliRunner().invoke(app, ["tasks", "make-toy", str(tmp_path / "t"), "--n", "1"])
    assert res.exit_code == 2 and "not empty" in res.output


def test_a_missing_runner_is_one_problem_with_its_own_error(tasks: list[SweTask], tmp_path: Path) -> None:
    """Issue 16: not one "not run" line per test id, but the runner's error, once (host and sandbox)."""
    task = dataclasses.replace(tasks[0], instance_id="no-runner", test_cmd="python3 -m no_such_runner -v")
    modes = [False] + ([True] if shutil.which("bwrap") else [])
    for sandbox in modes:
        [r] = check_tasks([task], tmp_path / str(sandbox), sandbox=sandbox)
        assert not r.ok and len(r.problems) == 1, r.problems
        assert "No module named no_such_runner" in r.problems[0] and "without any patch" in r.problems[0]
