"""The versions directory: atomic publish with a manifest, immutability, latest, gc."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from pathlib import Path

import pytest

from burstrl.protocol.adapters import ADAPTER_FILES as UPLOAD_FILES
from burstrl.weights.volume import ADAPTER_FILES, VersionCorrupt, VersionExists, gc, latest, publish, verify, versions


def fake_adapter(path: Path, seed: int) -> Path:
    """Two PEFT-named files with seed-dependent bytes (the volume never parses them)."""
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text(json.dumps({"r": 8, "seed": seed}))
    (path / "adapter_model.safetensors").write_bytes(bytes([seed % 256]) * (100_000 + seed))
    (path / "README.md").write_text("not published")
    return path


def test_file_names_match_the_uploads() -> None:
    assert ADAPTER_FILES is UPLOAD_FILES


def test_publish_is_atomic_with_a_manifest(tmp_path: Path) -> None:
    volume = tmp_path / "adapters"
    src = fake_adapter(tmp_path / "a", seed=1)
    out = publish(volume, 3, src)
    assert out == volume / "policy-v3"
    assert sorted(p.name for p in volume.iterdir()) == ["policy-v3"]  # no temp dir left behind
    assert sorted(p.name for p in out.iterdir()) == [*sorted(ADAPTER_FILES), "manifest.json"]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["version"] == 3 and manifest["name"] == "policy-v3"
    for name in ADAPTER_FILES:
        data = (src / name).read_bytes()
        assert (out / name).read_bytes() == data
        assert manifest["files"][name] == {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    verify(out)
    assert versions(volume) == [3]


def test_republishing_identical_content_is_a_no_op(tmp_path: Path) -> None:
    volume = tmp_path / "adapters"
    first = publish(volume, 1, fake_adapter(tmp_path / "a", seed=1))
    mtime = (first / "manifest.json").stat().st_mtime_ns
    same = fake_adapter(tmp_path / "copy", seed=1)  # another copy of the same bytes (a resumed trainer)
    assert publish(volume, 1, same) == first
    assert (first / "manifest.json").stat().st_mtime_ns == mtime
    assert sorted(p.name for p in volume.iterdir()) == ["policy-v1"]


def test_different_content_under_a_published_version_is_refused(tmp_path: Path) -> None:
    volume = tmp_path / "adapters"
    publish(volume, 1, fake_adapter(tmp_path / "a", seed=1))
    with pytest.raises(VersionExists, match="never change"):
        publish(volume, 1, fake_adapter(tmp_path / "b", seed=2))
    assert (volume / "policy-v1" / "adapter_model.safetensors").read_bytes()[:1] == bytes([1])
    with pytest.raises(ValueError, match="base model"):
        publish(volume, 0, tmp_path / "a")


def test_latest_skips_a_corrupted_version(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    volume = tmp_path / "adapters"
    assert latest(volume) is None  # no directory yet: nothing published
    for v in (1, 2, 3):
        publish(volume, v, fake_adapter(tmp_path / f"a{v}", seed=v))
    assert latest(volume) == (3, volume / "policy-v3")
    weights = volume / "policy-v3" / "adapter_model.safetensors"
    data = bytearray(weights.read_bytes())
    data[10] ^= 0xFF  # same size, one flipped byte
    weights.write_bytes(bytes(data))
    with pytest.raises(VersionCorrupt, match="sha256"):
        verify(volume / "policy-v3")
    (volume / "policy-v2" / "adapter_config.json").unlink()
    with caplog.at_level(logging.WARNING, logger="burstrl.weights.volume"):
        assert latest(volume) == (1, volume / "policy-v1")
    assert "policy-v3" in caplog.text and "policy-v2" in caplog.text
    (volume / "policy-v4").mkdir()  # a directory without a manifest is not a version
    assert latest(volume) == (1, volume / "policy-v1")


def test_gc_keeps_the_newest_and_protected_versions(tmp_path: Path) -> None:
    volume = tmp_path / "adapters"
    for v in range(1, 7):
        publish(volume, v, fake_adapter(tmp_path / f"a{v}", seed=v))
    assert gc(volume, keep=2, protect={2}) == [1, 3, 4]
    assert versions(volume) == [2, 5, 6]
    assert gc(volume, keep=2, protect={2}) == []
    assert gc(volume, keep=1) == [2, 5]
    assert versions(volume) == [6] and latest(volume) == (6, volume / "policy-v6")
    with pytest.raises(ValueError):
        gc(volume, keep=0)


def test_gc_removes_stale_temp_dirs_only(tmp_path: Path) -> None:
    volume = tmp_path / "adapters"
    publish(volume, 1, fake_adapter(tmp_path / "a", seed=1))
    stale, fresh = volume / ".tmp-policy-v2-dead", volume / ".tmp-policy-v3-live"
    for d in (stale, fresh):
        d.mkdir()
        (d / "adapter_model.safetensors").write_bytes(b"partial")
    old = time.time() - 120
    os.utime(stale, (old, old))
    assert gc(volume, keep=5) == []
    assert not stale.exists() and fresh.exists()  # a publish may still be writing the fresh one
    assert versions(volume) == [1]
