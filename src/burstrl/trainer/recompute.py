"""Activation checkpointing for long rollouts: `none`, `full`, or selective `attention` recomputation.

Agentic rollouts are long, and keeping every activation of a long sequence does not fit. The modes
(`trainer.activation_checkpointing`):

- `none`: every activation is kept. Fastest; memory grows with layers x tokens x (everything a
  layer makes: norms, q/k/v, attention, MLP, LoRA intermediates).
- `full`: each decoder layer keeps only its input; the backward reruns the whole layer first (one
  more forward, attention included).
- `attention`: per-layer non-reentrant checkpointing with a selective policy: the outputs of the
  attention op (its output and log-sum-exp) are saved in the forward; everything else (norms,
  projections, rotary, LoRA, MLP) is recomputed. Attention is the part whose cost grows with S^2,
  and its backward needs only q, k, v (cheap to recompute) plus out and lse, so at long context the
  step time is close to `none` and the memory close to `full`.

Memory of `attention` over `full`: per layer, out [tokens, heads, d] in the activation dtype and
lse [tokens, heads] in float32, i.e. about L x tokens x heads x (2d + 4) bytes in bf16 (4d + 4 in
float32), divided by the tensor-parallel degree (heads are split across ranks). For Qwen3-8B
(36 layers, 32 heads, d 128) at 32k tokens in bf16: 36 x 32768 x 32 x 260 B = 9.1 GiB, about as much
again as `full` keeps (out has the size of a layer's input). docs/long-context.md has the table.

The policy finds the attention op through the dispatcher by name (`ATTENTION_OPS`, plus every op
made by `model.attention.register_attention_kernel`). A kernel it cannot see would be recomputed
silently, so `Recompute.verify` fails loudly when a forward saved a number of attention outputs
other than the number of layers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

Mode = Literal["none", "full", "attention"]
MODES: tuple[str, ...] = ("none", "full", "attention")

# Attention forward ops whose outputs the `attention` policy saves (schema names).
ATTENTION_OPS: frozenset[str] = frozenset({
    "aten::_scaled_dot_product_flash_attention",  # SDPA flash (CUDA)
    "aten::_scaled_dot_product_efficient_attention",  # SDPA memory-efficient
    "aten::_scaled_dot_product_cudnn_attention",  # SDPA cuDNN
    "aten::_scaled_dot_product_flash_attention_for_cpu",  # SDPA flash (CPU)
    "aten::_scaled_dot_product_fused_attention_overrideable",  # SDPA on out-of-tree backends
    "aten::_flash_attention_forward",
    "aten::_efficient_attention_forward",
    "flash_attn::_flash_attn_forward",  # flash-attn 2 (>= 2.7 registers torch ops)
    "flash_attn::_flash_attn_varlen_forward",
    "flash_attn_3::fwd",  # flash-attn 3 (hopper)
    "flash_attn_3::_flash_attn_forward",
})


class RecomputeError(RuntimeError):
    """The attention policy did not see one attention op per layer: it would recompute silently."""


def is_attention_op(op: Any) -> bool:
    """Whether `op` (an OpOverload) is an attention forward whose outputs the policy keeps."""
    from burstrl.model.attention import REGISTERED

    name = op._schema.name if hasattr(op, "_schema") else str(op)
    return name in ATTENTION_OPS or name in REGISTERED


@dataclass
class Recompute:
    """The mode applied to one model, and the count of attention outputs saved by the last forward."""

    mode: str
    layers: int
    saved: int = 0
    unknown: set[str] = field(default_factory=set)  # attention-like op names the policy did not keep

    def policy(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if is_attention_op(op):
            if not ctx.is_recompute:
                self.saved += 1
            return CheckpointPolicy.MUST_SAVE
        if not ctx.is_recompute:
            name = getattr(getattr(op, "_schema", None), "name", str(op))
            if "attention" in name or "attn" in name:
                self.unknown.add(name)
        return CheckpointPolicy.PREFER_RECOMPUTE

    def context(self) -> tuple[Any, Any]:
        """`context_fn` of torch.utils.checkpoint: a fresh pair of selective contexts per layer call."""
        return create_selective_checkpoint_contexts(self.policy)

    def begin(self) -> None:
        """Start counting the saves of one forward pass (call before each training forward)."""
        self.saved = 0

    def verify(self) -> None:
        """After a training forward: under `attention`, exactly one saved attention op per layer."""
        if self.mode != "attention" or self.saved == self.layers:
            return
        seen = f" (attention-like ops seen: {', '.join(sorted(self.unknown))})" if self.unknown else ""
        raise RecomputeError(
            f"activation_checkpointing = 'attention' saved {self.saved} attention outputs in one forward, "
            f"expected {self.layers} (one per layer){seen}: the model's attention kernel is not one the policy "
            "can see, so it would be recomputed silently. Use trainer.attention = 'burstrl' (a custom op the "
            "policy keeps) or wrap the kernel with burstrl.model.attention.register_attention_kernel.")


def checkpointed_layers(model: torch.nn.Module) -> int:
    """Decoder layers with checkpointing switched on (transformers' GradientCheckpointingLayer)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return sum(1 for m in model.modules() if isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing)


def apply(model: torch.nn.Module, mode: str) -> Recompute:
    """Switch `model` (an HF model or a PEFT wrapper of one) to `mode`; return its save counter."""
    if mode not in MODES:
        raise ValueError(f"unknown activation_checkpointing {mode!r}; expected one of {', '.join(MODES)}")
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if mode == "none":
        if getattr(base, "is_activation_checkpointing", False):
            base.activation_checkpointing_disable()
        return Recompute(mode, 0)
    rec = Recompute(mode, 0)
    kwargs: dict[str, Any] = {"use_reentrant": False}
    if mode == "attention":
        kwargs["context_fn"] = rec.context
    base.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    rec.layers = checkpointed_layers(base)
    if rec.layers == 0:
        raise ValueError(f"{type(base).__name__} has no checkpointable decoder layers")
    return rec


def count_attention_calls(fn: Any) -> int:
    """Run `fn()` and count the attention forward ops the dispatcher saw (tests and benchmarks)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class _Counter(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if is_attention_op(func):
                self.calls += 1
            return func(*args, **(kwargs or {}))

    counter = _Counter()
    with counter:
        fn()
    return counter.calls
