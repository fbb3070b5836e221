"""benchmarks/gpu_check.sh: refuses loudly without a GPU; its --dry-run checks every command parses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "gpu_check.sh"


def run(*args: str, tmp_path: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable, "GPU_CHECK_LOGS": str(tmp_path)}
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=1800)


def test_script_is_tracked_and_parses() -> None:
    assert subprocess.run(["git", "check-ignore", "-q", str(SCRIPT)], cwd=REPO).returncode == 1  # not ignored
    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0


def test_without_a_gpu_it_fails_loudly(tmp_path: Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    out = run(tmp_path=tmp_path)
    assert out.returncode == 2
    assert "no CUDA GPU" in out.stderr
    assert json.loads(out.stdout.splitlines()[0]) == {
        "check": "gpu", "ok": False,
        "error": "no CUDA GPU visible to torch: this script measures GPU figures only (use --dry-run to check it "
                 "without one)"}


def test_unknown_option_is_refused(tmp_path: Path) -> None:
    out = run("--fast", tmp_path=tmp_path)
    assert out.returncode == 2 and "usage" in out.stderr


@pytest.mark.slow
def test_dry_run_parses_every_command_and_runs_the_grpo_step_on_cpu(tmp_path: Path) -> None:
    out = run("--dry-run", tmp_path=tmp_path)
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    assert out.returncode == 0, out.stdout + out.stderr
    by_name = {r["check"]: r for r in rows}
    # the benchmarks' parses come last: one process parses them all
    assert list(by_name) == ["syntax", "gpu_tests", "grpo_step", "gemma3_model", "engine", "recompute", "push",
                             "engine_gemma3", "engine_gemma3_generic", "kv_window_gemma3", "vllm_engine", "functions", "summary"]
    assert all(r["ok"] for r in rows), rows
    for name in ("engine", "recompute", "push", "gemma3_model", "engine_gemma3", "engine_gemma3_generic",
                 "kv_window_gemma3", "vllm_engine", "functions"):
        assert by_name[name]["result"] == {"parsed": True}
    step = by_name["grpo_step"]["result"]
    assert step["adapter_finite"] and step["tokens"] == 64
    assert "gpu" in by_name["gpu_tests"]["stdout_tail"] or "collected" in by_name["gpu_tests"]["stdout_tail"]
