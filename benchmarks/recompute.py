"""Recompute benchmark: step time and peak memory of none / full / attention activation checkpointing.

One process, one model, the three modes switched on it in a rotating order within each round (so
drift on a shared machine hits every mode alike). A step = forward + the trainer's token-logprob
loss + backward of a LoRA model on one sequence of S tokens; the median over rounds is reported.
Peak memory is measured in one extra untimed step per mode: on CPU with `burstrl.trainer.memory.
PeakMemory` (bytes of tensors allocated by the step; weights excluded), on CUDA with
`torch.cuda.max_memory_allocated` minus what was allocated before the step.

Default model: Qwen3-shaped, 4 layers, hidden 256, 4 heads of 64 (2 key/value heads), MLP 768,
vocabulary 2048, random weights, LoRA rank 8 on every projection, float32 on CPU.

    .venv/bin/python benchmarks/recompute.py                         # 2k, 4k, 8k tokens, 3 rounds (~6 min)
    .venv/bin/python benchmarks/recompute.py --lengths 1024 --rounds 1   # smoke test
    # on a GPU, a real checkpoint's shape at 8k and 32k:
    python benchmarks/recompute.py --device cuda --dtype bfloat16 --model /path/to/Qwen3-8B --lengths 8192,32768
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from burstrl.trainer import recompute
from burstrl.trainer.memory import PeakMemory, mib

MODES = ("none", "full", "attention")


def build(args: argparse.Namespace) -> torch.nn.Module:
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM, Qwen3Config

    from burstrl.model.hf import resolve_dtype
    from burstrl.model.lora import lora_config

    dtype = resolve_dtype(args.dtype, args.device)
    torch.manual_seed(0)
    if args.attention == "burstrl":
        from burstrl.model.attention import register_with_transformers

        register_with_transformers()
    if args.model:
        base = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype, attn_implementation=args.attention)
    else:
        cfg = Qwen3Config(vocab_size=2048, hidden_size=args.hidden, intermediate_size=3 * args.hidden,
                          num_hidden_layers=args.layers, num_attention_heads=args.heads,
                          num_key_value_heads=args.kv_heads, head_dim=args.hidden // args.heads,
                          max_position_embeddings=max(args.lengths) + 1, tie_word_embeddings=True,
                          attn_implementation=args.attention)
        base = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    model = get_peft_model(base.to(args.device), lora_config(8, init_random=True))
    model.train()
    return model


def step(model: torch.nn.Module, rec: recompute.Recompute, ids: torch.Tensor) -> None:
    """One training forward/backward with the trainer's loss shape (token logprobs of the sequence)."""
    model.zero_grad(set_to_none=True)
    rec.begin()
    logits = model(input_ids=ids, use_cache=False).logits[:, :-1].float()
    rec.verify()
    logp = logits.gather(-1, ids[:, 1:, None])[..., 0] - torch.logsumexp(logits, dim=-1)
    (-logp.mean()).backward()


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(model: torch.nn.Module, rec: recompute.Recompute, ids: torch.Tensor, device: str) -> float:
    sync(device)
    t0 = time.perf_counter()
    step(model, rec, ids)
    sync(device)
    return time.perf_counter() - t0


def peak_bytes(model: torch.nn.Module, rec: recompute.Recompute, ids: torch.Tensor, device: str) -> int:
    if device.startswith("cuda"):
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step(model, rec, ids)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before
    model.zero_grad(set_to_none=True)
    with PeakMemory() as mem:
        step(model, rec, ids)
    return mem.peak


def measure(model: torch.nn.Module, length: int, rounds: int, device: str) -> dict[str, dict[str, float]]:
    vocab = model.get_base_model().config.vocab_size
    ids = torch.randint(3, vocab, (1, length), generator=torch.Generator().manual_seed(length)).to(device)
    times: dict[str, list[float]] = {m: [] for m in MODES}
    step(model, recompute.apply(model, "none"), ids)  # warm-up: allocator, kernels, thread pools
    for r in range(rounds):
        order = MODES[r % 3:] + MODES[:r % 3]
        for mode in order:
            times[mode].append(timed(model, recompute.apply(model, mode), ids, device))
        print(f"  {length} tokens, round {r + 1}/{rounds}: "
              + ", ".join(f"{m} {times[m][-1]:.2f} s" for m in MODES), flush=True)
    out = {}
    for mode in MODES:
        peak = peak_bytes(model, recompute.apply(model, mode), ids, device)
        out[mode] = {"step_s": statistics.median(times[mode]), "times": times[mode], "peak_mib": mib(peak)}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lengths", default="2048,4096,8192", help="Sequence lengths, comma-separated.")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto", help="auto = float32 on CPU, bfloat16 on cuda.")
    p.add_argument("--attention", default="sdpa", choices=["sdpa", "burstrl"])
    p.add_argument("--model", default="", help="A model directory (its shape and weights); default: random.")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--threads", type=int, default=0, help="torch threads; 0 = torch's default.")
    p.add_argument("--out", default="", help="Write the results as JSON here.")
    args = p.parse_args()
    args.lengths = [int(x) for x in args.lengths.split(",")]
    if args.threads:
        torch.set_num_threads(args.threads)
    model = build(args)
    cfg = model.get_base_model().config
    print(f"model: {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, {cfg.num_attention_heads} heads "
          f"x {cfg.head_dim}, {args.device}, {next(model.parameters()).dtype}, attention {args.attention}, "
          f"{torch.get_num_threads()} threads", flush=True)
    results = {}
    for length in args.lengths:
        results[length] = r = measure(model, length, args.rounds, args.device)
        full, attn, none = r["full"], r["attention"], r["none"]
        print(f"{length:>6} tokens | " + " | ".join(f"{m} {r[m]['step_s']:.2f} s {r[m]['peak_mib']:.0f} MiB"
                                                    for m in MODES)
              + f" | attention vs full: time {attn['step_s'] / full['step_s']:.3f} "
              f"({100 * (1 - attn['step_s'] / full['step_s']):+.1f}% faster), memory "
              f"{attn['peak_mib'] / full['peak_mib']:.3f}; vs none: time {attn['step_s'] / none['step_s']:.3f}, "
              f"memory {attn['peak_mib'] / none['peak_mib']:.3f}", flush=True)
    summary = {str(length): {**{m: {"step_s": round(r[m]["step_s"], 3), "peak_mib": round(r[m]["peak_mib"], 1)}
                                for m in MODES},
                             "attention_vs_full_time": round(r["attention"]["step_s"] / r["full"]["step_s"], 3),
                             "attention_vs_full_memory": round(r["attention"]["peak_mib"] / r["full"]["peak_mib"], 3)}
               for length, r in results.items()}
    print(json.dumps(summary))
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))


if __name__ == "__main__":
    main()
