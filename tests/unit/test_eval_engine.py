"""`burstrl eval` on either engine and dtype: EvalConfig's `engine` / `model_dtype` and how run_eval
turns them into the eval replica's serve arguments (so the lift of a run on vLLM in bf16 is measured
on the engine and precision it was trained with)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from burstrl.config import ConfigError, EngineConfig, EvalConfig, ModelConfig, ServeConfig
from burstrl.config.commands import Dtype
from burstrl.config.loading import load_config
from burstrl.eval.run import EvalSpec, replica_args, replica_start_timeout, run_eval


def eval_cfg(*args: str) -> EvalConfig:
    return load_config(EvalConfig, overrides=["--model", "m", *args])


def test_defaults_keep_the_own_engine_on_one_thread_in_the_models_dtype() -> None:
    cfg = eval_cfg()
    assert cfg.engine.backend == "burstrl" and cfg.engine.num_threads == 1 and cfg.model_dtype == "auto"
    # a partial engine section keeps the eval's one thread; an explicit value wins
    assert eval_cfg("--engine.max_total_num_tokens", "4096").engine.num_threads == 1
    assert eval_cfg("--engine.num_threads", "3").engine.num_threads == 3


def test_the_dtype_is_serves_model_dtype() -> None:
    assert ModelConfig.model_fields["dtype"].annotation == Dtype


def test_vllm_and_bf16_resolve_and_unknown_keys_are_refused_by_name() -> None:
    cfg = eval_cfg("--engine.backend", "vllm", "--engine.vllm.kv_cache_gib", "2", "--model_dtype", "bfloat16")
    assert cfg.engine.backend == "vllm" and cfg.engine.vllm.kv_cache_gib == 2 and cfg.model_dtype == "bfloat16"
    with pytest.raises(ConfigError, match="engine.vllm.bogus"):
        eval_cfg("--engine.vllm.bogus", "1")
    with pytest.raises(ConfigError, match="model_dtype"):
        eval_cfg("--model_dtype", "float8")
    with pytest.raises(ConfigError, match="engine.backend"):
        eval_cfg("--engine.backend", "sglang")


def test_dry_run_prints_the_engine_and_dtype(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-c", "from burstrl.cli import main; main()", "eval", "--dry-run",
                        "--model", str(tmp_path), "--env", "functions", "--engine.backend", "vllm",
                        "--engine.vllm.kv_cache_gib", "2", "--model-dtype", "bfloat16"],
                       capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0, r.stderr
    assert 'model_dtype = "bfloat16"' in r.stdout and 'backend = "vllm"' in r.stdout
    assert "kv_cache_gib = 2" in r.stdout


def test_replica_args_of_the_own_engine_are_its_one_thread() -> None:
    spec = EvalSpec(model=Path("m"), engine=eval_cfg().engine)
    assert replica_args(spec) == ["--engine.num_threads=1"]
    assert replica_start_timeout(spec) == 300.0


def test_replica_args_of_vllm_in_bf16_leave_num_threads_out() -> None:
    cfg = eval_cfg("--engine.backend", "vllm", "--engine.vllm.kv_cache_gib", "1", "--engine.vllm.cpu_cores", "0-1",
                   "--engine.vllm.extra_args", '["--max-num-seqs", "8"]', "--model_dtype", "bfloat16")
    spec = EvalSpec(model=Path("m"), engine=cfg.engine, dtype=cfg.model_dtype)
    args = replica_args(spec)
    assert "--engine.backend=\"vllm\"" in args and "--engine.vllm.kv_cache_gib=1" in args
    assert "--model.dtype=bfloat16" in args and not any("num_threads" in a for a in args)
    assert replica_start_timeout(spec) >= 900.0
    # serve reads them back as they were set (a string that looks like a range stays a string)
    served = load_config(ServeConfig, overrides=["--model.path", "m", *args])
    assert served.engine.vllm == cfg.engine.vllm and served.engine.backend == "vllm"
    assert served.model.dtype == "bfloat16" and served.engine.num_threads == EngineConfig().num_threads


def test_run_eval_starts_the_replica_with_them(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import burstrl.protocol.process as process

    seen: dict[str, Any] = {}

    def fake_start(model: Path, workdir: Path, *overrides: str, timeout: float) -> None:
        seen.update(overrides=list(overrides), timeout=timeout)
        raise RuntimeError("stop here")

    monkeypatch.setattr(process, "start_replica", fake_start)
    cfg = eval_cfg("--engine.backend", "vllm", "--model_dtype", "bfloat16")
    spec = EvalSpec(model=tmp_path, env="toy", n=2, out=tmp_path / "out", engine=cfg.engine, dtype=cfg.model_dtype)
    with pytest.raises(RuntimeError, match="stop here"):
        run_eval(spec)
    assert "--engine.backend=\"vllm\"" in seen["overrides"] and "--model.dtype=bfloat16" in seen["overrides"]
    assert "--engine.num_threads" not in seen["overrides"] and seen["timeout"] >= 900.0
