"""`burstrl eval` on real toy tasks with a real replica and sandboxes: records, summary, comparison."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")]


def burstrl(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", "from burstrl.cli import main; main()", *args],
                          capture_output=True, text=True, timeout=600)


def test_eval_writes_records_summary_and_a_paired_comparison(tmp_path: Path, tiny_model_dir: Path) -> None:
    r = burstrl("tasks", "make-toy", str(tmp_path / "tasks"), "--n", "2", "--split", "test")
    assert r.returncode == 0, r.stderr
    tasks = tmp_path / "tasks" / "tasks.jsonl"
    (tmp_path / "flawed.txt").write_text(json.loads(tasks.read_text().splitlines()[0])["instance_id"] + "\n")
    first = burstrl("eval", "--model", str(tiny_model_dir), "--tasks", str(tasks), "--attempts", "2",
                    "--max-turns", "2", "--out", str(tmp_path / "a"))
    assert first.returncode == 0, first.stderr[-3000:]
    results = json.loads((tmp_path / "a" / "results.json").read_text())
    assert len(results["records"]) == 4 and results["summary"]["overall"]["n_tasks"] == 2
    assert {"pass@1", "pass@2", "f2p", "strict"} <= set(results["summary"]["overall"])
    second = burstrl("eval", "--model", str(tiny_model_dir), "--tasks", str(tasks), "--attempts", "2",
                     "--max-turns", "2", "--out", str(tmp_path / "b"), "--compare", str(tmp_path / "a"),
                     "--exclude", str(tmp_path / "flawed.txt"))
    assert second.returncode == 0, second.stderr[-3000:]
    b = json.loads((tmp_path / "b" / "results.json").read_text())
    assert b["summary"]["overall"]["n_tasks"] == 1 and b["summary"]["overall_all"]["n_tasks"] == 2
    assert "pass@1" in b["comparison"] and "ci" in b["comparison"]["pass@1"]
    assert "pass@1" in (tmp_path / "b" / "report.md").read_text()


def test_eval_refuses_a_missing_task_file(tmp_path: Path, tiny_model_dir: Path) -> None:
    r = burstrl("eval", "--model", str(tiny_model_dir), "--tasks", str(tmp_path / "none.jsonl"))
    assert r.returncode == 2 and "no such task file" in r.stderr
