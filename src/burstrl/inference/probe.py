"""Prove the engine computes the model before a replica says ready.

Why: the engine runs its own forward (runner.py) or the model's forward with its own attention
(generic.py). A checkpoint whose layer math the fast runner does not know used to load, report
ready and then fail every request (Gemma 3: a 500 on each call), and one that ran without an
error would have served, and captured logprobs of, a different model. So at start a short probe
goes through the engine's real paths (a packed prefill of the first half into a session cache,
then one decode step per token, both over paged KV blocks) and through the model's own HF forward;
the replica serves only with a path whose log-probabilities agree within a tolerance, and
refuses to start otherwise, naming the mismatch.

The reference is always a float32 forward of the served weights (a 16-bit model is upcast into a
temporary copy, see `fp32_reference`): HF's own bf16 forward is no reference (on Gemma 3 270M its
cached and uncached bf16 forwards differ by 1.9 in log-probability, and the engine's bf16 path
differed from it by 1.8: two roundings of one model, compared with each other). The tolerance is
set by the serving dtype: a bound on the largest |dlogp| for float32 (`TOLERANCE`), and for a
16-bit engine a bound on how far it may be from the fp32 forward relative to how far HF's own
16-bit forward is from it (`KL_TOLERANCE`).
"""

from __future__ import annotations

import copy
import gc
import logging
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Union

import torch
from torch import nn

from burstrl.inference.generic import GenericRunner
from burstrl.inference.lora import ATTN_PROJ, MLP_PROJ, LoraAdapter, LoraBatch
from burstrl.inference.paged import KVPool, SequenceKV
from burstrl.inference.paged_attention import PagedDecode, PagedPrefill
from burstrl.inference.runner import ModelRunner, UnsupportedModel

log = logging.getLogger(__name__)

Runner = Union[ModelRunner, GenericRunner]
PROBE_TOKENS = 24
# float32 (and float64) engines: the largest |log p(engine) - log p(reference)| over the probe's
# positions and the vocabulary. Their paths differ from the reference by reordered sums only
# (~1e-5 on the test models), so any wrong op shows.
TOLERANCE = {torch.float32: 1e-3, torch.float64: 1e-6}
# 16-bit engines: that maximum is no test. Every op rounds, and on a few positions of a random
# probe the rounding tips the model into another state: HF's own bf16 forward of Gemma 3 270M is
# 5.3 off its fp32 forward at one position of one probe, the engine's bf16 paths 0.8-6.2 over six
# probes, while a layer given the wrong rope table is 3.4 off. And how far rounding moves a model
# depends on the model (a random-init test model's distributions are nearly flat: 1e-6 nats where
# Gemma's are 0.005). So a 16-bit path must be as close to the fp32 forward as the model's own HF
# forward in that dtype is: in each half of the probe (the packed prefill, the decode steps), the
# median over positions of KL(fp32 || engine) within `factor` times the same median for HF's own
# 16-bit forward, but at least `floor` and at most `cap` nats (the cap in case HF's own forward is
# itself far off). Measured (probe seeds 1234, 0, 3, and 7 on the test models; both paths; per
# half): engine / HF 0.4-2.1 on the test models, 0.5-1.25 on Gemma 3 270M in bf16; a wrong path on Gemma 3 270M (the worse
# half): a layer given the other rope table 6.4-33x, one layer's o_proj perturbed by 10% of its
# scale 5.9-24x, a norm as w instead of 1 + w 78-330x; on the test models 11-8000x (tests/unit/
# test_probe.py). A perturbation below bf16's own resolution (3% on one layer, a norm scaled by
# 1.05) passes: at this dtype it is noise. float16 gets the same rule (not measured on Gemma 3, whose
# activations overflow float16: NaN, refused).
KL_TOLERANCE = {torch.bfloat16: (4.0, 1e-6, 0.05), torch.float16: (4.0, 1e-6, 0.05)}  # factor, floor, cap


def probe_ids(vocab_size: int, n: int = PROBE_TOKENS) -> torch.Tensor:
    """[1, n] fixed pseudo-random token ids (seeded, so every start probes the same)."""
    gen = torch.Generator().manual_seed(1234)
    return torch.randint(0, vocab_size, (1, n), generator=gen)


def reference_logprobs(model: nn.Module, ids: torch.Tensor, adapter: LoraAdapter | None = None) -> torch.Tensor:
    """[n, V] float32 log-probabilities of the model's own HF forward (its configured attention),
    computed in float32 whatever dtype the model serves in (`fp32_reference`); with `adapter`, its
    LoRA added as PEFT defines it (`_lora_hooks`)."""
    with fp32_reference(model) as reference:
        return _logprobs(reference, ids, adapter)


def own_logprobs(model: nn.Module, ids: torch.Tensor, adapter: LoraAdapter | None = None) -> torch.Tensor | None:
    """[n, V] log-probabilities of the model's own HF forward in the dtype it serves in, the yardstick
    of a 16-bit path (`KL_TOLERANCE`); None for a float32 or float64 model."""
    if _dtype(model) not in KL_TOLERANCE:
        return None
    return _logprobs(model, ids, adapter)


@torch.inference_mode()
def _logprobs(model: nn.Module, ids: torch.Tensor, adapter: LoraAdapter | None) -> torch.Tensor:
    with _lora_hooks(list(model.model.layers), adapter) if adapter is not None else nullcontext():
        logits = model(input_ids=ids.to(model.device), use_cache=False).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def _dtype(model: nn.Module) -> torch.dtype:
    return model.get_input_embeddings().weight.dtype


@contextmanager
def fp32_reference(model: nn.Module) -> Iterator[nn.Module]:
    """The model itself if every floating weight is float32 (or float64); else a float32 copy of it
    (same weights upcast, same buffers upcast, same config, on the same device), dropped on exit.

    Memory: the copy costs 4 bytes per parameter beside the served model while it lives (Gemma 3
    270M in bf16: ~1.1 GB next to its 0.54 GB; an 8B model: 32 GB), for the reference forward
    only: the start probe makes it before the KV pool is allocated, a LoRA version's probe between
    two engine steps. The served model is not touched (upcasting it in place would break the fast
    runner's fused views of its projections). Nothing is built for a float32 model.
    """
    floats = [t for t in (*model.parameters(), *model.buffers()) if t.is_floating_point()]
    if all(t.dtype in (torch.float32, torch.float64) for t in floats):
        yield model
        return
    memo: dict[int, object] = {}
    with torch.inference_mode(False), torch.no_grad():
        for p in model.parameters():  # tied weights stay tied: one entry per tensor
            memo[id(p)] = nn.Parameter(p.detach().float() if p.is_floating_point() else p.detach(),
                                       requires_grad=False)
        for b in model.buffers():
            memo[id(b)] = b.detach().float() if b.is_floating_point() else b
        reference = copy.deepcopy(model, memo)
    del memo
    try:
        yield reference
    finally:
        del reference
        gc.collect()
        if floats[0].device.type == "cuda":  # hand the copy's memory back for the KV pool
            torch.cuda.empty_cache()


@torch.inference_mode()
def engine_logprobs(runner: Runner, ids: torch.Tensor, block_size: int = 4,
                    adapter: LoraAdapter | None = None) -> torch.Tensor:
    """[n, V] through the engine's paths: a paged packed prefill of the first half, then one paged
    decode step per token (small blocks, so the probe crosses block boundaries); with `adapter`,
    its LoRA applied as the engine applies it (batched, per token in the prefill)."""
    n, half = ids.shape[1], ids.shape[1] // 2
    prefill_lora = LoraBatch([adapter] * half, per_token=True) if adapter is not None else None
    decode_lora = LoraBatch([adapter]) if adapter is not None else None
    ids = ids.to(runner.device)
    pool = KVPool.for_tokens(-(-n // block_size) * block_size, runner.num_layers, runner.num_kv_heads,
                             runner.head_dim, runner.dtype, runner.device, block_size, runner.layer_windows)
    table = SequenceKV.new(pool)  # the engine's layer groups (sliding-window layers apart)
    prefill = PagedPrefill(pool, [table], [half], runner.scaling)
    positions = torch.arange(half, device=runner.device)[None]
    rows = [runner.forward(ids[:, :half], positions, prefill, prefill_lora, all_logits=True)[0]]
    prefill.commit()
    for t in range(half, n):
        step = PagedDecode(pool, [table], runner.scaling)
        step.prepare()
        rows.append(runner.forward(ids[:, t:t + 1], step.positions, step, decode_lora))
        step.advance()
    return torch.log_softmax(torch.cat(rows).float(), dim=-1)


def mismatch(runner: Runner, reference: torch.Tensor, ids: torch.Tensor, adapter: LoraAdapter | None = None,
             own: torch.Tensor | None = None) -> tuple[str | None, float]:
    """(None, max |dlogp|) if the runner agrees with the float32 `reference` within its dtype's
    tolerance (`TOLERANCE`; for 16-bit, `KL_TOLERANCE` against `own`, the model's own forward in
    that dtype); else (what went wrong, max |dlogp|)."""
    try:
        got = engine_logprobs(runner, ids, adapter=adapter)
    except Exception as exc:  # the point: any failure of the path is a refusal, named
        return f"the {runner.path} path failed on the probe ({type(exc).__name__}: {exc})", float("inf")
    err = float((got - reference).abs().max())
    differ = f"the {runner.path} path's log-probabilities differ from the model's own forward (float32)"
    if runner.dtype in KL_TOLERANCE:
        factor, floor, cap = KL_TOLERANCE[runner.dtype]
        half = ids.shape[1] // 2
        for part, rows in (("prefill", slice(0, half)), ("decode", slice(half, None))):
            kl = median_kl(reference[rows], got[rows])
            own_kl = median_kl(reference[rows], own[rows]) if own is not None else cap / factor
            bound = min(cap, max(floor, factor * own_kl))
            if not kl <= bound:  # also catches NaN
                return (f"{differ}: median KL {kl:.3g} over the probe's {part} positions, more than {bound:.3g} "
                        f"({factor:g}x the model's own {runner.dtype} forward's {own_kl:.3g}, at least {floor:g}, "
                        f"at most {cap:g}); max |dlogp| {err:.3g}"), err
        return None, err
    tol = TOLERANCE.get(runner.dtype, 1e-3)
    if not err <= tol:  # also catches NaN
        return f"{differ} by {err:.3g} (tolerance {tol:g} for {runner.dtype})", err
    return None, err


def median_kl(reference: torch.Tensor, got: torch.Tensor) -> float:
    """Median over positions (rows) of KL(reference || got), both [n, V] log-probabilities; NaN
    or inf where the engine gives NaN, or -inf to a token the reference gives any mass."""
    p = reference.exp()
    kl = torch.where(p > 0, p * (reference - got), torch.zeros_like(p)).sum(-1)
    if not bool(torch.isfinite(kl).all()):
        return float("nan") if bool(kl.isnan().any()) else float("inf")
    return float(kl.median())


def select_runner(model: nn.Module, path: str = "auto") -> tuple[Runner, float]:
    """The fastest engine path proven exact on this model, and its probe error; else UnsupportedModel.

    The fast runner is tried first; a model it does not compute (or cannot build) goes to the
    generic path. `path` "fast" or "generic" tries only that one (the `engine.path` setting). The
    references (the float32 forward; for a 16-bit model also its own forward in that dtype) are
    computed before either is built: the generic runner switches the model's attention
    implementation to the engine's.
    """
    ids = probe_ids(int(model.config.vocab_size))
    reference, own = reference_logprobs(model, ids), own_logprobs(model, ids)
    why = []
    for build in (ModelRunner, GenericRunner):
        if path not in ("auto", build.path):
            continue
        try:
            runner = build(model)
        except UnsupportedModel as exc:
            why.append(f"{build.path}: {exc}")
            continue
        problem, err = mismatch(runner, reference, ids, own=own)
        if problem is None:
            log.info("engine path %s proven on a %d-token probe (max |dlogp| %.2g)", runner.path, ids.shape[1], err)
            return runner, err
        why.append(problem)
    raise UnsupportedModel(f"{type(model).__name__} ({getattr(model.config, 'model_type', '?')}): no engine "
                           "path computes this model, so this replica will not serve it. " + "; ".join(why))


def adapter_mismatch(runner: Runner, adapter: LoraAdapter) -> tuple[str | None, float]:
    """The start probe again for one LoRA version: the engine's path with the adapter vs the
    model's own HF forward with the adapter applied as PEFT defines it (each target module's
    output plus scale * B(A x)), through plain forward hooks, independent of the engine's fused
    projections and batched LoRA. Must run where no engine step runs at once (the engine thread):
    the generic path's attention switch (and, for a float32 model, the hooks) touch the served
    model for the call. A 16-bit model's reference is its float32 copy (`fp32_reference`)."""
    ids = probe_ids(runner.vocab_size)
    with _native_attention(runner):
        reference, own = reference_logprobs(runner.model, ids, adapter), own_logprobs(runner.model, ids, adapter)
    return mismatch(runner, reference, ids, adapter, own)


@contextmanager
def _native_attention(runner: Runner) -> Iterator[None]:
    """The generic path swaps the model's attention for the engine's; the reference needs its own."""
    if not isinstance(runner, GenericRunner):
        yield
        return
    runner.model.set_attn_implementation(runner.native_attention)
    try:
        yield
    finally:
        runner.model.set_attn_implementation(runner.engine_attention)


@contextmanager
def _lora_hooks(layers: list[nn.Module], adapter: LoraAdapter) -> Iterator[None]:
    handles = []
    for (i, name), (a, b, scale) in adapter.weights.items():
        parent = layers[i].self_attn if name in ATTN_PROJ else layers[i].mlp
        assert name in ATTN_PROJ or name in MLP_PROJ, name

        def add(_: nn.Module, args: tuple, out: torch.Tensor, a=a, b=b, scale=scale) -> torch.Tensor:
            x = args[0]  # in the reference's dtype (float32): the version's weights upcast with it
            return out + scale * (x @ a.to(x.dtype).T) @ b.to(x.dtype).T

        handles.append(getattr(parent, name).register_forward_hook(add))
    try:
        yield
    finally:
        for h in handles:
            h.remove()
