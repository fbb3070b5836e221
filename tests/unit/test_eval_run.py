"""`burstrl eval` for any environment without a replica: tasks, records, summaries, argument errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from burstrl.envs.base import Outcome, Task
from burstrl.eval.compare import compare_results
from burstrl.eval.run import EvalSpec, eval_config, load_eval_tasks, make_record
from burstrl.eval.swe_report import make_results, render_eval_markdown


def test_env_tasks_come_from_the_environment_held_out_by_default(tmp_path: Path) -> None:
    spec = EvalSpec(model=tmp_path, env="toy", n=3, difficulty=2, task_seed=5, out=tmp_path)
    tasks = load_eval_tasks(spec)
    assert [t.id for t in tasks] == [f"toy-test-d2-s5-0000{i}" for i in range(3)]
    assert [t.id for t in tasks] == [t.id for t in load_eval_tasks(spec)]  # the same tasks every time
    multi = load_eval_tasks(EvalSpec(model=tmp_path, env="toy_multi", n=2, out=tmp_path))
    assert [t.env for t in multi] == ["toy_multi"] * 2
    assert eval_config(spec, "base")["env"] == "toy" and eval_config(spec, "base")["split"] == "test"


def test_task_source_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="needs --tasks"):
        load_eval_tasks(EvalSpec(model=tmp_path, env="swe", out=tmp_path))
    with pytest.raises(ValueError, match="makes its own tasks"):
        load_eval_tasks(EvalSpec(model=tmp_path, env="toy", tasks=tmp_path / "t.jsonl", out=tmp_path))
    with pytest.raises(ValueError, match="difficulty"):
        load_eval_tasks(EvalSpec(model=tmp_path, env="toy", difficulty=99, out=tmp_path))


def toy_records(task_ids: list[str], passes: dict[str, int], attempts: int = 2) -> list[dict]:
    out = []
    for tid in task_ids:
        for k in range(attempts):
            ok = k < passes.get(tid, 0)
            outcome = Outcome(reward=1.0 if ok else 0.1, parts={"exact": float(ok), "format": 1.0}, passed=ok,
                              info={"reply": "A"})
            out.append(make_record(Task(id=tid, env="toy", difficulty=1), k, "base", outcome, 0.1, "s"))
    return out


def test_toy_records_summary_and_report_have_no_test_metrics() -> None:
    records = toy_records(["t0", "t1"], {"t0": 2, "t1": 1})
    assert records[0] | {"duration_s": 0} == {"task_id": "t0", "attempt": 0, "version": "base", "resolved": True,
                                              "reward": 1.0, "parts": {"exact": 1.0, "format": 1.0}, "reason": "",
                                              "infra_error": None, "duration_s": 0, "session_id": "s",
                                              "extra": {"reply": "A"}}
    results = make_results(records, config={"env": "toy"})
    overall = results["summary"]["overall"]
    assert overall["pass@1"] == pytest.approx(0.75) and overall["pass@2"] == pytest.approx(1.0)
    assert overall["f2p"] is None and overall["strict"] is None
    assert overall["parts"] == {"exact": pytest.approx(0.75), "format": 1.0}
    md = render_eval_markdown(results, "report.png")
    assert md.startswith("# Evaluation report: toy") and "| part: exact | 0.750 |" in md
    assert "f2p" not in md and "apply" not in md and "| task | n | c | pass@1 | pass@2 | reward |" in md


def test_swe_records_keep_their_test_fields() -> None:
    parts = {"resolved": 1.0, "f2p": 1.0, "strict": 0.0, "apply_ok": 1.0}
    r = make_record(Task(id="x", env="swe", difficulty=1), 0, "base", Outcome(1.0, parts, True, {"reason": ""}), 1, "s")
    assert (r["f2p"], r["strict"], r["apply_ok"], r["resolved"]) == (1.0, 0.0, True, True)
    md = render_eval_markdown(make_results([r]), "report.png")
    assert "| f2p | 1.000 |" in md and "| apply_failures | 0 |" in md


def test_compare_of_toy_evaluations_pairs_pass_and_reward() -> None:
    ids = [f"t{i}" for i in range(4)]
    a = make_results(toy_records(ids, dict.fromkeys(ids, 2)))
    b = make_results(toy_records(ids, {"t0": 1}))
    out = compare_results(a, b, iters=200)
    assert list(out) == ["pass@1", "reward", "pass@2"]
    assert out["pass@1"]["diff"] == pytest.approx((1.0 * 4 - 0.5) / 4) and out["pass@1"]["n_tasks"] == 4


def burstrl(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", "from burstrl.cli import main; main()", *args],
                          check=False, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(("args", "message"), [
    (["--env", "nope"], "unknown environment 'nope'"),
    (["--env", "swe"], "--env swe needs --tasks"),
    (["--env", "toy", "--env-option", "max_turns=2"], "environment 'toy' takes no options"),
    (["--env", "swe", "--tasks", "TASKS", "--env-option", "nonsense"], "expected KEY=VALUE"),
    (["--env", "swe", "--tasks", "TASKS", "--env-option", "reward=bogus"], "config key 'swe.reward'"),
    (["--env", "toy", "--tasks", "TASKS"], "makes its own tasks"),
    (["--env", "toy", "--difficulty", "99"], "difficulty must be in"),
])
def test_eval_argument_errors_exit_2_before_a_replica_starts(tmp_path: Path, args: list[str], message: str) -> None:
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps({}))
    (tmp_path / "tasks.jsonl").write_text("")
    args = [str(tmp_path / "tasks.jsonl") if a == "TASKS" else a for a in args]
    r = burstrl("eval", "--model", str(tmp_path / "model"), "--out", str(tmp_path / "out"), *args)
    assert r.returncode == 2 and message in r.stderr, r.stderr
