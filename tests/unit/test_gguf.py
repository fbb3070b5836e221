"""`burstrl model import-gguf`: what it refuses before reading anything (the conversion itself is
tested on the real Gemma 3 270M, tests/integration/test_gemma.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from burstrl.model.gguf import import_gguf


def test_a_missing_file_a_non_empty_out_and_a_bad_dtype_are_refused(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no GGUF file"):
        import_gguf(tmp_path / "absent.gguf", tmp_path / "out")
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not empty"):
        import_gguf(gguf, tmp_path / "full")
    assert (tmp_path / "full" / "keep.txt").read_text() == "mine"
    with pytest.raises(ValueError, match="dtype"):
        import_gguf(gguf, tmp_path / "out", dtype="int4")


@pytest.mark.slow
def test_a_file_that_is_not_gguf_fails_and_leaves_nothing_behind(tmp_path: Path) -> None:
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"not a gguf file at all")
    out = tmp_path / "model"
    r = subprocess.run([sys.executable, "-c", "from burstrl.cli import main; main()", "model", "import-gguf",
                        str(gguf), "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode != 0
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == ["m.gguf"]  # no half directory
