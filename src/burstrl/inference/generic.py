"""The generic path: any HF causal LM through its own forward, with the engine's KV storage.

Why: the fast runner (runner.py) re-implements the Llama / Qwen layer math for speed, so a model
with another layout (Gemma 3's four norms, scaled embeddings, per-layer-type rope) would compute
something else there. Here the model's own modules run every op; only attention is swapped, via
transformers' attention-function registry, for the engine's `Attention` object (session caches,
packed prefill, the decode batch). The attention function gets keys and queries after the
model's own q/k norms and rope, exactly where the fast runner hands them over, so the engine's
cache logic is shared and the result is exact. It is slower (no fused projections).

LoRA: forward hooks on the target projections add each row's delta, as the fast runner does.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from torch import nn

from burstrl.inference.lora import ATTN_PROJ, MLP_PROJ, LoraBatch
from burstrl.inference.runner import Attention, UnsupportedModel

IMPLEMENTATION = "burstrl-engine"
_ACTIVE = threading.local()  # .attention / .lora of the forward running on this thread


def _engine_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      sliding_window: int | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature; q [B, H, T, D], k/v [B, KVH, T, D] -> [B, T, H, D]."""
    attention: Attention | None = getattr(_ACTIVE, "attention", None)
    if attention is None:
        raise RuntimeError("the burstrl-engine attention runs only inside GenericRunner.forward")
    if kwargs.get("softcap") or getattr(module, "attn_logit_softcapping", None):
        raise UnsupportedModel("attention logit softcapping is not supported by the engine's attention")
    out = attention.attend(int(module.layer_idx), query, key, value, window=sliding_window)
    return out.transpose(1, 2).contiguous(), None


def _no_mask(*args: Any, **kwargs: Any) -> None:
    """Masks are the engine's (per-sequence causal and window, in the attention object)."""
    return None


def register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(IMPLEMENTATION, _engine_attention)
    AttentionMaskInterface.register(IMPLEMENTATION, _no_mask)


class GenericRunner:
    """`ModelRunner`'s interface over the model's own forward (see the module docstring)."""

    path = "generic"

    def __init__(self, model: nn.Module) -> None:
        inner = getattr(model, "model", None)
        layers = getattr(inner, "layers", None)
        if layers is None or not hasattr(model, "lm_head"):
            raise UnsupportedModel(f"{type(model).__name__}: expected .model.layers and .lm_head")
        attn = layers[0].self_attn
        for i, layer in enumerate(layers):
            if getattr(layer.self_attn, "layer_idx", None) != i:
                raise UnsupportedModel(f"layer {i}'s attention does not know its layer_idx")
        register()
        native = str(model.config._attn_implementation)
        if native == IMPLEMENTATION:  # a second runner over the same model
            native = getattr(model, "_burstrl_native_attention", "eager")
        model._burstrl_native_attention = native
        self.native_attention = native  # the LoRA probe's reference forward uses it
        self.engine_attention = IMPLEMENTATION
        model.set_attn_implementation(IMPLEMENTATION)
        cfg = model.config
        self.model, self.inner, self.lm_head = model, inner, model.lm_head
        self.layers = list(layers)
        self.num_layers = len(self.layers)
        self.head_dim: int = int(attn.head_dim)
        self.num_heads: int = int(cfg.num_attention_heads)
        self.num_kv_heads: int = int(cfg.num_key_value_heads)
        self.scaling: float = float(attn.scaling)
        self.vocab_size: int = int(cfg.vocab_size)
        self.softcap: float | None = getattr(cfg, "final_logit_softcapping", None)
        self.dtype = self.lm_head.weight.dtype
        self.device = self.lm_head.weight.device
        self._hooks = [self._hook(i, layer) for i, layer in enumerate(self.layers)]
        self.layer_windows = self._windows()  # the KV layout's spans

    def _windows(self) -> list[int | None]:
        """Each layer's sliding window as transformers passes it to the attention call.

        Why a forward and not the config: models name it differently (Gemma 3 per layer on the
        module, Mistral once on the config, read at call time), and the KV layout must keep exactly
        the keys the call will attend to. One token through the model, attention recorded."""
        seen: dict[int, int | None] = {}

        class Recorder:
            def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       window: int | None = None) -> torch.Tensor:
                seen[layer] = window
                return torch.zeros_like(q)

        ids = torch.zeros((1, 1), dtype=torch.long, device=self.device)
        _ACTIVE.attention = Recorder()
        try:
            with torch.inference_mode():
                self.inner(input_ids=ids, position_ids=ids, use_cache=False)
        finally:
            _ACTIVE.attention = None
        return [seen.get(i) for i in range(self.num_layers)]

    def _hook(self, i: int, layer: nn.Module) -> list[Any]:
        handles = []
        for parent, names in ((layer.self_attn, ATTN_PROJ), (layer.mlp, MLP_PROJ)):
            for name in names:
                def add_lora(_: nn.Module, args: tuple, out: torch.Tensor, name: str = name) -> None:
                    lora: LoraBatch | None = getattr(_ACTIVE, "lora", None)
                    if lora is not None:
                        lora.add_(i, name, args[0], out)
                handles.append(getattr(parent, name).register_forward_hook(add_lora))
        return handles

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, positions: torch.Tensor, attention: Attention,
                lora: LoraBatch | None = None, all_logits: bool = False,
                select: torch.Tensor | None = None) -> torch.Tensor:
        """As `ModelRunner.forward`: ids, positions [B, T] -> float32 logits ([B, V], [B, T, V] or [N, V])."""
        _ACTIVE.attention, _ACTIVE.lora = attention, lora
        try:
            h = self.inner(input_ids=ids, position_ids=positions, use_cache=False).last_hidden_state
        finally:
            _ACTIVE.attention = _ACTIVE.lora = None
        if select is not None:
            h = h[0, select]
        elif not all_logits:
            h = h[:, -1]
        logits = self.lm_head(h).float()
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits
