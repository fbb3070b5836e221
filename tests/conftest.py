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
