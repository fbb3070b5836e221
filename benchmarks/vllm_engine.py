"""Replicas on vLLM: what burstrl's wrapper costs over bare vLLM, and vLLM vs burstrl's own engine.

Issue 50 ("Speed, side by side in one run"). Servers of one dtype are up together (started one after
another; each idle while another is timed) and get the same requests in turn, round by round, so a
change of load hits each alike: N completions (prompts of 20-200 words, T = 1, logprobs on,
one seed per request) of M tokens sent at once, on the base model and on a rank-16 LoRA version
(every RL request names one). Servers:

- `vllm`: bare vLLM (`python -m vllm.entrypoints.openai.api_server` from .venv-vllm) with the flags
  burstrl gives it (`inference/vllm/process.py`: processed logprobs, prefix caching, LoRA), on TCP;
- `burstrl+vllm`: `burstrl serve --engine.backend vllm` (the same vLLM behind burstrl's server,
  sessions and capture: every request here is a captured session);
- `burstrl`: `burstrl serve` on its own engine.

Each in every `--dtypes` (fp32 and bf16 by default). Figures: `tokens_per_s` (completion tokens /
wall time of the batch, median of `--rounds`), `start_s` (process start to ready: a replica's start,
and its replacement time, since a replacement is a fresh start), and the ratios
`wrapper_vs_bare` (burstrl+vllm / vllm, the goal is >= 0.95) and `vllm_vs_own` (burstrl+vllm / burstrl).

    .venv/bin/python benchmarks/vllm_engine.py                     # Gemma 3 270M, fp32 and bf16 (~15 min on 2 cores)
    .venv/bin/python benchmarks/vllm_engine.py --dtypes float32 --servers vllm,burstrl+vllm
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
TOKEN = "bench-admin"
LORA = "policy-v1"
WORDS = ("the robot counted bolts near a quiet river while the engineer wrote tests for the parser and "
         "the lighthouse keeper sorted lists of prime numbers before the storm").split()


def log(msg: str) -> None:
    print(f"[vllm_engine] {msg}", file=sys.stderr, flush=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="HF model dir [Gemma 3 270M: ~/.cache/burstrl/gemma-3-270m]")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--servers", default="vllm,burstrl+vllm,burstrl")
    p.add_argument("--completions", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--rank", type=int, default=16, help="LoRA rank of the version [16]")
    p.add_argument("--kv-gib", type=int, default=2)
    p.add_argument("--gpu", action="store_true", help="servers on the GPU (vLLM's CUDA build) [CPU]")
    p.add_argument("--work-dir")
    return p.parse_args(argv)


def prompts(n: int) -> list[str]:
    rng = random.Random(0)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 200))) for _ in range(n)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(kind: str, model: str, dtype: str, work: Path, kv_gib: int, gpu: bool) -> tuple[subprocess.Popen, str, float]:
    """Start a server, wait until it answers; (process, url, seconds to ready)."""
    from burstrl.config.vllm import VllmSection
    from burstrl.inference.vllm.process import server_argv, server_env, vllm_python

    port, t0 = free_port(), time.monotonic()
    work.mkdir(parents=True, exist_ok=True)
    if kind == "vllm":
        cfg = VllmSection(kv_cache_gib=kv_gib)
        argv = server_argv(vllm_python(cfg), model, dtype, 2048, work / "unused.sock", TOKEN, cfg, cpu=not gpu)
        cut = argv.index("--uds")
        argv = argv[:cut] + ["--host", "127.0.0.1", "--port", str(port)] + argv[cut + 2:]
        env = server_env(cfg, cpu=not gpu)
    else:
        argv = [str(REPO / ".venv/bin/burstrl"), "serve", "--model", model, "--port", str(port),
                "--model.dtype", dtype, "--server.admin_token", TOKEN, "--server.state_dir", str(work / "state"),
                "--engine.max_model_len", "2048", "--model.device", "cuda" if gpu else "cpu"]
        if kind == "burstrl+vllm":
            argv += ["--engine.backend", "vllm", "--engine.vllm.kv_cache_gib", str(kv_gib)]
        env = dict(os.environ)
    proc = subprocess.Popen(argv, stdout=open(work / "out.log", "w"), stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    while time.monotonic() - t0 < 1200:
        if proc.poll() is not None:
            raise RuntimeError(f"{kind} exited: {(work / 'out.log').read_text()[-2000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url, time.monotonic() - t0
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{kind} not ready in 1200 s")


def stop(proc: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 30)):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=wait)
            break
        except (ProcessLookupError, subprocess.TimeoutExpired):
            continue


def load_lora(kind: str, url: str, path: Path) -> None:
    """The version, by the same admin call on every server (vLLM's own endpoint; burstrl's has its name)."""
    r = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": LORA, "lora_path": str(path)},
                   headers={"Authorization": f"Bearer {TOKEN}"}, timeout=600)
    r.raise_for_status()


def batch(url: str, model: str, texts: list[str], max_tokens: int) -> tuple[int, float]:
    """All requests at once; (completion tokens, wall seconds)."""
    def one(i: int) -> int:
        body = {"model": model, "prompt": texts[i], "max_tokens": max_tokens, "temperature": 1.0, "seed": i,
                "logprobs": 1, "ignore_eos": True}
        r = httpx.post(url + "/v1/completions", json=body, timeout=1200,
                       headers={"Authorization": f"Bearer {TOKEN}", "X-Session-Id": f"b{i}-{time.time_ns()}"})
        r.raise_for_status()
        return r.json()["usage"]["completion_tokens"]

    t0 = time.monotonic()
    with ThreadPoolExecutor(len(texts)) as pool:
        tokens = sum(pool.map(one, range(len(texts))))
    return tokens, time.monotonic() - t0


def measure(kinds: list[str], dtype: str, args: argparse.Namespace, model: str, adapter: Path,
            work: Path) -> dict[str, dict]:
    """Every server of `kinds` up at once (started one after another, idle while another is timed), the
    same batch sent to each in turn, round by round: a load change hits every server alike."""
    servers: dict[str, tuple[subprocess.Popen, str]] = {}
    out: dict[str, dict] = {}
    try:
        for kind in kinds:
            proc, url, start_s = start(kind, model, dtype, work / f"{kind}-{dtype}", args.kv_gib, args.gpu)
            servers[kind] = (proc, url)
            out[kind] = {"start_s": round(start_s, 1)}
            log(f"{kind} {dtype} ready in {start_s:.1f} s")
        texts = prompts(args.completions)
        for kind, (_, url) in servers.items():
            batch(url, "base", texts[:4], 4)  # warm-up (bare vLLM serves the model as "base" too: server_argv)
            load_lora(kind, url, adapter)
        for label, name in (("base", "base"), ("lora", LORA)):
            rates: dict[str, list[float]] = {kind: [] for kind in servers}
            for _ in range(args.rounds):
                for kind, (_, url) in servers.items():
                    tokens, wall = batch(url, name, texts, args.max_tokens)
                    rates[kind].append(tokens / wall)
                    log(f"{kind} {dtype} {label}: {tokens / wall:.1f} tokens/s")
            for kind, got in rates.items():
                out[kind][f"{label}_tokens_per_s"] = round(statistics.median(got), 1)
                out[kind][f"{label}_rounds"] = [round(r, 1) for r in got]
        return out
    finally:
        for proc, _ in servers.values():
            stop(proc)


def make_adapter(model: str, root: Path, rank: int) -> Path:
    from burstrl.model.lora import make_random_adapter

    return make_random_adapter(Path(model), root / LORA, seed=1, rank=rank)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model = args.model or str(Path(os.environ.get("BURSTRL_CACHE", Path.home() / ".cache/burstrl")) / "gemma-3-270m")
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="vllm-engine-bench-"))
    adapter = make_adapter(model, work, args.rank)
    results: dict[str, dict] = {}
    for dtype in args.dtypes.split(","):
        for kind, figures in measure(args.servers.split(","), dtype, args, model, adapter, work).items():
            results[f"{kind}/{dtype}"] = figures
    ratios = {}
    for dtype in args.dtypes.split(","):
        wrap, bare, own = (results.get(f"{k}/{dtype}") for k in ("burstrl+vllm", "vllm", "burstrl"))
        for label in ("base", "lora"):
            key = f"{label}_tokens_per_s"
            if wrap and bare:
                ratios[f"wrapper_vs_bare/{dtype}/{label}"] = round(wrap[key] / bare[key], 3)
            if wrap and own:
                ratios[f"vllm_vs_own/{dtype}/{label}"] = round(wrap[key] / own[key], 3)
    print(json.dumps({"config": vars(args), "results": results, "ratios": ratios}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
