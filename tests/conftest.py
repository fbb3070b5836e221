"""Shared fixtures. The tiny model is built once and cached under .cache/ at the repo root."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
TINY_MODEL_DIR = REPO_ROOT / ".cache" / "tiny-qwen3"


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """Path of the tiny random-init Qwen3 (HF directory); made only if missing or outdated."""
    from burstrl.model.tiny import ensure_tiny_model

    return ensure_tiny_model(TINY_MODEL_DIR)


CALC_BUGGY = "def add(a, b):\n    return a - b\n"


@pytest.fixture
def calc_task():
    """A hand-made SWE task record for the agent tests (its repo lives only in `calc_sandbox`)."""
    from burstrl.envs.swe.task import SweTask

    return SweTask(instance_id="toy-1", repo="/nonexistent", base_commit="HEAD",
                   problem_statement="add(2, 3) returns -1 instead of 5 (calc.py).",
                   FAIL_TO_PASS=["test_calc.py::test_add"], PASS_TO_PASS=[])


@pytest.fixture
def calc_sandbox():
    """A real sandbox holding a one-commit git repo at /work/repo with a bug in calc.py."""
    from burstrl.envs.swe.agent import REPO_DIR
    from burstrl.sandbox import open_sandbox

    sb = open_sandbox()
    sb.write_file(f"{REPO_DIR}/calc.py", CALC_BUGGY)
    setup = sb.exec("git init -q && git add -A && git -c user.name=t -c user.email=t@t commit -qm base",
                    timeout=30, cwd=REPO_DIR)
    assert setup.exit_code == 0, setup.stderr
    yield sb
    sb.close()
