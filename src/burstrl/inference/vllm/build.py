"""A replica's engine on vLLM: what `replica.build_replica` needs, without loading the weights here.

The weights live in vLLM's process only. This process reads the checkpoint's config (context length,
vocabulary, eos ids) and builds the model's skeleton on the meta device (no memory) so the adapter
registry checks every version's shapes against the base model, as on the own engine.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from burstrl.config import ServeConfig
from burstrl.inference.adapters import AdapterRegistry
from burstrl.inference.sessions import SessionTable
from burstrl.inference.vllm.engine import VllmEngine
from burstrl.inference.vllm.process import VllmProcess, VllmStartError, is_cpu, vllm_python

log = logging.getLogger(__name__)


def vllm_engine(cfg: ServeConfig, tokenizer: Any, state_dir: Path,
                session_table: Callable[[ServeConfig, int], SessionTable]
                ) -> tuple[VllmEngine, AdapterRegistry, SessionTable, int]:
    """The engine (not started: `start` brings vLLM up), the registry and the session table."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from burstrl.model.hf import eos_token_ids

    _refuse_unsupported(cfg)
    vllm_python(cfg.engine.vllm)  # a missing environment is an error now, not after loading anything
    config = AutoConfig.from_pretrained(cfg.model.path)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    max_len = cfg.engine.max_model_len or int(text.max_position_embeddings)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    layers = _decoder_layers(skeleton)
    sessions = session_table(cfg, max_len)
    cpu = is_cpu(cfg.model.device)
    process = VllmProcess(cfg.model.path, _dtype(cfg.model.dtype, cpu), max_len, cfg.engine.vllm, state_dir, cpu)
    engine = VllmEngine(process, tokenizer, cfg.engine, eos_token_ids(cfg.model.path, tokenizer), sessions,
                        max_len, int(text.vocab_size), state_dir)
    registry = AdapterRegistry.for_layers(state_dir, layers, torch.float32, torch.device("cpu"),
                                          cfg.server.upload_ttl_s)
    return engine, registry, sessions, max_len


def _refuse_unsupported(cfg: ServeConfig) -> None:
    if cfg.engine.logprobs_mode == "raw":
        raise VllmStartError("engine.logprobs_mode = \"raw\" is not supported with engine.backend = \"vllm\": the "
                         "replica runs vLLM with processed logprobs, which capture needs")


def _dtype(dtype: str, cpu: bool) -> str:
    """vLLM's --dtype, always explicit: its auto runs fp32 checkpoints in bf16 on CPU."""
    if dtype != "auto":
        return dtype
    return "float32" if cpu else "bfloat16"


def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers of an HF causal LM (model.model.layers, or a multimodal model's text part)."""
    for path in ("model.layers", "model.language_model.layers", "language_model.model.layers"):
        obj: Any = model
        for part in path.split("."):
            obj = getattr(obj, part, None)
            if obj is None:
                break
        if obj is not None:
            return list(obj)
    raise ValueError(f"{type(model).__name__}: no decoder layers found for adapter shape checks")
