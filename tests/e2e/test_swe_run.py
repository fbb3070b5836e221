"""`burstrl run examples/toy-swe.toml` end to end at test size: agents in sandboxes, graded, trained on.

The random tiny model cannot fix anything (its rewards are all 0, so the trainer skips its
updates); what this checks is the pipeline: toy tasks generated, every attempt run by the agent
in a sandbox through the router (captured turns stored), graded, stored exactly once, and the
steps committed.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from burstrl.store import RolloutStore

from .conftest import REPO, audit, burstrl_cmd

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")]


def test_toy_swe_config_runs_through_sandboxes_and_grading(tmp_path: Path, tiny_model_dir: Path) -> None:
    import subprocess

    run_dir = tmp_path / "swe"
    cmd = burstrl_cmd("run", str(REPO / "examples" / "toy-swe.toml"), "--run_dir", str(run_dir), "--model.path",
                      str(tiny_model_dir), "--trainer.steps", "2", "--trainer.batch_groups", "2",
                      "--orchestrator.group_size", "2", "--orchestrator.swe.toy_tasks", "3",
                      "--orchestrator.swe.max_turns", "2", "--fleet.on_demand", "0")
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert len((run_dir / "swe-tasks" / "tasks.jsonl").read_text().splitlines()) == 3  # difficulty 0 only
    audit(run_dir, 2, batch_groups=2, group_size=2)
    with RolloutStore(run_dir / "store.sqlite") as store:
        groups = store.groups()
    rollouts = [r for g in groups for r in g.rollouts]
    assert rollouts and all(g.task_id.startswith("toy-train-") for g in groups)
    for r in rollouts:
        assert 1 <= len(r.turns) <= 2  # one captured call per agent turn
        assert set(r.reward_parts) >= {"resolved", "f2p", "strict", "apply_ok", "submitted"}

    # every checkpoint of the run evaluated into one curve
    tasks = tmp_path / "one.jsonl"
    tasks.write_text((run_dir / "swe-tasks" / "tasks.jsonl").read_text().splitlines()[0] + "\n")
    r = subprocess.run(burstrl_cmd("eval", "--model", str(tiny_model_dir), "--tasks", str(tasks), "--attempts", "1",
                                   "--max-turns", "1", "--run", str(run_dir), "--every", "1", "--out",
                                   str(tmp_path / "curve")), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    curve = json.loads((tmp_path / "curve" / "results.json").read_text())["curve"]
    assert [point["step"] for point in curve] == [1, 2]
