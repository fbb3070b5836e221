"""The forgetful SWE warm start: demonstrations whose only flaw is a left-out commit, and its cache.

Why it matters: this variant exists so that RL has a sampled flaw to fix (envs/swe/warm.py); if a
forgetful demonstration committed anyway, or fixed nothing, the benchmark built on it would measure
something else.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import types
from pathlib import Path

import pytest

from burstrl.envs.swe import warm
from burstrl.envs.swe.agent import SUBMIT_COMMAND, SUBMIT_SENTINEL
from burstrl.envs.swe.repo import export_base, git
from burstrl.envs.swe.toygen import located_fix_command, make_task


def _bash(cmd: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", cmd], cwd=cwd, capture_output=True, text=True, timeout=60)


@pytest.mark.slow
def test_forgetful_command_fixes_the_tree_but_commits_nothing(tmp_path: Path) -> None:
    task = make_task(tmp_path / "gen", 0, seed=3, difficulty=0, split="train")
    command = located_fix_command(task, commit=False)
    assert command == located_fix_command(task).replace(" && git commit -qam fix", "")
    assert command.endswith(f"&& {SUBMIT_COMMAND}") and "commit" not in command
    repo = tmp_path / "repo"
    base = export_base(task, repo)
    assert _bash(command, repo).stdout.splitlines()[0] == SUBMIT_SENTINEL
    tests = f"{task.test_cmd} {' '.join(task.FAIL_TO_PASS + task.PASS_TO_PASS)}"
    assert _bash(tests, repo).returncode == 0  # the working tree is fixed...
    assert git(repo, "diff", base, "HEAD") == b""  # ...but the graded (committed) diff is empty
    assert git(repo, "diff") != b""


@pytest.mark.slow
def test_forgetful_demos_mix_both_habits_by_a_seeded_draw(tmp_path: Path) -> None:
    path = warm.forgetful_demos(tmp_path, seed=3, n=6, no_commit_share=0.5, choice_seed=0)
    chats = [json.loads(line)["messages"] for line in path.read_text().splitlines()]
    commands = [c[2]["content"] for c in chats]
    forgot = ["git commit" not in c for c in commands]
    assert len(chats) == 6 and 0 < sum(forgot) < 6
    assert all(c.startswith("```bash\nsed -i ") and c.endswith(f"{SUBMIT_COMMAND}\n```") for c in commands)
    assert all(c[3]["role"] == "user" and SUBMIT_SENTINEL in c[3]["content"] for c in chats)  # really run
    draw = random.Random(0)
    assert forgot == [draw.random() < 0.5 for _ in range(6)]  # the recipe's draw, reproducible


def test_forgetful_model_is_built_once_per_recipe_on_top_of_the_warm_start(tmp_path: Path, monkeypatch) -> None:
    warm_dir = tmp_path / "warm"
    warm_dir.mkdir()
    (warm_dir / warm.MARKER).write_text(json.dumps({"recipe": {"version": 2}}))
    calls = []

    def fake_sft(model_dir, data, out_dir, **kw) -> Path:  # the expensive step, made fast
        calls.append((Path(model_dir), kw["steps"]))
        Path(out_dir).mkdir(exist_ok=True)
        (Path(out_dir) / "model.safetensors").write_bytes(b"w")
        return Path(out_dir)

    monkeypatch.setitem(sys.modules, "burstrl.trainer.sft", types.SimpleNamespace(sft=fake_sft))
    monkeypatch.setattr(warm, "forgetful_demos", lambda tmp, *a: tmp / "demos.jsonl")
    out = tmp_path / "cache" / "forgetful"
    assert warm.ensure_swe_forgetful_model(warm_dir, out) == out
    assert warm.ensure_swe_forgetful_model(warm_dir, out) == out
    assert calls == [(warm_dir, warm.FORGETFUL["steps"])]  # cached the second time
    marker = json.loads((out / warm.FORGETFUL_MARKER).read_text())["recipe"]
    assert marker["warm"] == {"version": 2} and marker["no_commit_share"] == 0.5
    (warm_dir / warm.MARKER).write_text(json.dumps({"recipe": {"version": 3}}))  # a new warm start: rebuilt
    warm.ensure_swe_forgetful_model(warm_dir, out)
    assert len(calls) == 2 and sorted(p.name for p in out.parent.iterdir()) == ["forgetful"]
