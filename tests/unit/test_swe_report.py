import json

import pytest

from burstrl.eval.passk import AttemptRecord
from burstrl.eval.swe_report import load_records, load_results, make_results, write_eval_report

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
TASKS = [f"toy-{i}" for i in range(12)]


def records(resolved_per_task: int, attempts: int = 4) -> list[AttemptRecord]:
    rows = []
    for t in TASKS:
        for j in range(attempts):
            ok = j < resolved_per_task
            rows.append(AttemptRecord(task_id=t, attempt=j, resolved=ok, f2p=1.0 if ok else 0.25,
                                      strict=1.0 if ok else 0.0, reward=float(ok),
                                      log_path=f"logs/{t}/{j}.log", duration_s=2.0))
    rows.append(AttemptRecord(task_id="toy-0", attempt=4, infra_error="sandbox died"))
    return rows


def test_write_eval_report_single_run(tmp_path):
    results = make_results(records(1), config={"model": "tiny", "attempts": 4})
    json_path, md_path, png_path = write_eval_report(results, tmp_path / "out")
    assert png_path.read_bytes().startswith(PNG_MAGIC)
    data = json.loads(json_path.read_text())
    assert len(data["records"]) == 4 * len(TASKS) + 1
    assert data["config"]["model"] == "tiny"
    md = md_path.read_text()
    assert "| pass@1 | 0.250 |" in md
    assert "| pass@4 | 1.000 |" in md
    assert "| infra_failures | 1 |" in md
    assert "toy-11" in md and "## Comparison" not in md
    assert "![evaluation](report.png)" in md


def test_write_eval_report_with_exclude_comparison_and_curve(tmp_path):
    baseline = make_results(records(1), config={"model": "base"})
    write_eval_report(baseline, tmp_path / "base")
    loaded = load_results(tmp_path / "base")
    assert len(load_records(tmp_path / "base" / "results.json")) == 4 * len(TASKS) + 1

    curve = [{"step": 0, "pass@1": 0.25, "f2p": 0.44, "strict": 0.25},
             {"step": 10, "pass@1": 0.75, "f2p": 0.81, "strict": 0.75}]
    results = make_results(records(3), config={"model": "trained"}, exclude={"toy-0"},
                           baseline=loaded, baseline_label="base model", curve=curve)
    json_path, md_path, png_path = write_eval_report(results, tmp_path / "after")
    assert png_path.read_bytes().startswith(PNG_MAGIC)
    md = md_path.read_text()
    assert "| metric | without excluded | all tasks |" in md
    assert "| n_tasks | 11 | 12 |" in md
    assert "toy-0 (excluded)" in md
    assert "B = base model" in md
    assert "| pass@1 | 0.750 | 0.250 | +0.500 | 95% [+0.500, +0.500] | 0.000 | 11 |" in md
    assert "| 10 | 0.750 | 0.810 | 0.750 |" in md
    comparison = json.loads(json_path.read_text())["comparison"]
    assert comparison["pass@1"]["diff"] == pytest.approx(0.5)


def test_write_eval_report_computes_missing_summary(tmp_path):
    _, md_path, _ = write_eval_report({"records": records(2)}, tmp_path)
    assert "| pass@1 | 0.500 |" in md_path.read_text()


def test_load_results_rejects_other_json(tmp_path):
    path = tmp_path / "x.json"
    path.write_text('{"steps": 3}')
    with pytest.raises(ValueError):
        load_results(path)
