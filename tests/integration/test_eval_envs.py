"""`burstrl eval --env` on the toy environments with a real replica: records, summary, comparison."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def burstrl(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", "from burstrl.cli import main; main()", *args],
                          check=False, capture_output=True, text=True, timeout=300)


def eval_env(model: Path, env: str, out: Path, *extra: str) -> dict:
    r = burstrl("eval", "--model", str(model), "--env", env, "--n", "3", "--attempts", "2", "--out", str(out), *extra)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.splitlines()[-3:] == [str(out / name) for name in ("results.json", "report.md", "report.png")]
    saved = burstrl("eval", str(out / "eval_config.toml"), "--dry-run")  # the resolved config reruns as is
    assert saved.returncode == 0 and f'env = "{env}"' in saved.stdout and "attempts = 2" in saved.stdout, saved.stderr
    return json.loads((out / "results.json").read_text())


def check_results(results: dict, env: str, prefix: str) -> None:
    assert results["config"]["env"] == env and results["config"]["split"] == "test"
    records = results["records"]
    assert len(records) == 6 and {r["attempt"] for r in records} == {0, 1}
    assert all(r["task_id"].startswith(prefix) and r["version"] == "base" and r["infra_error"] is None
               and set(r["parts"]) >= {"exact"} and "f2p" not in r for r in records)
    assert all(r["resolved"] == (r["parts"]["exact"] == 1.0) for r in records)
    overall = results["summary"]["overall"]
    assert overall["n_tasks"] == 3 and overall["attempts"] == 6
    assert {"pass@1", "pass@2", "reward"} <= set(overall) and overall["f2p"] is None and "exact" in overall["parts"]


@pytest.fixture(scope="module")
def toy_eval(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("eval-toy") / "a"
    eval_env(tiny_model_dir, "toy", out)
    return out


def test_eval_toy_writes_records_and_report(toy_eval: Path) -> None:
    check_results(json.loads((toy_eval / "results.json").read_text()), "toy", "toy-test-")
    md = (toy_eval / "report.md").read_text()
    assert md.startswith("# Evaluation report: toy") and "| pass@1 |" in md and "| part: exact |" in md
    assert "f2p" not in md and (toy_eval / "report.png").stat().st_size > 0


def test_eval_toy_compare_gives_a_paired_interval(toy_eval: Path, tiny_model_dir: Path) -> None:
    b = eval_env(tiny_model_dir, "toy", toy_eval.parent / "b", "--seed", "1", "--compare", str(toy_eval))
    comparison = b["comparison"]
    assert set(comparison) >= {"pass@1", "reward", "pass@2"} and "f2p" not in comparison
    assert comparison["pass@1"]["n_tasks"] == 3 and len(comparison["pass@1"]["ci"]) == 2
    assert "## Comparison" in (toy_eval.parent / "b" / "report.md").read_text()


def test_eval_toy_multi(tiny_model_dir: Path, tmp_path: Path) -> None:
    results = eval_env(tiny_model_dir, "toy_multi", tmp_path / "m", "--difficulty", "2")
    check_results(results, "toy_multi", "toymt-test-d2-")
    assert "# Evaluation report: toy_multi" in (tmp_path / "m" / "report.md").read_text()


def test_eval_toy_curve_over_a_runs_checkpoints(tiny_model_dir: Path, adapters: dict[str, Path],
                                                tmp_path: Path) -> None:
    for step, name in ((5, "policy-v1"), (10, "policy-v2")):
        (tmp_path / "run" / "checkpoints" / f"step-{step}").mkdir(parents=True)
        (tmp_path / "run" / "checkpoints" / f"step-{step}" / "adapter").symlink_to(adapters[name])
    results = eval_env(tiny_model_dir, "toy", tmp_path / "c", "--run", str(tmp_path / "run"), "--every", "5")
    assert [p["step"] for p in results["curve"]] == [5, 10] and results["config"]["version"] == "step-10"
    assert all(p["pass@1"] is not None and p["reward"] is not None and p["f2p"] is None for p in results["curve"])
    md = (tmp_path / "c" / "report.md").read_text()
    assert "## Checkpoints" in md and "| step | pass@1 | reward |" in md
