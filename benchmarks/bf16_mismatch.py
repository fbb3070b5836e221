"""bf16 vs fp32 serving on burstrl's own engine: the mismatch the trainer then trains on, and the speed.

Issue 50 ("bf16 on both engines"). One replica per dtype (`burstrl serve --model.dtype D`, started
one at a time, so they never share the cores), the same requests to each: N completions (prompts of
different lengths, T = 1, one seed per request) sent at once, tokens and logprobs captured by the
replica. Then the trainer's forward (fp32, the whole sequence, logits / T) recomputes every sampled
token's logprob, and the importance ratio rho = exp(recomputed - captured) is what GRPO weighs
each token with (trainer/grpo.py, `token_loss`). Per dtype:

- `ratio_mean`: mean rho over sampled tokens (1 when serving and training compute alike);
- `ratio_outside_frac`: share of tokens with rho outside [0.8, 1.25] (grpo.MISMATCH_BAND), the
  figure the trainer logs per step as `ratio_outside_frac`;
- `dlogp_max`, `dlogp_mean`: largest and mean |recomputed - captured|;
- `tokens_per_s`: completion tokens / wall time of the batch (median over `--rounds`; each round
  the same requests again), `start_s`: process start to ready (load + start probe).

Ratios against fp32 (the baseline, measured in the same run): `bf16_vs_fp32_tokens_per_s`.

    .venv/bin/python benchmarks/bf16_mismatch.py                # Gemma 3 270M (`make gemma`), ~3 min on 2 cores
    .venv/bin/python benchmarks/bf16_mismatch.py --tiny         # the tiny test model, ~30 s
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
TOKEN = "bench-admin"
TOPICS = ["a lighthouse keeper", "sorting a list in Python", "the water cycle", "a chess opening",
          "baking sourdough bread", "the French revolution", "binary search", "a trip to the mountains",
          "how vaccines work", "a robot learning to paint", "prime numbers", "the history of the bicycle",
          "a detective story", "photosynthesis", "writing a unit test", "the moons of Jupiter"]


def log(msg: str) -> None:
    print(f"[bf16_mismatch] {msg}", file=sys.stderr, flush=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="HF model dir [Gemma 3 270M: ~/.cache/burstrl/gemma-3-270m]")
    p.add_argument("--tiny", action="store_true", help="the tiny test model instead (made if missing)")
    p.add_argument("--dtypes", default="float32,bfloat16", help="serving dtypes, the first is the baseline")
    p.add_argument("--completions", type=int, default=16, help="requests sent at once [16]")
    p.add_argument("--max-tokens", type=int, default=64, help="completion tokens per request [64]")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--rounds", type=int, default=2, help="timed rounds of the batch per dtype, median kept [2]")
    p.add_argument("--threads", type=int, default=2, help="the replica's torch threads [2]")
    p.add_argument("--work-dir", help="where replicas keep state and logs [a temporary directory]")
    return p.parse_args(argv)


def model_dir(args: argparse.Namespace) -> Path:
    if args.tiny:
        from burstrl.model.tiny import ensure_tiny_model

        return ensure_tiny_model(REPO / ".cache" / "tiny-qwen3")
    if args.model:
        return Path(args.model).expanduser()
    from burstrl.model.gguf import default_gemma_dir

    path = default_gemma_dir()
    if not (path / "config.json").exists():
        raise SystemExit(f"{path} is missing: run `make gemma`, or pass --tiny")
    return path


def prompts(n: int) -> list[str]:
    """n prompts of different lengths (a sentence to several)."""
    out = []
    for i in range(n):
        topic = TOPICS[i % len(TOPICS)]
        lead = " ".join(f"Paragraph {k + 1} sets the scene around {topic}." for k in range(i % 5))
        out.append(f"{lead} Write a short text about {topic}.\n".lstrip())
    return out


def serve_batch(url: str, texts: list[str], args: argparse.Namespace) -> tuple[float, list[dict]]:
    """All requests at once; (wall seconds, the responses' first choices with prompt ids)."""
    import httpx

    def one(i: int) -> dict:
        body = {"model": "base", "prompt": texts[i], "max_tokens": args.max_tokens, "temperature": args.temperature,
                "seed": 1000 + i, "logprobs": 1, "return_token_ids": True}
        r = httpx.post(url + "/v1/completions", json=body, timeout=900)
        r.raise_for_status()
        choice = r.json()["choices"][0]
        return {"prompt_ids": choice["prompt_token_ids"], "completion_ids": choice["token_ids"],
                "logprobs": choice["logprobs"]["token_logprobs"]}

    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(texts)) as pool:
        out = list(pool.map(one, range(len(texts))))
    return time.perf_counter() - t0, out


def run_dtype(path: Path, dtype: str, texts: list[str], work: Path, args: argparse.Namespace) -> dict:
    from burstrl.protocol.process import start_replica

    t0 = time.perf_counter()
    rep = start_replica(path, work / dtype, "--model.dtype", dtype, "--engine.num_threads", str(args.threads),
                        "--server.admin_token", TOKEN, "--server.state_dir", str(work / dtype / "state"),
                        timeout=600)
    start_s = time.perf_counter() - t0
    try:
        walls, calls = [], []
        for r in range(args.rounds):
            wall, calls = serve_batch(rep.url, texts, args)
            walls.append(wall)
            log(f"{dtype} round {r + 1}: {sum(len(c['completion_ids']) for c in calls)} tokens in {wall:.1f} s")
    finally:
        rep.stop()
    tokens = sum(len(c["completion_ids"]) for c in calls)
    return {"start_s": round(start_s, 1), "tokens": tokens, "walls_s": [round(w, 2) for w in walls],
            "tokens_per_s": round(tokens / statistics.median(walls), 1), "calls": calls}


@torch.inference_mode()
def recompute(model: torch.nn.Module, calls: list[dict], temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(recomputed, captured) logprobs of every sampled token: the trainer's forward (fp32 logits / T)."""
    got, captured = [], []
    for c in calls:
        ids = torch.tensor([c["prompt_ids"] + c["completion_ids"]])
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits[0, :-1].float()
        logits = logits / temperature if temperature != 1.0 else logits
        logp = logits.gather(-1, ids[0, 1:, None])[:, 0] - torch.logsumexp(logits, dim=-1)
        got.append(logp[len(c["prompt_ids"]) - 1:])
        captured.append(torch.tensor(c["logprobs"], dtype=torch.float32))
    return torch.cat(got), torch.cat(captured)


def mismatch(recomputed: torch.Tensor, captured: torch.Tensor) -> dict:
    from burstrl.config import TrainerSection
    from burstrl.trainer.grpo import token_loss

    out = token_loss(recomputed, captured, torch.zeros_like(captured), TrainerSection())
    d = (recomputed - captured).abs()

    def sig(x: torch.Tensor) -> float:  # 4 significant digits: fp32's mismatch is ~1e-6
        return float(f"{float(x):.4g}")

    return {"ratio_mean": sig(out.ratio.mean()), "ratio_min": sig(out.ratio.min()), "ratio_max": sig(out.ratio.max()),
            "ratio_outside_frac": sig(out.outside.float().mean()), "dlogp_max": sig(d.max()),
            "dlogp_mean": sig(d.mean())}

def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    path = model_dir(args)
    dtypes = args.dtypes.split(",")
    texts = prompts(args.completions)
    result: dict = {"benchmark": "bf16_mismatch", "model": str(path), "completions": args.completions,
                    "max_tokens": args.max_tokens, "temperature": args.temperature, "rounds": args.rounds,
                    "threads": args.threads, "torch": torch.__version__}
    with tempfile.TemporaryDirectory(prefix="bench-bf16-") as tmp:
        work = Path(args.work_dir) if args.work_dir else Path(tmp)
        served = {}
        for dtype in dtypes:
            log(f"serving in {dtype}")
            served[dtype] = run_dtype(path, dtype, texts, work, args)
    from burstrl.model.hf import load_model

    log("recomputing with the trainer's fp32 forward")
    model = load_model(path, "float32", "cpu")
    torch.set_num_threads(args.threads)
    for dtype in dtypes:
        run = served[dtype]
        calls = run.pop("calls")
        result[dtype] = {**run, **mismatch(*recompute(model, calls, args.temperature))}
    base = result[dtypes[0]]
    for dtype in dtypes[1:]:
        short = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
        result[f"{short.get(dtype, dtype)}_vs_{short.get(dtypes[0], dtypes[0])}_tokens_per_s"] = round(
            result[dtype]["tokens_per_s"] / base["tokens_per_s"], 2)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
