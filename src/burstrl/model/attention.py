"""Attention as one op the dispatcher can see: `burstrl::attention`, returning (out, lse).

Why: selective recomputation (`trainer/recompute.py`) keeps the outputs of the attention op from
the forward pass and recomputes the rest of each layer in the backward. It finds that op through
the dispatcher, by name. A kernel the dispatcher cannot see (a pybind or Triton kernel called from
Python) shows up there as its pieces, or not at all, and would be recomputed silently.
`register_attention_kernel` wraps such a kernel as a `torch.library` custom op with its own
backward taking (q, k, v, out, lse), so the whole kernel is one visible op whose two outputs the
policy keeps. The built-in `burstrl::attention` runs PyTorch's CPU flash kernel on CPU and a
blockwise exact reference on other devices; `trainer.attention = "burstrl"` puts it in the model
(registered with transformers as the attention implementation "burstrl").

Shapes: q [B, Hq, S, D]; k, v [B, Hkv, T, D] with Hq a multiple of Hkv (GQA: query head h reads
key/value head h // (Hq / Hkv)); mask None or additive, broadcastable to [B, Hq, S, T], in q's
dtype; out [B, Hq, S, D] in q's dtype; lse [B, Hq, S] float32. `is_causal` is top-left aligned
(query i sees keys j <= i), as in `F.scaled_dot_product_attention`.
"""

from collections.abc import Callable
from typing import Optional

import torch

Forward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor], bool, float],
                   tuple[torch.Tensor, torch.Tensor]]
# (grad_out, grad_lse or None, q, k, v, mask, out, lse, is_causal, scale) -> (dq, dk, dv)
Backward = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]

SCHEMA = "(Tensor q, Tensor k, Tensor v, Tensor? mask, bool is_causal, float scale) -> (Tensor, Tensor)"
REGISTERED: set[str] = set()  # "burstrl::<name>" of every op made by register_attention_kernel
BLOCK = 256  # query rows per block of the reference kernel: bounds its S x T scores to BLOCK x T


def register_attention_kernel(name: str, forward: Forward, backward: Backward) -> Callable[..., tuple]:
    """Make `burstrl::<name>` a custom op (out, lse) with `backward` as its gradient; return the op.

    The recompute policy saves the outputs of every op registered here.
    """
    qualname = f"burstrl::{name}"
    op = torch.library.custom_op(qualname, forward, mutates_args=(), schema=SCHEMA)

    @op.register_fake
    def _fake(q, k, v, mask, is_causal, scale):
        return q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=torch.float32)

    def setup_context(ctx, inputs, output) -> None:
        q, k, v, mask, is_causal, scale = inputs
        out, lse = output
        ctx.save_for_backward(q, k, v, mask, out, lse)
        ctx.is_causal, ctx.scale = is_causal, scale

    def grad(ctx, grad_out, grad_lse):
        q, k, v, mask, out, lse = ctx.saved_tensors
        dq, dk, dv = backward(grad_out, grad_lse, q, k, v, mask, out, lse, ctx.is_causal, ctx.scale)
        return dq, dk, dv, None, None, None

    op.register_autograd(grad, setup_context=setup_context)
    REGISTERED.add(qualname)
    return op


# ---- the exact blockwise reference (any device) ----
def _scores(q: torch.Tensor, k: torch.Tensor, mask: Optional[torch.Tensor], is_causal: bool, scale: float,
            start: int) -> torch.Tensor:
    """Scaled scores of query rows start.. against all keys, float32: [B, H, b, T]."""
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if mask is not None:
        m = mask[..., start:start + q.shape[2], :] if mask.shape[-2] > 1 else mask
        s = s + m.float()
    if is_causal:
        rows = torch.arange(start, start + q.shape[2], device=q.device)[:, None]
        s = s.masked_fill(torch.arange(k.shape[2], device=q.device)[None, :] > rows, float("-inf"))
    return s


def _expand_kv(q: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    rep = q.shape[1] // t.shape[1]
    return t.repeat_interleave(rep, dim=1) if rep > 1 else t


def _fold_kv(grad: torch.Tensor, heads_kv: int) -> torch.Tensor:
    """Sum an expanded key/value gradient [B, Hq, T, D] back onto its Hkv heads."""
    b, h, t, d = grad.shape
    return grad.view(b, heads_kv, h // heads_kv, t, d).sum(dim=2) if h != heads_kv else grad


def reference_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor],
                      is_causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention in float32, BLOCK query rows at a time (exact; no S x T matrix at once)."""
    ke, ve = _expand_kv(q, k).float(), _expand_kv(q, v).float()
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    for start in range(0, q.shape[2], BLOCK):
        rows = slice(start, start + BLOCK)
        s = _scores(q[:, :, rows], ke, mask, is_causal, scale, start)
        lse[:, :, rows] = torch.logsumexp(s, dim=-1)
        out[:, :, rows] = torch.matmul(torch.exp(s - lse[:, :, rows, None]), ve)
    return out.to(q.dtype), lse


def reference_backward(grad_out: torch.Tensor, grad_lse: Optional[torch.Tensor], q: torch.Tensor,
                       k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor], out: torch.Tensor,
                       lse: torch.Tensor, is_causal: bool, scale: float
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The flash-attention backward from (q, k, v, out, lse): P is rebuilt from the saved lse.

    dS = P * (dP - rowsum(dO * O) + dlse), dQ = dS K scale, dK = dS^T Q scale, dV = P^T dO.
    """
    ke, ve = _expand_kv(q, k).float(), _expand_kv(q, v).float()
    go = grad_out.float()
    delta = (go * out.float()).sum(dim=-1)  # [B, H, S]
    if grad_lse is not None:
        delta = delta - grad_lse.float()
    dq = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    dk = torch.zeros(ke.shape, dtype=torch.float32, device=q.device)
    dv = torch.zeros(ve.shape, dtype=torch.float32, device=q.device)
    for start in range(0, q.shape[2], BLOCK):
        rows = slice(start, start + BLOCK)
        qb, gb = q[:, :, rows].float(), go[:, :, rows]
        p = torch.exp(_scores(q[:, :, rows], ke, mask, is_causal, scale, start) - lse[:, :, rows, None])
        dv += torch.matmul(p.transpose(-1, -2), gb)
        ds = p * (torch.matmul(gb, ve.transpose(-1, -2)) - delta[:, :, rows, None])
        dq[:, :, rows] = torch.matmul(ds, ke) * scale
        dk += torch.matmul(ds.transpose(-1, -2), qb) * scale
    hkv = k.shape[1]
    return dq.to(q.dtype), _fold_kv(dk, hkv).to(k.dtype), _fold_kv(dv, hkv).to(v.dtype)


# ---- the built-in op: CPU flash kernel on CPU, the reference elsewhere ----
def _cpu_flash_ok(q: torch.Tensor, mask: Optional[torch.Tensor]) -> bool:
    return q.device.type == "cpu" and (mask is None or mask.dtype == q.dtype)


def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor], is_causal: bool,
             scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    if _cpu_flash_ok(q, mask):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, is_causal, attn_mask=mask, scale=scale)
        return out, lse.float()
    return reference_forward(q, k, v, mask, is_causal, scale)


def _backward(grad_out, grad_lse, q, k, v, mask, out, lse, is_causal, scale):
    no_lse_grad = grad_lse is None or not bool(grad_lse.any())
    if _cpu_flash_ok(q, mask) and no_lse_grad:
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out.contiguous(), q, k, v, out, lse, 0.0, is_causal, attn_mask=mask, scale=scale)
    return reference_backward(grad_out, grad_lse, q, k, v, mask, out, lse, is_causal, scale)


attention = register_attention_kernel("attention", _forward, _backward)


# ---- transformers integration ----
def hf_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attention_mask: Optional[torch.Tensor], dropout: float = 0.0,
                         scaling: Optional[float] = None, is_causal: Optional[bool] = None,
                         **kwargs: object) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: returns out as [B, S, Hq, D] and no weights."""
    if dropout:
        raise ValueError("the burstrl attention op has no dropout; set the model's attention_dropout to 0")
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    causal = bool(query.shape[2] > 1 and attention_mask is None and causal)
    mask = attention_mask
    if mask is not None:
        mask = mask[..., : key.shape[2]]
        if mask.dtype == torch.bool:  # finfo.min, not -inf: a fully masked (padding) row stays finite
            mask = torch.zeros(mask.shape, dtype=query.dtype, device=query.device).masked_fill(
                ~mask, torch.finfo(query.dtype).min)
        else:
            mask = mask.to(query.dtype)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out, _ = attention(query, key, value, mask, causal, float(scale))
    return out.transpose(1, 2).contiguous(), None


def register_with_transformers() -> str:
    """Register the op as transformers' attention implementation "burstrl" (sdpa's mask format)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register("burstrl", hf_attention_forward)
    AttentionMaskInterface.register("burstrl", sdpa_mask)
    return "burstrl"
