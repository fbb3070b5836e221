"""Checks that run before `burstrl run` starts anything, and the bundled quickstart.

Why up front: a run that fails ten minutes in, after replicas loaded and a step trained, because
of a typo in a path or a fleet that never fit in memory, wastes the most expensive resource there
is. Everything that can be known from the config and the machine is checked here, and each
problem is named with the key to change.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from burstrl.config import RunConfig

QUICKSTART = Path(__file__).with_name("quickstart.toml")
GIB = 1 << 30


class PreflightError(ValueError):
    """The run cannot start as configured; the message names every problem found."""


def cache_dir() -> Path:
    """Where the quickstart's tiny model and its warm start are kept: $BURSTRL_CACHE or ~/.cache/burstrl."""
    return Path(os.environ.get("BURSTRL_CACHE") or Path.home() / ".cache" / "burstrl")


def quickstart_model_dir(swe: bool, forgetful: bool = False) -> Path:
    """Where the warm-started tiny model of `quickstart_model` (or, for swe, `quickstart_swe_model`)
    is cached: what `burstrl run --dry-run` shows as model.path without building it."""
    name = "tiny-qwen3-warm" if not swe else "tiny-qwen3-swe-forgetful" if forgetful else "tiny-qwen3-swe-warm"
    return (cache_dir() / name).absolute()


def quickstart_model() -> Path:
    """The warm-started tiny model (made and cached on first use: about a minute on two cores)."""
    from burstrl.envs.toy_warm import ensure_warm_model
    from burstrl.model.tiny import ensure_tiny_model

    base = ensure_tiny_model(cache_dir() / "tiny-qwen3")
    return ensure_warm_model(base, quickstart_model_dir(swe=False))


def quickstart_swe_model(forgetful: bool = False) -> Path:
    """The tiny model warm-started on toy coding-task demonstrations (made and cached on first use);
    `forgetful`: then taught to leave out the commit half the time (`envs.swe.warm`)."""
    from burstrl.envs.swe.warm import ensure_swe_forgetful_model, ensure_swe_warm_model
    from burstrl.model.tiny import ensure_tiny_model

    warm = ensure_swe_warm_model(ensure_tiny_model(cache_dir() / "tiny-qwen3"), quickstart_model_dir(swe=True))
    return ensure_swe_forgetful_model(warm, quickstart_model_dir(True, forgetful=True)) if forgetful else warm


def check(cfg: RunConfig) -> None:
    """Raise PreflightError listing every problem with `cfg` on this machine."""
    problems = (_model_problems(cfg) + _env_problems(cfg) + _plan_problems(cfg) + _provider_problems(cfg)
                + _engine_problems(cfg))
    if not problems and cfg.provider == "local":  # on Ray the cluster places (or times out) each role
        problems = _resource_problems(cfg)
    if problems:
        raise PreflightError("; ".join(problems))


def _model_problems(cfg: RunConfig) -> list[str]:
    path = Path(cfg.model.path)
    if not path.is_dir():
        return [f"model.path {str(path)!r} is not a directory"]
    if not (path / "config.json").is_file():
        return [f"model.path {str(path)!r} has no config.json (not a Hugging Face model directory)"]
    return []


def _env_problems(cfg: RunConfig) -> list[str]:
    from burstrl.envs import check_env

    out = []
    for name in cfg.orchestrator.envs:
        try:
            check_env(name, cfg.orchestrator)
        except ValueError as exc:
            out.append(f"orchestrator.envs: {exc}")
    out += [f"orchestrator.envs.{name}: weight must be > 0" for name, w in cfg.orchestrator.envs.items() if w <= 0]
    if not cfg.orchestrator.envs:
        out.append("orchestrator.envs: at least one environment is needed")
    return out


def _plan_problems(cfg: RunConfig) -> list[str]:
    out = []
    c = cfg.chaos
    if c.kill_fraction > 0 and not 1 <= c.at_step <= cfg.trainer.steps:
        out.append(f"chaos.at_step {c.at_step} must be within 1..trainer.steps ({cfg.trainer.steps})")
    if cfg.model.device.startswith("cuda") and cfg.provider == "local":  # a Ray driver may have no GPU
        import torch

        if not torch.cuda.is_available():
            out.append(f"model.device {cfg.model.device!r}: no CUDA GPU on this machine")
    cores = os.cpu_count() or 1
    if cfg.provider == "local" and cfg.trainer.world_size > cores and not cfg.model.device.startswith("cuda"):
        out.append(f"trainer.world_size {cfg.trainer.world_size} exceeds this machine's {cores} CPU cores")
    return out


def _provider_problems(cfg: RunConfig) -> list[str]:
    if cfg.provider != "ray":
        return []
    try:
        import ray  # noqa: F401
    except ImportError:
        return ["provider 'ray': Ray is not installed (pip install 'burstrl[ray]')"]
    token = cfg.ray.auth_token_file
    if token and not Path(token).is_file():
        return [f"ray.auth_token_file {token!r} is not a file"]
    return []


def _engine_problems(cfg: RunConfig) -> list[str]:
    """vLLM: its environment exists, and each replica can have cores of its own (RunConfig.replica_cores)."""
    if cfg.engine.backend != "vllm":
        return []
    out = []
    python = cfg.engine.vllm.python or os.environ.get("BURSTRL_VLLM_PYTHON", "")
    if python and not Path(python).is_file():
        out.append(f"engine.vllm.python {python!r} is not a file (`make vllm` makes .venv-vllm)")
    try:
        cfg.replica_cores(len(os.sched_getaffinity(0)), replicas_on_cpu(cfg))
    except ValueError as exc:
        out.append(str(exc))
    return out


def replicas_on_cpu(cfg: RunConfig) -> bool:
    """Whether the run's replicas compute on CPU: on Ray when they hold no GPU; locally by `model.device`
    (auto: when torch sees no GPU here, the rule `inference.vllm.process.is_cpu` applies in the replica)."""
    if cfg.provider == "ray":
        return cfg.ray.replica_gpus == 0
    if cfg.model.device != "auto":
        return cfg.model.device == "cpu"
    import torch

    return not torch.cuda.is_available()


def _resource_problems(cfg: RunConfig) -> list[str]:
    """Memory: the most replicas the run may hold at once, each with weights and its KV budget, plus the trainer."""
    path = Path(cfg.model.path)
    weights = sum(f.stat().st_size for f in path.glob("*.safetensors")) or sum(
        f.stat().st_size for f in path.glob("*.bin"))
    if cfg.engine.backend == "vllm":  # vLLM on CPU reserves its KV cache whole at start
        kv, why = int(cfg.engine.vllm.kv_cache_gib * GIB), f"engine.vllm.kv_cache_gib={cfg.engine.vllm.kv_cache_gib:g}"
    else:
        kv = kv_bytes_per_token(json.loads((path / "config.json").read_text())) * cfg.engine.max_total_num_tokens
        why = f"engine.max_total_num_tokens={cfg.engine.max_total_num_tokens}"
    most = cfg.most_replicas()
    need = most * (weights + kv) + cfg.trainer.world_size * 4 * weights
    have = available_memory()
    if have is not None and need > have:
        return [f"impossible resource request: {most} replicas x ({weights / GIB:.2f} GiB weights + "
                f"{kv / GIB:.2f} GiB KV for {why}) "
                f"plus the trainer need {need / GIB:.1f} GiB, this machine has {have / GIB:.1f} GiB available"]
    return []


def kv_bytes_per_token(model_config: dict) -> int:
    """Bytes of K and V per token across layers (float32 on CPU: 4 bytes per value)."""
    heads = int(model_config.get("num_attention_heads", 1))
    kv_heads = int(model_config.get("num_key_value_heads", heads))
    head_dim = int(model_config.get("head_dim") or model_config["hidden_size"] // heads)
    return 2 * int(model_config["num_hidden_layers"]) * kv_heads * head_dim * 4


def available_memory() -> int | None:
    """MemAvailable from /proc/meminfo (None where there is none)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None
