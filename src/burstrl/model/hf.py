"""Load a Hugging Face causal LM and its tokenizer for inference and training.

Why a module of its own: the engine, the trainer and the tests must agree on device, dtype and
attention implementation, and on which token ids end a completion. Only the normal
`from_pretrained` path is used, so any local Qwen3 checkpoint directory works like the tiny model.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str = "auto") -> torch.device:
    """`auto` picks cuda when a GPU is visible, else cpu; anything else is a torch device string."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device | str) -> torch.dtype:
    """`auto` is float32 on CPU (bf16 matmuls are slow there) and bfloat16 on cuda."""
    if name == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r}; expected auto, {', '.join(_DTYPES)}")
    return _DTYPES[name]


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """The checkpoint's own tokenizer, chat template included."""
    return AutoTokenizer.from_pretrained(str(path))


def load_model(path: str | Path, dtype: str = "auto", device: str = "auto", attention: str = "sdpa") -> PreTrainedModel:
    """An eval-mode causal LM on `device` in `dtype`; attention `sdpa` or `burstrl` (model/attention.py)."""
    dev = resolve_device(device)
    if attention == "burstrl":
        from burstrl.model.attention import register_with_transformers

        register_with_transformers()
    elif attention != "sdpa":
        raise ValueError(f"unknown attention {attention!r}; expected sdpa or burstrl")
    try:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=resolve_dtype(dtype, dev),
                                                     attn_implementation=attention)
    except ValueError as exc:  # an architecture without sdpa support (Gemma 2): its own eager attention
        if attention != "sdpa" or "scaled_dot_product_attention" not in str(exc):
            raise
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=resolve_dtype(dtype, dev),
                                                     attn_implementation="eager")
    return model.to(dev).eval()


def eos_token_ids(path_or_model: str | Path | PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """Every id that ends a completion: generation_config's eos ids, then the tokenizer's eos.

    Chat checkpoints stop on `<|im_end|>` (tokenizer eos) but also on `<|endoftext|>`, which only
    generation_config.json lists; missing either one makes completions run to max_tokens.
    """
    if isinstance(path_or_model, PreTrainedModel):
        gen = path_or_model.generation_config
    else:
        gen = _generation_config(Path(path_or_model))
    ids = _as_list(gen.eos_token_id if gen is not None else None)
    for extra in _as_list(tokenizer.eos_token_id):
        if extra not in ids:
            ids.append(extra)
    return ids


def _generation_config(path: Path) -> GenerationConfig | None:
    """generation_config.json is optional in a checkpoint; a missing one means no extra eos ids."""
    if path.is_dir() and not (path / "generation_config.json").exists():
        return None
    return GenerationConfig.from_pretrained(str(path))


def _as_list(value: int | list[int] | None) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]
