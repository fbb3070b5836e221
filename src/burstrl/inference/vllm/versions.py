"""Adapter versions as vLLM LoRA adapters: one name and one directory per loaded version.

Why vLLM reads only files burstrl writes: the registry has already read and checked a version
(`inference.lora`: shapes against the base model, ranks, finite values), from a directory or from
pushed shards. The directory vLLM loads is written here from those checked tensors, in plain PEFT
form (B scaled, alpha = r, so any per-module scale is exact), so nothing else of what a trainer or a
client sent (extra config keys, `modules_to_save`, other files) ever reaches vLLM.

Why a fresh name and path per load (`<name>@<uid>`): vLLM keys its prefix cache by LoRA name and
re-reads an evicted adapter from its path, so a name or path reused for other weights would serve
stale keys or weights. A version's directory is kept until the registry frees the version (its last
session released), so vLLM can always re-read it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from burstrl.inference.lora import ATTN_PROJ, LoraAdapter

_FILES = ("adapter_config.json", "adapter_model.safetensors")


def lora_name(adapter: LoraAdapter) -> str:
    """The name vLLM knows this load of the version by (see module docstring)."""
    return f"{adapter.name}@{adapter.uid}"


def write_peft(adapter: LoraAdapter, root: Path) -> Path:
    """Write `adapter` as a PEFT directory under `root`; returns the directory."""
    path = root / lora_name(adapter)
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    tensors: dict[str, torch.Tensor] = {}
    modules: set[str] = set()
    for (layer, module), (a, b, scale) in adapter.weights.items():
        parent = "self_attn" if module in ATTN_PROJ else "mlp"
        key = f"base_model.model.model.layers.{layer}.{parent}.{module}"
        tensors[f"{key}.lora_A.weight"] = a.detach().to("cpu", torch.float32).contiguous()
        tensors[f"{key}.lora_B.weight"] = (b.detach().to("cpu", torch.float32) * scale).contiguous()
        modules.add(module)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": adapter.rank, "lora_alpha": adapter.rank, "target_modules": sorted(modules),
              "lora_dropout": 0.0, "bias": "none", "task_type": "CAUSAL_LM", "use_rslora": False, "use_dora": False}
    (path / "adapter_config.json").write_text(json.dumps(config))
    return path


def remove(adapter: LoraAdapter, root: Path) -> None:
    shutil.rmtree(root / lora_name(adapter), ignore_errors=True)
