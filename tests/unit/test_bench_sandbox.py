"""benchmarks/sandbox.py's zstd-vs-gzip unpack timing (benchmark-only code, tested here)."""

from __future__ import annotations

import os
from pathlib import Path

from tests.benchmark_modules import load_benchmark


def test_unpack_benchmark_reports_both_codecs(tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "pkg").mkdir(parents=True)
    (src / "README.md").write_text("hello\n")
    (src / "pkg" / "data.bin").write_bytes(os.urandom(2048))
    (src / "link").symlink_to("pkg/data.bin")
    result = load_benchmark("sandbox").unpack_benchmark(src, repeats=2, work=tmp_path)
    assert result["zstd"]["bytes"] > 0 and result["gzip"]["bytes"] > 0
    assert len(result["zstd"]["seconds"]) == 2 and result["zstd_vs_gzip_time_ratio"] > 0
