"""LoRA adapters for the engine: read PEFT files, apply many versions in one batch.

Why not PEFT at inference: PEFT rewrites the model's modules to add an adapter, and its mixed
batches loop over adapters inside every module. The engine instead keeps the base model untouched
and holds each version's A/B matrices itself (as vLLM and SGLang do), so loading `policy-v7`
while `policy-v6` sessions are decoding never touches a module the decode loop is using. The files
are PEFT's own (adapter_config.json + adapter_model.safetensors), written by the trainer with PEFT,
so vLLM/SGLang can load the same directories.

Math per target linear (PEFT's LoRA): y = W x + (B (A x)) * scale, scale = alpha / r
(alpha / sqrt(r) with rsLoRA).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file


ATTN_PROJ = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_PROJ = ("gate_proj", "up_proj", "down_proj")
TARGETS = ATTN_PROJ + MLP_PROJ
_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


class AdapterError(ValueError):
    """The adapter files are missing, malformed, or use a LoRA variant the engine cannot apply."""


@dataclass
class LoraAdapter:
    """One adapter version: per (layer, module) the A [r, in] and B [out, r] matrices and scale."""

    name: str
    path: str
    rank: int
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor, float]]


def load_adapter(name: str, path: str | Path, num_layers: int, dtype: torch.dtype,
                 device: torch.device) -> LoraAdapter:
    """Read a PEFT LoRA directory; refuse variants whose math differs (DoRA, per-module patterns)."""
    path = Path(path)
    cfg_file, weights_file = path / "adapter_config.json", path / "adapter_model.safetensors"
    if not cfg_file.is_file() or not weights_file.is_file():
        raise AdapterError(f"{path}: expected adapter_config.json and adapter_model.safetensors")
    cfg = json.loads(cfg_file.read_text())
    _check_config(path, cfg)
    rank, alpha = int(cfg["r"]), float(cfg.get("lora_alpha", cfg["r"]))
    scale = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    tensors = load_file(str(weights_file))
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = _KEY.search(key)
        if m is None or m.group(2) not in TARGETS or int(m.group(1)) >= num_layers:
            raise AdapterError(f"{path}: unsupported adapter tensor {key!r}")
        pairs.setdefault((int(m.group(1)), m.group(2)), {})[m.group(3)] = tensor
    weights = {}
    for where, ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise AdapterError(f"{path}: layer {where[0]} {where[1]} lacks lora_A or lora_B")
        a, b = ab["A"].to(device, dtype), ab["B"].to(device, dtype)
        if a.shape[0] != rank or b.shape[1] != rank:
            raise AdapterError(f"{path}: layer {where[0]} {where[1]} rank differs from r={rank}")
        weights[where] = (a, b, scale)
    if not weights:
        raise AdapterError(f"{path}: no LoRA weights")
    return LoraAdapter(name=name, path=str(path), rank=rank, weights=weights)


def _check_config(path: Path, cfg: dict) -> None:
    if cfg.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{path}: peft_type {cfg.get('peft_type')!r} is not LORA")
    if "r" not in cfg:
        raise AdapterError(f"{path}: adapter_config.json has no 'r'")
    for key in ("use_dora", "lora_bias", "alora_invocation_tokens", "layer_replication", "target_parameters"):
        if cfg.get(key):
            raise AdapterError(f"{path}: {key} is not supported by the torch engine")
    for key in ("rank_pattern", "alpha_pattern"):
        if cfg.get(key):
            raise AdapterError(f"{path}: {key} is not supported by the torch engine")


class LoraBatch:
    """Which adapter each row of a batch uses; adds each row's LoRA delta to a projection output.

    Rows are grouped by adapter once per step, so a batch mixing three versions does three small
    matmul pairs per projection, and rows on the base model do none. A row is a batch row
    ([B, T, ...] inputs), or with `per_token` a position of the flattened [B * T] tokens (a packed
    prefill of several requests in one sequence).
    """

    def __init__(self, adapters: list[LoraAdapter | None], per_token: bool = False) -> None:
        groups: dict[int, tuple[LoraAdapter, list[int]]] = {}
        for row, adapter in enumerate(adapters):
            if adapter is not None:
                groups.setdefault(id(adapter), (adapter, []))[1].append(row)
        n = len(adapters)
        self.per_token = per_token
        self.groups: list[tuple[LoraAdapter, slice | torch.Tensor]] = []
        for adapter, rows in groups.values():
            device = next(iter(adapter.weights.values()))[0].device
            index = slice(None) if len(rows) == n else torch.tensor(rows, device=device)
            self.groups.append((adapter, index))

    @property
    def empty(self) -> bool:
        return not self.groups

    def add_(self, layer: int, name: str, x: torch.Tensor, y: torch.Tensor) -> None:
        """x: [B, T, in], y: [B, T, out] base output (may be a view) -> each row's delta added in place."""
        if self.per_token:
            x, y = x.reshape(-1, x.shape[-1]), y.view(-1, y.shape[-1])
        for adapter, index in self.groups:
            w = adapter.weights.get((layer, name))
            if w is None:
                continue
            a, b, scale = w
            if isinstance(index, slice):
                y.add_((x @ a.T) @ b.T, alpha=scale)
            else:
                y.index_add_(0, index, (x[index] @ a.T) @ b.T, alpha=scale)
