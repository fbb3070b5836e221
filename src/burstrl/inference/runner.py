"""The engine's own forward pass over a Hugging Face decoder (Llama / Qwen2 / Qwen3 family).

Why not `model(...)`: the engine decodes a batch whose sequences all have different cached
lengths, keeps each session's KV cache between calls, and mixes LoRA versions in one batch. The
HF forward knows none of that, and `generate` costs ~10x more per token here. So this module walks
the model's own submodules (embeddings, norms, projections, rotary table, MLP) with the same math,
and asks an `Attention` object to store the new keys/values and attend. Weights stay where HF
loaded them, so any checkpoint of a supported architecture works unchanged.

Shapes: B = sequences, T = new tokens per sequence, H / KVH = query / key-value heads, D = head dim.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from burstrl.inference.lora import ATTN_PROJ, MLP_PROJ, LoraBatch


class UnsupportedModel(ValueError):
    """The checkpoint's architecture does not have the Llama-style layer layout the runner needs."""


class Attention(Protocol):
    """Stores a layer's new keys/values and returns attention over everything cached so far."""

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [B, H, T, D], k/v: [B, KVH, T, D] (rotary applied) -> [B, H, T, D]."""
        ...


class ModelRunner:
    """Functional forward over an HF causal LM with pluggable attention storage and LoRA."""

    def __init__(self, model: nn.Module) -> None:
        inner = getattr(model, "model", None)
        if inner is None or not hasattr(inner, "layers") or not hasattr(model, "lm_head"):
            raise UnsupportedModel(f"{type(model).__name__}: expected .model.layers and .lm_head")
        for i, layer in enumerate(inner.layers):
            _check_layer(i, layer)
        cfg = model.config
        if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", False):
            raise UnsupportedModel("sliding-window attention is not supported by the torch engine")
        self.model = model
        self.embed = inner.embed_tokens
        self.layers = list(inner.layers)
        self.norm = inner.norm
        self.rotary = inner.rotary_emb
        self.lm_head = model.lm_head
        attn = self.layers[0].self_attn
        self.head_dim: int = attn.head_dim
        self.num_heads: int = cfg.num_attention_heads
        self.num_kv_heads: int = cfg.num_key_value_heads
        self.scaling: float = attn.scaling
        self.num_layers = len(self.layers)
        self.vocab_size: int = cfg.vocab_size
        self.dtype = self.embed.weight.dtype
        self.device = self.embed.weight.device

    @torch.inference_mode()
    def forward(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        attention: Attention,
        lora: LoraBatch | None = None,
        all_logits: bool = False,
    ) -> torch.Tensor:
        """ids, positions: [B, T] -> float32 logits [B, V] of the last position ([B, T, V] if all_logits)."""
        h = self.embed(ids)  # [B, T, hidden]
        cos, sin = self.rotary(h, positions)  # [B, T, D]
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        for i, layer in enumerate(self.layers):
            h = h + self._attention(i, layer, layer.input_layernorm(h), cos, sin, attention, lora)
            h = h + self._mlp(i, layer.mlp, layer.post_attention_layernorm(h), lora)
        if not all_logits:
            h = h[:, -1]
        return self.lm_head(self.norm(h)).float()

    def _attention(self, i: int, layer: nn.Module, x: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor, attention: Attention, lora: LoraBatch | None) -> torch.Tensor:
        attn = layer.self_attn
        b, t, _ = x.shape
        q = _proj(attn.q_proj, x, i, "q_proj", lora).view(b, t, -1, self.head_dim)
        k = _proj(attn.k_proj, x, i, "k_proj", lora).view(b, t, -1, self.head_dim)
        v = _proj(attn.v_proj, x, i, "v_proj", lora).view(b, t, -1, self.head_dim)
        if hasattr(attn, "q_norm"):  # Qwen3: per-head RMSNorm before rotary
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, heads, T, D]
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        out = attention.attend(i, q, k, v)  # [B, H, T, D]
        out = out.transpose(1, 2).reshape(b, t, -1)
        return _proj(attn.o_proj, out, i, "o_proj", lora)

    def _mlp(self, i: int, mlp: nn.Module, x: torch.Tensor, lora: LoraBatch | None) -> torch.Tensor:
        gate = _proj(mlp.gate_proj, x, i, "gate_proj", lora)
        up = _proj(mlp.up_proj, x, i, "up_proj", lora)
        return _proj(mlp.down_proj, mlp.act_fn(gate) * up, i, "down_proj", lora)


def _proj(linear: nn.Module, x: torch.Tensor, layer: int, name: str, lora: LoraBatch | None) -> torch.Tensor:
    y = linear(x)
    if lora is not None:
        y = lora.apply(layer, name, x, y)
    return y


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _check_layer(i: int, layer: nn.Module) -> None:
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    missing = [f"self_attn.{n}" for n in ATTN_PROJ if not hasattr(attn, n)]
    missing += [f"mlp.{n}" for n in (*MLP_PROJ, "act_fn") if not hasattr(mlp, n)]
    missing += [n for n in ("input_layernorm", "post_attention_layernorm") if not hasattr(layer, n)]
    if missing:
        raise UnsupportedModel(f"layer {i} lacks {', '.join(missing)} (Llama/Qwen layout expected)")


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past: int, scale: float) -> torch.Tensor:
    """Attention of T new queries over past+T keys; query t sees keys [0, past + t].

    q: [B, H, T, D], k/v: [B, KVH, past+T, D].
    """
    t = q.shape[2]
    if past == 0:
        return nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    keys = torch.arange(past + t, device=q.device)
    mask = keys[None, :] <= (torch.arange(t, device=q.device) + past)[:, None]  # [T, past+T]
    return nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
