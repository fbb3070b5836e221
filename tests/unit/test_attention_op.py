"""`burstrl::attention` (out, lse) and its registered backward against a float64 reference."""

from __future__ import annotations

import pytest
import torch

from burstrl.model.attention import attention, reference_backward, reference_forward, register_attention_kernel
from burstrl.trainer.recompute import is_attention_op


def naive(q, k, v, mask, causal: bool, scale: float):
    """Textbook softmax attention in whatever dtype it is given (float64 here), autograd for the backward."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = q @ k.transpose(-1, -2) * scale
    if mask is not None:
        s = s + mask
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(s, -1) @ v, torch.logsumexp(s, -1)


def inputs(heads_kv: int, seq: int = 300, padded: bool = False, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 4, seq, 16, generator=g, dtype=torch.float64)
    k = torch.randn(2, heads_kv, seq, 16, generator=g, dtype=torch.float64)
    v = torch.randn(2, heads_kv, seq, 16, generator=g, dtype=torch.float64)
    mask = None
    if padded:  # row 1's last 40 keys are padding, plus causal, as one additive mask
        keep = torch.ones(2, 1, seq, seq, dtype=torch.bool).tril()
        keep[1, :, :, seq - 40:] = False
        keep[1, :, seq - 40:, :] = True  # padding query rows see everything (finite, unused)
        mask = torch.zeros(keep.shape, dtype=torch.float64).masked_fill(~keep, -1e9)
    return q, k, v, mask


def reference_grads(q, k, v, mask, causal, scale, grad_out, grad_lse=None):
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = naive(*leaves, mask, causal, scale)
    total = (out * grad_out).sum() + ((lse * grad_lse).sum() if grad_lse is not None else 0)
    total.backward()
    return out.detach(), lse.detach(), [t.grad for t in leaves]


CASES = [(4, True, False), (4, False, False), (2, True, False), (2, False, False), (1, True, False),
         (4, False, True), (2, False, True)]  # (key/value heads of 4 query heads, causal, padding mask)


@pytest.mark.parametrize("heads_kv,causal,padded", CASES)
def test_the_op_matches_float64_forward_and_backward(heads_kv: int, causal: bool, padded: bool) -> None:
    q, k, v, mask = inputs(heads_kv, padded=padded)
    grad_out = torch.randn(q.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    out64, lse64, grads64 = reference_grads(q, k, v, mask, causal, 0.25, grad_out)
    qf, kf, vf = (t.float().requires_grad_() for t in (q, k, v))
    out, lse = attention(qf, kf, vf, None if mask is None else mask.float(), causal, 0.25)
    (out * grad_out.float()).sum().backward()
    assert out.dtype == torch.float32 and lse.dtype == torch.float32 and lse.shape == q.shape[:3]
    assert (out.double() - out64).abs().max() < 1e-5
    assert (lse.double() - lse64).abs().max() < 1e-5
    for got, want in zip((qf.grad, kf.grad, vf.grad), grads64, strict=False):
        assert got.shape == want.shape  # GQA: key/value gradients folded back onto their own heads
        assert (got.double() - want).abs().max() < 1e-5


@pytest.mark.parametrize("heads_kv,causal,padded", CASES)
def test_the_blockwise_reference_kernel_matches_float64(heads_kv: int, causal: bool, padded: bool) -> None:
    q, k, v, mask = inputs(heads_kv, seq=600, padded=padded)  # > 2 blocks of 256 query rows
    g = torch.Generator().manual_seed(2)
    grad_out = torch.randn(q.shape, dtype=torch.float64, generator=g)
    grad_lse = torch.randn(q.shape[:3], dtype=torch.float64, generator=g)
    out64, lse64, grads64 = reference_grads(q, k, v, mask, causal, 0.25, grad_out, grad_lse)
    qf, kf, vf, mf = (t.float() if t is not None else None for t in (q, k, v, mask))
    out, lse = reference_forward(qf, kf, vf, mf, causal, 0.25)
    assert (out.double() - out64).abs().max() < 1e-5 and (lse.double() - lse64).abs().max() < 1e-5
    grads = reference_backward(grad_out.float(), grad_lse.float(), qf, kf, vf, mf, out, lse, causal, 0.25)
    for got, want in zip(grads, grads64, strict=False):
        assert (got.double() - want).abs().max() < 1e-4


def _blockwise(q, k, v, mask, is_causal, scale):
    return reference_forward(q, k, v, mask, is_causal, scale)


def _blockwise_backward(grad_out, grad_lse, q, k, v, mask, out, lse, is_causal, scale):
    return reference_backward(grad_out, grad_lse, q, k, v, mask, out, lse, is_causal, scale)


wrapped = register_attention_kernel("test_wrapped_kernel", _blockwise, _blockwise_backward)


def test_a_wrapped_kernel_is_one_op_the_policy_keeps_and_its_backward_is_used() -> None:
    assert is_attention_op(torch.ops.burstrl.test_wrapped_kernel.default)
    assert is_attention_op(torch.ops.burstrl.attention.default)
    assert not is_attention_op(torch.ops.aten.mm.default)
    q, k, v, _ = inputs(2, seq=40)
    grad_out = torch.randn(q.shape, dtype=torch.float64)
    _, _, grads64 = reference_grads(q, k, v, None, True, 0.25, grad_out)
    qf, kf, vf = (t.float().requires_grad_() for t in (q, k, v))
    out, _ = wrapped(qf, kf, vf, None, True, 0.25)
    assert out.grad_fn is not None
    (out * grad_out.float()).sum().backward()
    assert (kf.grad.double() - grads64[1]).abs().max() < 1e-5


def test_a_model_on_the_op_computes_what_it_computes_on_sdpa(tiny_model_dir) -> None:
    from burstrl.model.hf import load_model

    ids = torch.randint(3, 2000, (2, 48), generator=torch.Generator().manual_seed(0))
    attn = torch.ones(2, 48, dtype=torch.long)
    attn[1, 30:] = 0
    sdpa = load_model(tiny_model_dir, "float32", "cpu", "sdpa")
    ours = load_model(tiny_model_dir, "float32", "cpu", "burstrl")
    with torch.no_grad():
        a = sdpa(input_ids=ids, attention_mask=attn, use_cache=False).logits
        b = ours(input_ids=ids, attention_mask=attn, use_cache=False).logits
    assert (a[0] - b[0]).abs().max() < 1e-4 and (a[1, :30] - b[1, :30]).abs().max() < 1e-4
    with pytest.raises(ValueError, match="unknown attention"):
        load_model(tiny_model_dir, "float32", "cpu", "flash")
