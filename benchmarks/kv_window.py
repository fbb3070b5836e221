"""Window-only KV for sliding-window layers: memory and decode cost past the window, side by side.

Two replicas of the same model in this one process, `engine.kv_window_only` on ("window") and off
("full": every layer keeps every block, the layout before), run the same workload: S sessions whose
first call has a `--context`-token prompt (random ids, never special), `--new-tokens` greedy
tokens each, decoded together; then a second call per session that extends the first by
`--extend` tool-like ids (it resumes from the session cache, past the window). Figures, per mode:

- KV bytes per cached token after the first calls: blocks in use x bytes per block over the
  tokens the session caches hold, against the dense formula (2 x layers x KV heads x head dim x
  dtype bytes): full ~= 1.0x (block rounding), window -> (global layers + sliding layers x
  (window + margin) / context) / layers;
- sessions of this length the token budget can cache: budget blocks / blocks one session holds;
- the second calls' decode step (engine counters: decode seconds / steps; the sliding layers
  attend window + margin keys instead of the context) and prefix-cache hits (all of the first
  call's tokens should be reused in both modes);
- whether every greedy output is identical in both modes (the exactness check in fp32; in 16-bit
  dtypes a different gather width may round differently).

    .venv/bin/python benchmarks/kv_window.py --model ~/.cache/burstrl/gemma-3-270m            # ~3 min, 2 cores
    .venv/bin/python benchmarks/kv_window.py --model ~/.cache/burstrl/gemma-3-270m --quick    # ~1 min
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import sys
import tempfile
from pathlib import Path

import torch

from burstrl.config import EngineConfig, HttpServerSection, ModelConfig, ServeConfig
from burstrl.inference.replica import build_replica


def _replica_bench():
    """benchmarks/replica.py's helpers (replica start, requests, token source)."""
    path = Path(__file__).with_name("replica.py")
    spec = importlib.util.spec_from_file_location("bench_replica", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(Path.home() / ".cache/burstrl/gemma-3-270m"),
                   help="HF model dir with sliding-window layers (make gemma)")
    p.add_argument("--quick", action="store_true", help="2 sessions of 1,024 tokens")
    p.add_argument("--sessions", type=int, help="sessions decoded together [4; quick 2]")
    p.add_argument("--context", type=int, help="tokens of each first prompt [2048; quick 1024]")
    p.add_argument("--new-tokens", type=int, default=16, help="greedy tokens per call [16]")
    p.add_argument("--extend", type=int, default=32, help="ids each second call appends [32]")
    p.add_argument("--threads", type=int, default=0, help="torch threads; 0 = the engine's default")
    p.add_argument("--dtype", default="auto", help="model dtype (auto: float32 on CPU, bfloat16 on GPU)")
    p.add_argument("--device", default="auto", help="torch device (auto: cuda if available)")
    args = p.parse_args(argv)
    if args.sessions is None:
        args.sessions = 2 if args.quick else 4
    if args.context is None:
        args.context = 1024 if args.quick else 2048
    return args


def measure(bench, model_dir: Path, state: str, window_only: bool, prompts: list[list[int]],
            extensions: list[list[int]], args: argparse.Namespace) -> dict:
    budget = len(prompts) * (args.context + args.extend + 2 * args.new_tokens + 64)
    engine = EngineConfig(max_total_num_tokens=budget, kv_window_only=window_only,
                          max_running_requests=len(prompts), num_threads=args.threads)
    rep = build_replica(ServeConfig(model=ModelConfig(path=str(model_dir), dtype=args.dtype, device=args.device),
                                    engine=engine, server=HttpServerSection(admin_token="benchmark", state_dir=state)))
    try:
        engine, pool = rep.engine, rep.engine.pool
        r = engine.runner
        dense = 2 * r.num_layers * r.num_kv_heads * r.head_dim * torch.tensor([], dtype=r.dtype).element_size()
        block_bytes = pool.block_size * dense // pool.sequence_blocks  # one physical block: one layer group
        sids = [f"s{i}" for i in range(len(prompts))]
        first_s, first = bench.engine_batch(rep, prompts, args.new_tokens, "first", sids, timeout_s=1800)
        held = sum(e.table.length for e in engine.cache.idle.values())
        used = pool.used_blocks
        c0, hits0 = (engine.counters.decode_s, engine.counters.decode_steps), engine.cache.stats.hit_tokens
        second = [p + out + ext for p, out, ext in zip(prompts, first, extensions, strict=True)]
        second_s, again = bench.engine_batch(rep, second, args.new_tokens, "second", sids, timeout_s=1800)
        steps = engine.counters.decode_steps - c0[1]
        return {
            "kv_bytes_per_token": round(used * block_bytes / held, 1),
            "kv_vs_dense": round(used * block_bytes / held / dense, 3),
            "dense_bytes_per_token": dense,
            "blocks_used": used, "tokens_cached": held, "pool_blocks": pool.num_blocks,
            "layer_groups": pool.sequence_blocks,
            "sessions_per_budget": round(pool.num_blocks / (used / len(prompts)), 2),
            "second_decode_step_ms": round(1000 * (engine.counters.decode_s - c0[0]) / max(1, steps), 1),
            "second_hit_tokens": engine.cache.stats.hit_tokens - hits0,
            "window_misses": engine.cache.stats.window_misses,
            "first_calls_s": round(first_s, 2), "second_calls_s": round(second_s, 2),
            "outputs": [first, again],
        }
    finally:
        rep.close()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    bench = _replica_bench()
    from burstrl.model.hf import load_tokenizer

    model_dir = Path(args.model)
    tokenizer = load_tokenizer(model_dir)
    vocab = len(tokenizer)
    src = bench.TokenSource(vocab, list(tokenizer.all_special_ids), 0)
    prompts = [src.take(args.context) for _ in range(args.sessions)]
    extensions = [src.take(args.extend) for _ in range(args.sessions)]
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench-kv-window-") as state:
        for mode in ("window", "full"):
            bench.log(f"{mode}: {args.sessions} sessions x {args.context} tokens")
            results[mode] = measure(bench, model_dir, f"{state}/{mode}", mode == "window", prompts, extensions, args)
            bench.log(f"{mode}: {results[mode]['kv_bytes_per_token']} B/token, "
                      f"decode step {results[mode]['second_decode_step_ms']} ms")
    same = results["window"].pop("outputs") == results["full"].pop("outputs")
    w, f = results["window"], results["full"]
    out = {
        "benchmark": "kv_window", "model": str(model_dir), "sessions": args.sessions, "context": args.context,
        "torch": torch.__version__, "machine": platform.machine(), "threads": torch.get_num_threads(),
        "kv_bytes_window_vs_full": round(w["kv_bytes_per_token"] / f["kv_bytes_per_token"], 3),
        "sessions_per_budget_gain": round(w["sessions_per_budget"] / f["sessions_per_budget"], 2),
        "decode_step_window_vs_full": round(w["second_decode_step_ms"] / f["second_decode_step_ms"], 3),
        "outputs_identical": same, "window": w, "full": f,
    }
    print(json.dumps(out))  # outputs_identical: exact in fp32; bf16 may round differently per layout
    return 0


if __name__ == "__main__":
    sys.exit(main())
