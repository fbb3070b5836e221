import io
from pathlib import Path

import pytest
from rich.console import Console

from burstrl.launcher.display import Display, format_duration, new_events, snapshot_eta


def snap(step: int, events: list[str] | None = None, **extra) -> dict:
    base = {
        "step": step, "steps": 20, "reward": 0.41, "pass_rate": 0.22, "staleness": 0.8,
        "replicas": {"reserved": 1, "on_demand": 2}, "routable": 3, "cache_hit_rate": 0.65,
        "rollouts_per_s": 12.3, "buffered": 4, "elapsed_s": 30.0, "eta_s": 80.0, "events": events or [],
    }
    return {**base, **extra}


EXPECTED_LINE = ("step 3/20  reward 0.41  pass 0.22  stale 0.8  replicas reserved=1 on_demand=2"
                 "  cache 0.65  12.3 rollouts/s  eta 1m20s")


def test_snapshot_eta():
    assert snapshot_eta(30.0, 0, 20) is None
    assert snapshot_eta(30.0, None, 20) is None
    assert snapshot_eta(30.0, 3, 20) == pytest.approx(170.0)
    assert snapshot_eta(30.0, 20, 20) == 0.0


def test_format_duration():
    assert [format_duration(s) for s in (None, 45, 80, 7500)] == ["-", "45s", "1m20s", "2h05m"]


def test_new_events_treats_lists_as_sliding_windows():
    assert new_events([], ["a"]) == ["a"]
    assert new_events(["a", "b"], ["a", "b"]) == []
    assert new_events(["a", "b", "c"], ["b", "c", "d"]) == ["d"]
    assert new_events(["x", "x"], ["x", "x", "x"]) == ["x"]
    assert new_events(["a"], ["z"]) == ["z"]


def test_plain_mode_prints_on_step_change_and_events_only(tmp_path: Path, capsys):
    display = Display(tmp_path, steps=20, live=False)
    display.update(snap(3))
    assert capsys.readouterr().out == EXPECTED_LINE + "\n"
    display.update(snap(3))
    assert capsys.readouterr().out == ""
    display.update(snap(3, events=["replica od-1 killed"]))
    assert capsys.readouterr().out == EXPECTED_LINE + "  | replica od-1 killed\n"
    display.update(snap(3, events=["replica od-1 killed"]))
    assert capsys.readouterr().out == ""
    display.update(snap(4, events=["replica od-1 killed"], eta_s=None, reward=None))
    assert capsys.readouterr().out.startswith("step 4/20  reward -  pass 0.22")
    display.close()


def test_live_mode_renders_step_and_replicas(tmp_path: Path):
    buffer = io.StringIO()
    console = Console(file=buffer, force_terminal=True, color_system=None, width=100)
    display = Display(tmp_path, steps=20, live=True, console=console)
    display.update(snap(7, events=["replica od-1 killed"]))
    display.close()
    display.close()
    text = buffer.getvalue()
    assert "7/20" in text
    assert "reserved=1 on_demand=2" in text and "routable 3" in text
    assert "replica od-1 killed" in text
