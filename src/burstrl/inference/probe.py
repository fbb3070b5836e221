"""Prove the engine computes the model before a replica says ready.

Why: the engine runs its own forward (runner.py) or the model's forward with its own attention
(generic.py). A checkpoint whose layer math the fast runner does not know used to load, report
ready and then fail every request (Gemma 3: a 500 on each call), and one that ran without an
error would have served, and captured logprobs of, a different model. So at start a short probe
goes through the engine's real paths (a packed prefill of the first half into a session cache,
then one decode step per token, both over paged KV blocks) and through the model's own HF forward;
the replica serves only with a path whose log-probabilities agree within a tolerance, and
refuses to start otherwise, naming the mismatch.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
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
# Largest |log p(engine) - log p(HF)| over the probe's positions and the vocabulary. fp32 paths
# differ by reordered sums (~1e-5 on the test models); 16-bit ones by rounding of every op.
TOLERANCE = {torch.float32: 1e-3, torch.float64: 1e-6, torch.bfloat16: 0.25, torch.float16: 0.1}


def probe_ids(vocab_size: int, n: int = PROBE_TOKENS) -> torch.Tensor:
    """[1, n] fixed pseudo-random token ids (seeded, so every start probes the same)."""
    gen = torch.Generator().manual_seed(1234)
    return torch.randint(0, vocab_size, (1, n), generator=gen)


@torch.inference_mode()
def reference_logprobs(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """[n, V] float32 log-probabilities of the model's own HF forward (its configured attention)."""
    logits = model(input_ids=ids.to(model.device), use_cache=False).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


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


def mismatch(runner: Runner, reference: torch.Tensor, ids: torch.Tensor,
             adapter: LoraAdapter | None = None) -> tuple[str | None, float]:
    """(None, max |dlogp|) if the runner agrees with the reference; else (what went wrong, error)."""
    try:
        got = engine_logprobs(runner, ids, adapter=adapter)
    except Exception as exc:  # the point: any failure of the path is a refusal, named
        return f"the {runner.path} path failed on the probe ({type(exc).__name__}: {exc})", float("inf")
    tol = TOLERANCE.get(runner.dtype, 0.1)
    err = float((got - reference).abs().max())
    if not err <= tol:  # also catches NaN
        return (f"the {runner.path} path's log-probabilities differ from the model's own forward by "
                f"{err:.3g} (tolerance {tol:g} for {runner.dtype})"), err
    return None, err


def select_runner(model: nn.Module, path: str = "auto") -> tuple[Runner, float]:
    """The fastest engine path proven exact on this model, and its probe error; else UnsupportedModel.

    The fast runner is tried first; a model it does not compute (or cannot build) goes to the
    generic path. `path` "fast" or "generic" tries only that one (the `engine.path` setting). The reference is computed before either is built: the generic runner switches
    the model's attention implementation to the engine's.
    """
    ids = probe_ids(int(model.config.vocab_size))
    reference = reference_logprobs(model, ids)
    why = []
    for build in (ModelRunner, GenericRunner):
        if path not in ("auto", build.path):
            continue
        try:
            runner = build(model)
        except UnsupportedModel as exc:
            why.append(f"{build.path}: {exc}")
            continue
        problem, err = mismatch(runner, reference, ids)
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
    the hooks and the generic path's attention switch touch the served model for the call."""
    ids = probe_ids(runner.vocab_size)
    with _native_attention(runner), _lora_hooks(runner.layers, adapter):
        reference = reference_logprobs(runner.model, ids)
    return mismatch(runner, reference, ids, adapter)


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
            return out + scale * (args[0] @ a.T) @ b.T

        handles.append(getattr(parent, name).register_forward_hook(add))
    try:
        yield
    finally:
        for h in handles:
            h.remove()
