"""The engine's own forward pass over a Hugging Face decoder (Llama / Qwen2 / Qwen3 / Gemma 3).

Why not `model(...)`: the engine decodes a batch whose sequences all have different cached
lengths, keeps each session's KV cache between calls, and mixes LoRA versions in one batch. The
HF forward knows none of that. So this module walks
the model's own submodules (embeddings, norms, projections, rotary table, MLP) with the same math,
and asks an `Attention` object to store the new keys/values and attend. Weights stay where HF
loaded them, so any checkpoint of a supported architecture works unchanged.

Gemma 3 differs from Llama in ways each handled here: four norms per block (attention and MLP
outputs are normed before the residual add), RMSNorm as x * (1 + w) computed in float32, a rope
table per layer type (local and global bases), sliding-window layers, q/k norms, scaled embeddings
(the embedding module does that) and a tied head. Anything else the start probe catches.

Shapes: B = sequences, T = new tokens per sequence, H / KVH = query / key-value heads, D = head dim.
"""

from __future__ import annotations

import inspect
import itertools
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from burstrl.inference.lora import ATTN_PROJ, MLP_PROJ, LoraBatch


class UnsupportedModel(ValueError):
    """The checkpoint's architecture does not have the Llama-style layer layout the runner needs."""


class Attention(Protocol):
    """Stores a layer's new keys/values and returns attention over everything cached so far."""

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               window: int | None = None) -> torch.Tensor:
        """q: [B, H, T, D], k/v: [B, KVH, T, D] (rotary applied) -> [B, H, T, D].

        `window`: a sliding-window layer's span; a query at position p sees keys (p - window, p].
        """
        ...


@dataclass
class _Norm:
    """An RMSNorm as one fused op: `weight` is the effective scale (Gemma's 1 + w precomputed);
    `upcast` computes in float32 and casts back, as Gemma does (Llama scales in the model dtype)."""

    weight: torch.Tensor
    eps: float
    upcast: bool

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.upcast:
            return F.rms_norm(x.float(), (x.shape[-1],), self.weight, self.eps).to(x.dtype)
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


@dataclass
class _Fused:
    """One layer's fused projections: q|k|v and gate|up as single matmuls (the modules keep views)."""

    qkv_w: torch.Tensor
    qkv_b: torch.Tensor | None
    qkv_split: tuple[int, int, int]
    gate_up_w: torch.Tensor
    gate_up_b: torch.Tensor | None
    gate_up_split: tuple[int, int]
    attn_norm: _Norm  # before attention
    mlp_norm: _Norm  # before the MLP
    attn_out_norm: _Norm | None  # Gemma: on attention's output, before the residual add
    mlp_out_norm: _Norm | None  # Gemma: on the MLP's output
    q_norm: _Norm | None
    k_norm: _Norm | None
    window: int | None  # a sliding-window layer's span
    rope: str | None  # the layer's rope table (Gemma: its layer type)


class ModelRunner:
    """Functional forward over an HF causal LM with pluggable attention storage and LoRA.

    On CPU the cost of a small model's decode step is the number of ops, not the FLOPs, so the
    runner fuses q/k/v and gate/up into single matmuls (rebinding the modules' weights as views of
    the fused tensors, so memory is not doubled and the HF model still works), uses fused RMSNorm,
    and applies rotary to queries and keys in one go. The math is the model's own.
    """

    path = "fast"

    def __init__(self, model: nn.Module) -> None:
        inner = getattr(model, "model", None)
        if inner is None or not hasattr(inner, "layers") or not hasattr(model, "lm_head"):
            raise UnsupportedModel(f"{type(model).__name__}: expected .model.layers and .lm_head")
        for i, layer in enumerate(inner.layers):
            _check_layer(i, layer)
        cfg = model.config
        _check_config(cfg, inner.layers)
        self.model = model
        self.embed = inner.embed_tokens
        self.layers = list(inner.layers)
        self.norm = _norm(inner.norm)
        self.rotary = inner.rotary_emb
        self.lm_head = model.lm_head
        self.softcap: float | None = getattr(cfg, "final_logit_softcapping", None)
        attn = self.layers[0].self_attn
        self.head_dim: int = attn.head_dim
        self.num_heads: int = cfg.num_attention_heads
        self.num_kv_heads: int = cfg.num_key_value_heads
        self.scaling: float = attn.scaling
        self.num_layers = len(self.layers)
        self.vocab_size: int = cfg.vocab_size
        self.dtype = self.embed.weight.dtype
        self.device = self.embed.weight.device
        with torch.no_grad():
            per_type = "layer_type" in inspect.signature(self.rotary.forward).parameters  # Gemma 3
            self.fused = [_fuse(layer, per_type) for layer in self.layers]
        self.layer_windows: list[int | None] = [f.window for f in self.fused]  # the KV layout's spans

    @torch.inference_mode()
    def forward(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        attention: Attention,
        lora: LoraBatch | None = None,
        all_logits: bool = False,
        select: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """ids, positions: [B, T] -> float32 logits.

        [B, V] of the last position by default; [B, T, V] with all_logits; [N, V] of the packed
        positions `select` (indices into T, B = 1) for a packed prefill.
        """
        h = self.embed(ids)  # [B, T, hidden]
        ropes = {f.rope: self._rope(h, positions, f.rope) for f in self.fused}
        for i, layer in enumerate(self.layers):
            f = self.fused[i]
            a = self._attention(i, layer, f, f.attn_norm(h), *ropes[f.rope], attention, lora)
            h = h + (f.attn_out_norm(a) if f.attn_out_norm else a)
            m = self._mlp(i, layer.mlp, f, f.mlp_norm(h), lora)
            h = h + (f.mlp_out_norm(m) if f.mlp_out_norm else m)
        if select is not None:
            h = h[0, select]
        elif not all_logits:
            h = h[:, -1]
        logits = self.lm_head(self.norm(h)).float()
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def _rope(self, h: torch.Tensor, positions: torch.Tensor, layer_type: str | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [B, T, 1, D] of one rope table, rotate_half's signs folded into sin."""
        cos, sin = self.rotary(h, positions) if layer_type is None else self.rotary(h, positions, layer_type)
        half = self.head_dim // 2
        sin = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
        return cos.unsqueeze(2), sin.unsqueeze(2)  # heads broadcast

    def _attention(self, i: int, layer: nn.Module, f: _Fused, x: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor, attention: Attention, lora: LoraBatch | None) -> torch.Tensor:
        attn = layer.self_attn
        b, t, _ = x.shape
        qkv = F.linear(x, f.qkv_w, f.qkv_b)
        if lora is not None:
            _lora_split(lora, i, ("q_proj", "k_proj", "v_proj"), x, qkv, f.qkv_split)
        qkv = qkv.view(b, t, -1, self.head_dim)  # [B, T, H + 2 KVH, D]
        h, kvh = self.num_heads, self.num_kv_heads
        if f.q_norm is not None and f.k_norm is not None:  # Qwen3, Gemma 3: per-head RMSNorm before rotary
            qk = torch.cat((f.q_norm(qkv[:, :, :h]), f.k_norm(qkv[:, :, h:h + kvh])), dim=2)
        else:
            qk = qkv[:, :, : h + kvh]
        half = self.head_dim // 2
        qk = torch.addcmul(qk * cos, qk.roll(half, dims=-1), sin)  # rotary on q and k at once
        q, k = qk[:, :, :h].transpose(1, 2), qk[:, :, h:].transpose(1, 2)  # [B, heads, T, D]
        v = qkv[:, :, h + kvh:].transpose(1, 2)
        out = attention.attend(i, q, k, v, window=f.window)  # [B, H, T, D]
        out = out.transpose(1, 2).reshape(b, t, -1)
        return _proj(attn.o_proj, out, i, "o_proj", lora)

    def _mlp(self, i: int, mlp: nn.Module, f: _Fused, x: torch.Tensor, lora: LoraBatch | None) -> torch.Tensor:
        gate_up = F.linear(x, f.gate_up_w, f.gate_up_b)
        if lora is not None:
            _lora_split(lora, i, ("gate_proj", "up_proj"), x, gate_up, f.gate_up_split)
        gate, up = gate_up.split(f.gate_up_split, dim=-1)
        return _proj(mlp.down_proj, mlp.act_fn(gate) * up, i, "down_proj", lora)


def _fuse(layer: nn.Module, rope_per_type: bool) -> _Fused:
    attn, mlp = layer.self_attn, layer.mlp
    qkv_w, qkv_b = _concat_linears(attn.q_proj, attn.k_proj, attn.v_proj)
    gate_up_w, gate_up_b = _concat_linears(mlp.gate_proj, mlp.up_proj)
    four = hasattr(layer, "pre_feedforward_layernorm")  # Gemma's sandwich norms
    qk = hasattr(attn, "q_norm")
    return _Fused(
        qkv_w=qkv_w, qkv_b=qkv_b,
        qkv_split=(attn.q_proj.out_features, attn.k_proj.out_features, attn.v_proj.out_features),
        gate_up_w=gate_up_w, gate_up_b=gate_up_b,
        gate_up_split=(mlp.gate_proj.out_features, mlp.up_proj.out_features),
        attn_norm=_norm(layer.input_layernorm),
        mlp_norm=_norm(layer.pre_feedforward_layernorm if four else layer.post_attention_layernorm),
        attn_out_norm=_norm(layer.post_attention_layernorm) if four else None,
        mlp_out_norm=_norm(layer.post_feedforward_layernorm) if four else None,
        q_norm=_norm(attn.q_norm) if qk else None, k_norm=_norm(attn.k_norm) if qk else None,
        window=getattr(attn, "sliding_window", None),
        rope=attn.layer_type if rope_per_type else None,
    )


def _concat_linears(*linears: nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Concatenate weights (and biases) along outputs; each module's weight becomes a view."""
    weight = torch.cat([m.weight.detach() for m in linears])
    has_bias = [m.bias is not None for m in linears]
    if any(has_bias) and not all(has_bias):
        raise UnsupportedModel("fused projections need all or none of q/k/v (gate/up) biased")
    bias = torch.cat([m.bias.detach() for m in linears]) if all(has_bias) else None
    start = 0
    for m in linears:
        end = start + m.out_features
        m.weight = nn.Parameter(weight[start:end], requires_grad=False)
        if bias is not None:
            m.bias = nn.Parameter(bias[start:end], requires_grad=False)
        start = end
    return weight, bias


def _norm(norm: nn.Module) -> _Norm:
    """Llama-style norms scale by w; Gemma's by 1 + w in float32 (told apart by its class name:
    both store a plain `weight`, only the forward differs)."""
    eps = float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)))
    if type(norm).__name__.startswith("Gemma"):
        return _Norm(1.0 + norm.weight.detach().float(), eps, upcast=True)
    return _Norm(norm.weight.detach(), eps, upcast=False)


def _lora_split(lora: LoraBatch, layer: int, names: tuple[str, ...], x: torch.Tensor, y: torch.Tensor,
                split: tuple[int, ...]) -> None:
    """Add each module's LoRA delta into its slice of a fused projection's output (in place)."""
    for name, part in zip(names, y.split(split, dim=-1), strict=False):
        lora.add_(layer, name, x, part)


def _proj(linear: nn.Module, x: torch.Tensor, layer: int, name: str, lora: LoraBatch | None) -> torch.Tensor:
    y = linear(x)
    if lora is not None:
        lora.add_(layer, name, x, y)
    return y


def _check_config(cfg: object, layers: nn.ModuleList) -> None:
    """Refuse what this runner would silently compute differently (the probe catches the rest)."""
    if getattr(cfg, "attn_logit_softcapping", None):
        raise UnsupportedModel("attention logit softcapping is not supported by the fast runner")
    windowed = getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True)
    if windowed and not all(hasattr(layer.self_attn, "sliding_window") for layer in layers):
        raise UnsupportedModel("a sliding window the attention modules do not say per layer (sliding_window)")


def _check_layer(i: int, layer: nn.Module) -> None:
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    missing = [f"self_attn.{n}" for n in ATTN_PROJ if not hasattr(attn, n)]
    missing += [f"mlp.{n}" for n in (*MLP_PROJ, "act_fn") if not hasattr(mlp, n)]
    missing += [n for n in ("input_layernorm", "post_attention_layernorm") if not hasattr(layer, n)]
    if missing:
        raise UnsupportedModel(f"layer {i} lacks {', '.join(missing)} (Llama/Qwen layout expected)")


class PackedTokens:
    """Several sequences' new tokens packed into one [1, sum(T)] forward (the prefill layouts'
    shared part): sequence i's tokens are positions offsets[i]:offsets[i + 1] of the pack."""

    def __init__(self, new_tokens: list[int]) -> None:
        self.new = new_tokens
        self.offsets = [0, *itertools.accumulate(new_tokens)]

    @property
    def last_positions(self) -> list[int]:
        """Index of each sequence's last new token in the packed sequence."""
        return [end - 1 for end in self.offsets[1:]]


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past: int, scale: float,
                     window: int | None = None) -> torch.Tensor:
    """Attention of T new queries over past+T keys; query t sees keys [0, past + t], or with a
    sliding `window` only keys (past + t - window, past + t].

    q: [B, H, T, D], k/v: [B, KVH, past+T, D].
    """
    t = q.shape[2]
    if past == 0 and (window is None or window >= t):
        return nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    keys = torch.arange(past + t, device=q.device)[None, :]
    rows = (torch.arange(t, device=q.device) + past)[:, None]
    mask = keys <= rows  # [T, past+T]
    if window is not None:
        mask &= keys > rows - window
    return nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, hidden: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """One query per row over its padded keys, as two small matmuls.

    q: [B, H, 1, D]; k/v: [B, KVH, W, D]; hidden: [B, 1, 1, W] True where a key is padding.
    SDPA's CPU kernels are built for long queries: for a single query they cost ~10x these matmuls.
    Query heads are grouped onto their key/value head (GQA) instead of repeating k and v.
    """
    b, h, _, d = q.shape
    kvh = k.shape[1]
    qg = q.reshape(b, kvh, h // kvh, d)  # [B, KVH, G, D]
    scores = torch.matmul(qg, k.transpose(-1, -2)) * scale  # [B, KVH, G, W]
    scores = scores.masked_fill(hidden, float("-inf")).softmax(dim=-1)
    return torch.matmul(scores, v).reshape(b, h, 1, d)
