"""Shared fixtures. The tiny model is built once and cached under .cache/ at the repo root."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

# One torch intra-op thread in the test process and the children that do not set their own (sft, eval
# without --engine.num_threads): the suite runs on 2 shared cores, where a second OpenMP thread
# spin-waits for a busy core and makes the tiny model's matmuls 5-30x slower (measured: a 192x128
# linear 0.25 ms with 1 thread, 2-8 ms with 2 on a loaded machine). Read by torch when it is first
# imported, so it is set here, before any test module imports torch; a value already set is kept.
os.environ.setdefault("OMP_NUM_THREADS", "1")

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


class FakeClock:
    """A monotonic clock that moves only when the test moves it (`clock.now += seconds`)."""

    def __init__(self, now: float) -> None:
        self.now = now

    def monotonic(self) -> float:
        return self.now


class _TimeUnder:
    """The `time` module as one module under test sees it: `monotonic` reads the fake clock,
    every other name is the real module's."""

    def __init__(self, clock: FakeClock) -> None:
        self.monotonic = clock.monotonic

    def __getattr__(self, name: str) -> object:
        return getattr(time, name)


@pytest.fixture
def fake_clock(monkeypatch: pytest.MonkeyPatch) -> Callable[..., FakeClock]:
    """`fake_clock(module, ..., now=1000.0)`: those modules' `time.monotonic()` reads a `FakeClock`.

    Why per module and not `time.monotonic` itself: that is the process's clock, read by pytest,
    by threads and by every other module; a test replaces only what its code under test calls.
    """

    def install(*modules: ModuleType, now: float = 1000.0) -> FakeClock:
        clock = FakeClock(now)
        for module in modules:
            monkeypatch.setattr(module, "time", _TimeUnder(clock))
        return clock

    return install
