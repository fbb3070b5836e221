"""The toy task generator: determinism, splits, computed target tests, bug kinds, demonstrations,
and the history-free base export (real git repos, real unittest runs)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # ~15 s: every task is made by real git commits and unittest runs

from burstrl.envs.swe.repo import BASE_TAG, apply_patch, export_base, git
from burstrl.envs.swe.task import SweTask, load_tasks
from burstrl.envs.swe.toybugs import KINDS
from burstrl.envs.swe.toygen import demonstration_commands, make_task, make_toy_tasks
from burstrl.envs.swe.toytemplates import HELDOUT, TRAIN, WORDS

# (split, difficulty, n): a batch over every level and both splits, made once for the module.
BATCH = [("train", 1, 2), ("test", 1, 1), ("train", 2, 1), ("test", 3, 1), ("train", 4, 2), ("test", 4, 2)]


@pytest.fixture(scope="module")
def batch(tmp_path_factory: pytest.TempPathFactory) -> list[SweTask]:
    out = tmp_path_factory.mktemp("toy")
    tasks = []
    for split, difficulty, n in BATCH:
        tasks += make_toy_tasks(out / f"{split}{difficulty}", n, seed=3, difficulty=difficulty, split=split)
    return tasks


def _bash(cmd: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", cmd], cwd=cwd, capture_output=True, text=True, timeout=60)


def test_same_inputs_give_the_same_task(tmp_path: Path) -> None:
    a = make_task(tmp_path / "a", 1, seed=5, difficulty=2, split="test").to_json()
    b = make_task(tmp_path / "b", 1, seed=5, difficulty=2, split="test").to_json()
    assert a.pop("repo") != b.pop("repo")
    assert a == b  # commit ids included: fixed author, committer and dates


def test_splits_share_no_templates_or_words(batch: list[SweTask]) -> None:
    assert not {t.key for t in TRAIN} & {t.key for t in HELDOUT}
    for kind in ("verbs", "nouns", "vars"):
        assert not set(WORDS["train"][kind]) & set(WORDS["test"][kind])
    train_words = set(WORDS["train"]["nouns"])
    for task in batch:
        if task.extra["split"] == "test":
            assert not any(w in task.patch for w in train_words)
    assert len({t.problem_statement for t in batch}) == len(batch)


def test_every_task_has_targets_and_the_levels_hold(batch: list[SweTask]) -> None:
    for task in batch:
        assert task.FAIL_TO_PASS and task.PASS_TO_PASS
        assert not set(task.FAIL_TO_PASS) & set(task.PASS_TO_PASS)
        assert all(t.startswith("tests.test_") and t.count(".") == 3 for t in task.FAIL_TO_PASS)
        assert len(task.extra["bugs"]) == task.extra["n_bugs"]
        assert task.test_cmd == "python3 -m unittest -v" and task.test_patch == ""
        if task.extra["depth"] > 1:  # the bug is in a private helper, the failing test names a wrapper
            assert all(b["function"].startswith("_") for b in task.extra["bugs"])
            assert all(b["function"].lstrip("_") not in t for b in task.extra["bugs"] for t in task.FAIL_TO_PASS)


def test_all_bug_kinds_appear(batch: list[SweTask]) -> None:
    seen = {b["kind"] for t in batch for b in t.extra["bugs"]}
    assert seen == set(KINDS)


def test_problem_statement_names_the_symptom_not_the_fix(batch: list[SweTask]) -> None:
    for task in batch:
        assert "should return" in task.problem_statement
        for edit in task.extra["fix"]:
            added = set(edit["after"].splitlines()) - set(edit["before"].splitlines())
            assert not any(line.strip() in task.problem_statement for line in added)


def test_demonstrations_fix_an_exported_base(batch: list[SweTask], tmp_path: Path) -> None:
    for task in batch[::2]:
        repo = tmp_path / task.instance_id
        base = export_base(task, repo)
        for cmd in demonstration_commands(task):
            proc = _bash(cmd, repo)
            assert proc.returncode == 0 or cmd.startswith("grep"), (cmd, proc.stderr)
        proc = _bash(f"{task.test_cmd} {' '.join(task.FAIL_TO_PASS + task.PASS_TO_PASS)}", repo)
        assert proc.returncode == 0, proc.stderr
        assert git(repo, "rev-list", "--count", "HEAD").decode().strip() == "2"
        assert git(repo, "diff", base, "HEAD").decode()  # the fix is committed, not just written


def test_base_export_is_one_commit_without_the_fix(batch: list[SweTask], tmp_path: Path) -> None:
    task = batch[-1]
    base = export_base(task, tmp_path / "x")
    repo = tmp_path / "x"
    assert git(repo, "rev-list", "--all", "--count").decode().strip() == "1"
    assert git(repo, "rev-parse", BASE_TAG).decode().strip() == base
    history = git(repo, "log", "-p", "--all").decode()
    objects = git(repo, "cat-file", "--batch-all-objects", "--batch").decode(errors="replace")
    for edit in task.extra["fix"]:
        base_text = (repo / edit["file"]).read_text()
        assert edit["before"] in base_text
        if edit["after"] not in base_text:  # a fixed line may also occur elsewhere in the file
            assert edit["after"] not in history and edit["after"] not in objects
        fixed_blob = git(task.repo, "rev-parse", f"{task.extra['fix_commit']}:{edit['file']}").decode().strip()
        assert subprocess.run(["git", "-C", str(repo), "cat-file", "-e", fixed_blob]).returncode != 0
    assert subprocess.run(["git", "-C", str(repo), "cat-file", "-e", task.extra["fix_commit"]]).returncode != 0
    # The same base exports to the same commit, and so does a bundle of the task's repository.
    bundle = tmp_path / "repo.bundle"
    git(task.repo, "bundle", "create", str(bundle), "--all")
    from_bundle = SweTask.from_json({**task.to_json(), "repo": str(bundle)})
    assert export_base(from_bundle, tmp_path / "y") == base


def test_apply_patch_gold_then_twice_then_garbage(batch: list[SweTask], tmp_path: Path) -> None:
    task = batch[0]
    export_base(task, tmp_path / "r")
    assert apply_patch(tmp_path / "r", task.patch) == (True, "applied")
    ok, message = apply_patch(tmp_path / "r", task.patch)  # already applied: the hunks do not match
    assert not ok and "patch does not apply" in message
    assert not apply_patch(tmp_path / "r", "not a patch\n")[0]
    assert apply_patch(tmp_path / "r", "") == (True, "empty patch")


def test_task_file_round_trips(tmp_path: Path) -> None:
    tasks = make_toy_tasks(tmp_path, 2, seed=9)
    assert [t.to_json() for t in load_tasks(tmp_path / "tasks.jsonl")] == [t.to_json() for t in tasks]
    assert sorted(p.name for p in (tmp_path / "repos").iterdir()) == [t.instance_id for t in tasks]


def test_difficulty_0_states_the_fix_and_one_command_submits_it(tmp_path: Path) -> None:
    """Level 0 (a curriculum's start): the statement names the line, file and fragments, and the
    demonstration's single command, a sed copied from them, fixes, commits and prints the sentinel."""
    import re

    from burstrl.envs.swe.agent import SUBMIT_SENTINEL
    from burstrl.envs.swe.demos import demonstration_chat

    task = make_task(tmp_path / "gen", 0, seed=3, difficulty=0, split="test")
    edit = task.extra["line_edit"]
    line = next(x for x in task.problem_statement.splitlines() if x.startswith("The fix: "))
    m = re.fullmatch(r"The fix: on line (\d+) of (\S+), replace `(.+)` with `(.+)`\.", line)
    assert m and m.groups() == (str(edit["line"]), edit["file"], edit["before"], edit["after"])
    [cmd] = demonstration_commands(task)
    assert cmd.startswith(f"sed -i '{edit['line']}s/{edit['before']}/{edit['after']}/' {edit['file']} && ")
    repo = tmp_path / "repo"
    export_base(task, repo)
    proc = _bash(cmd, repo)
    assert proc.stdout.splitlines()[0] == SUBMIT_SENTINEL, proc.stderr
    assert _bash(f"{task.test_cmd} {' '.join(task.FAIL_TO_PASS + task.PASS_TO_PASS)}", repo).returncode == 0
    chat = demonstration_chat(task)
    assert [m["role"] for m in chat] == ["system", "user", "assistant", "user"]  # no second submit turn


def test_line_edit_finds_a_unique_sed_safe_fragment() -> None:
    """The stated fragment is whole words, widened until it occurs once in the line; sed-unsafe
    characters or a change over several lines give no level-0 edit."""
    from burstrl.envs.swe.toygen import line_edit

    buggy = "def f(a, b):\n    if a < b and b < 9:\n        return a\n"
    fixed = "def f(a, b):\n    if a <= b and b < 9:\n        return a\n"
    assert line_edit(buggy, fixed) == {"line": 2, "before": "a < b", "after": "a <= b"}
    assert line_edit("x = y + 1\n", "x = y - 1\n") == {"line": 1, "before": "+", "after": "-"}
    assert line_edit("x = s.a + 1\n", "x = s.a - 1\n") == {"line": 1, "before": "+", "after": "-"}
    assert line_edit("x = s.a\n", "x = s.b\n") is None  # '.' is a regex character
    assert line_edit("a\nb\n", "c\nd\n") is None
    assert line_edit("a\n", "a\nb\n") is None
