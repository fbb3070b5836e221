"""The Ray zygote's pure pieces: when a failed fork falls back to a plain start, and the
replacement benchmark's split of a replacement into phases."""

from __future__ import annotations

import json
from pathlib import Path

from burstrl.providers.ray_zygote import zygote_is_gone
from tests.benchmark_modules import load_benchmark


def test_only_a_gone_zygote_makes_a_plain_start() -> None:
    assert zygote_is_gone({"error": "the zygote is gone", "zygote_alive": False})
    assert zygote_is_gone({"error": "the zygote actor is gone: ActorDiedError"})  # no answer from it at all
    assert not zygote_is_gone({"error": "['serve'] exited with 1", "zygote_alive": True})  # the replica failed
    assert not zygote_is_gone({"pid": 12, "url": "http://10.0.0.1:8000"})


def _write(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_replacement_phases_add_up_to_death_to_serving(tmp_path: Path) -> None:
    ev = {"kind": "event", "pool": "on_demand"}
    _write(tmp_path / "fleet.jsonl", [
        {**ev, "t": 100.0, "event": "replica_killed", "replica": "replica-2-on_demand", "detail": "chaos"},
        {"t": 100.5, "kind": "sample"},
        {**ev, "t": 103.0, "event": "replica_started", "replica": "replica-4-on_demand",
         "detail": "http://10.0.0.1:9 (replaces replica-2-on_demand)"},
        {**ev, "t": 50.0, "event": "replica_started", "replica": "replica-1-reserved", "detail": "http://x:1"},
    ])
    _write(tmp_path / "logs" / "ray_starts.jsonl", [
        {"name": "replica-1-reserved", "t": 10.0, "how": "fork", "node": "ab", "placed_s": 1.0, "ready_s": 20.0},
        {"name": "replica-4-on_demand", "t": 100.25, "how": "fork", "node": "ab", "placed_s": 0.75, "ready_s": 1.5},
    ])
    [phases] = load_benchmark("replacement").replacement_phases(tmp_path)
    assert phases == {"to_actor_s": 0.25, "placed_s": 0.75, "ready_s": 1.5, "register_s": 0.5, "how": "fork"}
    assert sum(v for k, v in phases.items() if k != "how") == 3.0  # = replica_started - replica_killed
