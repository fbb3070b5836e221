import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from burstrl.cli import app
from burstrl.eval.report import load_run, read_jsonl, summary, write_report

T0 = 1000.0
STEP_S = [2.0, 2.0, 2.5, 2.0, 8.0, 3.0, 2.0, 2.0]  # step 5 spans the kill at T0 + 10
REWARDS = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8]
STALENESS = [0.0, 0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 0.5]
KILL_T = T0 + 10.0
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def write_jsonl(path: Path, rows: list[dict], torn: str | None = None) -> None:
    text = "".join(json.dumps(row) + "\n" for row in rows)
    path.write_text(text + (torn or ""))


def metrics_rows() -> list[dict]:
    rows, t = [], T0
    for i, step_s in enumerate(STEP_S):
        t += step_s
        rows.append({
            "step": i + 1, "time": t, "reward_mean": REWARDS[i], "reward_std": 0.2,
            "staleness_mean": STALENESS[i], "staleness_max": 2, "wait_s": 0.3,
            "compute_s": 1.5, "checkpoint_s": 0.1, "publish_s": 0.1, "step_s": step_s,
            "loss": 0.01, "kept_groups": 3, "groups": 4, "tokens": 2048,
        })
    del rows[0]["time"]  # an older line without a time
    return rows


def orchestrator_rows() -> list[dict]:
    return [
        {"t": T0 + 0.5 + s, "groups_started": s, "groups_done": s, "groups_in_flight": 2,
         "rollouts_done": 8 * s, "rollouts_per_s": 8.0 if s < 10 or s > 14 else 3.0,
         "pass_rate": 0.3, "reward_mean": 0.1 + 0.03 * s, "attempts_requeued": 0 if s < 10 else 3,
         "attempts_failed": 0, "tasks_requeued": 0, "difficulty": {"toy": 1}, "version": s // 3}
        for s in range(24)
    ]


def fleet_rows() -> list[dict]:
    samples = [
        {"t": T0 + s, "kind": "sample", "step": s // 3, "buffered": 4,
         "replicas": {"reserved": 1, "on_demand": 2 if s < 10 or s >= 15 else 1},
         "routable": 3 if s < 10 or s >= 15 else 2, "cache_hit_rate": 0.6, "sessions": 5}
        for s in range(24)
    ]
    events = [
        {"t": T0, "kind": "event", "event": "run_started", "detail": "8 steps"},
        {"t": T0 + 1, "kind": "event", "event": "replica_started", "replica": "od-1", "pool": "on_demand",
         "detail": "port 8101"},
        {"t": KILL_T, "kind": "event", "event": "replica_killed", "replica": "od-1", "pool": "on_demand",
         "detail": "chaos: SIGKILL"},
        {"t": T0 + 15, "kind": "event", "event": "replica_started", "replica": "od-2", "pool": "on_demand",
         "detail": "replacement"},
    ]
    return sorted(samples + events, key=lambda r: r["t"])


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    write_jsonl(run / "metrics.jsonl", metrics_rows(), torn='{"step": 9, "time": 1030.0, "rew')
    write_jsonl(run / "orchestrator.jsonl", orchestrator_rows(), torn='{"t": 1099.0, "rollo')
    write_jsonl(run / "fleet.jsonl", fleet_rows(), torn='{"t": 1099.0, "kind": "sam')
    return run


def test_read_jsonl_tolerates_missing_file_and_torn_last_line(tmp_path):
    assert read_jsonl(tmp_path / "missing.jsonl") == []
    path = tmp_path / "x.jsonl"
    path.write_text('{"a": 1}\n\n{"a": 2}\n{"a": ')
    assert read_jsonl(path) == [{"a": 1}, {"a": 2}]


def test_read_jsonl_reports_a_corrupt_middle_line(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_text('{"a": 1}\n{"a": \n{"a": 2}\n')
    with pytest.raises(ValueError, match="x.jsonl:2"):
        read_jsonl(path)


def test_load_run_splits_fleet_samples_and_events(run_dir):
    run = load_run(run_dir)
    assert len(run.metrics) == len(STEP_S)
    assert len(run.orchestrator) == 24
    assert len(run.samples) == 24 and len(run.events) == 4
    assert run.t0 == T0


def test_summary_figures(run_dir):
    figures = summary(run_dir)
    assert figures["steps"] == 8
    assert figures["reward_first"] == pytest.approx(0.1)
    assert figures["reward_last5"] == pytest.approx((0.4 + 0.5 + 0.6 + 0.7 + 0.8) / 5)
    assert figures["staleness_mean"] == pytest.approx(6.0 / 8)
    assert figures["utilisation"] == pytest.approx(8 * 1.5 / sum(STEP_S))
    assert figures["rollouts_done"] == 8 * 23
    assert figures["attempts_requeued"] == 3
    assert figures["duration_s"] == pytest.approx(23.5)  # last metrics line ends at T0 + 23.5
    kill = [e for e in figures["replica_events"] if e["event"] == "replica_killed"]
    assert kill == [{"t_s": 10.0, "event": "replica_killed", "replica": "od-1", "pool": "on_demand",
                     "detail": "chaos: SIGKILL"}]
    # Step 5 (ends at T0 + 16.5, 8 s) spans the kill; its neighbours are steps 3, 4, 6, 7:
    # 2.5, 2.0, 3.0, 2.0 -> median 2.25.
    assert figures["outage_steps"] == [5]
    assert figures["outage_ratio"] == pytest.approx(8.0 / 2.25)


def test_summary_without_a_kill_has_no_outage_ratio(run_dir):
    rows = [r for r in fleet_rows() if r.get("event") != "replica_killed"]
    write_jsonl(run_dir / "fleet.jsonl", rows)
    assert summary(run_dir)["outage_ratio"] is None


def test_write_report_writes_png_and_markdown(run_dir):
    png, md = write_report(run_dir)
    assert png == run_dir / "report" / "dashboard.png"
    assert md == run_dir / "report" / "summary.md"
    data = png.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 10_000
    text = md.read_text()
    for needle in (str(run_dir), "| steps | 8 |", "0.600", "0.100", "0.75", "0.51", "3.56", "| 184 |",
                   "| 3 |", "replica_killed", "od-1", "chaos: SIGKILL", "![dashboard](dashboard.png)"):
        assert needle in text, needle


def test_write_report_early_run_with_empty_files(tmp_path):
    run = tmp_path / "early"
    run.mkdir()
    (run / "metrics.jsonl").write_text("")
    (run / "fleet.jsonl").write_text('{"t": 5.0, "kind": "event", "event": "run_started", "detail": ""}\n{"t"')
    png, md = write_report(run, tmp_path / "out")
    assert png.read_bytes().startswith(PNG_MAGIC)
    assert "| steps | 0 |" in md.read_text()


def test_load_run_rejects_missing_or_empty_dirs(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_run(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="none of"):
        load_run(tmp_path)


def test_cli_report(run_dir, tmp_path):
    out = tmp_path / "elsewhere"
    result = CliRunner().invoke(app, ["report", str(run_dir), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert result.stdout.split() == [str(out / "dashboard.png"), str(out / "summary.md")]
    assert (out / "dashboard.png").stat().st_size > 0


def test_cli_report_errors_exit_2(tmp_path):
    runner = CliRunner()
    for target in (tmp_path / "missing", tmp_path):
        result = runner.invoke(app, ["report", str(target)])
        assert result.exit_code == 2
        assert result.stderr.startswith("error: ") and len(result.stderr.strip().splitlines()) == 1
        assert "Traceback" not in result.output
