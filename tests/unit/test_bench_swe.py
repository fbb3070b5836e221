"""benchmarks/swe.py's helpers (benchmark-only code, tested here)."""

from __future__ import annotations

import pytest

from tests.benchmark_modules import load_benchmark


def test_evals_get_the_rl_runs_agent_limits_with_its_overrides() -> None:
    swe = load_benchmark("swe")
    assert swe.agent_limits([]) == (2, 160)  # examples/toy-swe.toml's [orchestrator.swe]
    assert swe.agent_limits(["orchestrator.swe.max_turns=3", "trainer.lr=3e-3"]) == (3, 160)
    assert swe.agent_limits(["orchestrator.swe.max_tokens_per_call=200"]) == (2, 200)


def test_rl_overrides_become_run_flags_and_reject_bare_keys() -> None:
    swe = load_benchmark("swe")
    assert swe.rl_overrides(["trainer.lr=3e-3"]) == ["--trainer.lr", "3e-3"]
    with pytest.raises(SystemExit):
        swe.rl_overrides(["trainer.lr"])
