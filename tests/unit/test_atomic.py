"""build_dir: a directory appears whole or not at all, racing builders end with one complete copy.

The race test is the one that broke `envs/swe/warm.py` (rmtree of the cache, then rename): two
first builds of the same cache at once, the expensive step replaced by a fast real function.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import sys
import threading
import types
from pathlib import Path

import pytest

from burstrl.atomic import build_dir, sha256_file, sha256_files

FILES = 40  # enough files that a delete under a reader would be seen half done


def _write_model(tmp: Path, who: str) -> None:
    for i in range(FILES):
        (tmp / f"part-{i:03d}.bin").write_bytes(who.encode() * 1000)
    (tmp / "marker.json").write_text(json.dumps({"recipe": 1, "by": who}))


def _complete(out: Path) -> bool:
    """Every file present and all written by one builder (no mix of two)."""
    who = json.loads((out / "marker.json").read_text())["by"]
    parts = sorted(out.glob("part-*.bin"))
    return len(parts) == FILES and all(p.read_bytes() == who.encode() * 1000 for p in parts)


def _has_marker(out: Path) -> bool:
    return (out / "marker.json").is_file() and json.loads((out / "marker.json").read_text())["recipe"] == 1


def _build_in_process(out: str, who: str, barrier) -> None:  # multiprocessing target: module level
    def build(tmp: Path) -> None:
        _write_model(tmp, who)
        barrier.wait(timeout=30)  # both builds are done before either publishes: the race, every time

    build_dir(Path(out), build, accept=_has_marker)
    assert _complete(Path(out))


def test_two_processes_building_one_cache_both_end_with_a_complete_dir(tmp_path: Path) -> None:
    out = tmp_path / "cache" / "model"
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(2)
    procs = [ctx.Process(target=_build_in_process, args=(str(out), who, barrier)) for who in "ab"]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0]
    assert _complete(out)
    assert [p.name for p in out.parent.iterdir()] == ["model"]  # no temp dir left behind


def test_a_failed_build_leaves_nothing(tmp_path: Path) -> None:
    out = tmp_path / "model"

    def build(tmp: Path) -> None:
        _write_model(tmp, "a")
        raise RuntimeError("out of memory")

    with pytest.raises(RuntimeError, match="out of memory"):
        build_dir(out, build)
    assert list(tmp_path.iterdir()) == []


def test_a_non_empty_dir_is_refused_unless_forced_or_accepted(tmp_path: Path) -> None:
    out = tmp_path / "model"
    build_dir(out, lambda tmp: _write_model(tmp, "a"))
    with pytest.raises(FileExistsError, match="not empty"):
        build_dir(out, lambda tmp: _write_model(tmp, "b"))
    assert build_dir(out, lambda tmp: pytest.fail("built"), accept=_has_marker) == out
    build_dir(out, lambda tmp: _write_model(tmp, "b"), force=True)
    assert json.loads((out / "marker.json").read_text())["by"] == "b" and _complete(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]
    assert oct(out.stat().st_mode & 0o777) == "0o755"  # mkdtemp's 0700 made readable for every user


def test_swe_warm_start_survives_two_concurrent_first_builds(tmp_path: Path, monkeypatch) -> None:
    """Two `ensure_swe_warm_model` calls on a fresh cache at once (a run and an eval): both return a
    complete model. Before build_dir, the second deleted or swapped the first's model (rmtree+rename)."""
    from burstrl.envs.swe import warm

    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text("{}")
    (base / "model.safetensors").write_bytes(b"weights")
    barrier = threading.Barrier(2)

    def fake_sft(model_dir, data, out_dir, **_kw) -> Path:  # the expensive step, made fast
        who = threading.current_thread().name
        Path(out_dir).mkdir(exist_ok=True)  # an earlier stage's output is a fresh dir, the last one build_dir's
        _write_model(Path(out_dir), who)
        barrier.wait(timeout=30)
        return Path(out_dir)

    monkeypatch.setitem(sys.modules, "burstrl.trainer.sft", types.SimpleNamespace(sft=fake_sft))
    monkeypatch.setattr(warm, "STAGES", ({"tasks": {1000: 2}, "steps": 1, "seed": 0},
                                         {"tasks": {1000: 2, 2000: 1}, "steps": 1, "seed": 1}))
    out = tmp_path / "cache" / "swe-warm"
    results, errors = [], []

    def build() -> None:
        try:
            results.append(warm.ensure_swe_warm_model(base, out))
            assert _complete(out)
        except BaseException as exc:  # reported below: a thread's exception is otherwise lost
            errors.append(exc)

    threads = [threading.Thread(target=build, name=who) for who in "ab"]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert errors == [] and results == [out, out]
    assert _complete(out) and json.loads((out / warm.MARKER).read_text())["recipe"] == warm.recipe(base)
    assert sorted(p.name for p in out.parent.iterdir()) == ["swe-warm"]


def test_sha256_of_files_is_of_their_concatenation(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.write_bytes(b"x" * 3_000_000)  # more than one read chunk
    b.write_bytes(b"tail")
    assert sha256_file(a) == hashlib.sha256(a.read_bytes()).hexdigest()
    assert sha256_files([a, b]) == hashlib.sha256(a.read_bytes() + b.read_bytes()).hexdigest()
    assert sha256_files([b, a]) != sha256_files([a, b])
