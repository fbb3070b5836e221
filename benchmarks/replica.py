"""Replica benchmark: the torch engine against its baselines, measured side by side in one run.

Prints one JSON object (one line) on stdout; progress goes to stderr. Figures:

1. decode throughput, batch B: the engine (in-process, `Engine.submit`) vs `model.generate` on the
   same model, prompts, lengths and greedy decoding -> `engine_vs_generate` (goal >= 5); 1b. the
   same with output lengths that differ per request (as rollouts do): useful tokens/s of the engine
   vs `generate` in static batches -> `mixed_engine_vs_generate`;
2. the engine vs its physical limit: bare `ModelRunner.forward` decode steps over a pre-filled
   dense `DecodeBatch` (inference/dense.py: a preallocated cache), no scheduling or sampling ->
   `engine_efficiency` (goal >= 0.7; the engine pages its KV, this loop does not); HF's own forward
   over a `transformers.StaticCache` is reported for reference;
3. a multi-turn agent-like workload (S sessions x T turns, token-in prompts that extend the last
   call) with the session KV cache on vs off -> prefix-cache hit rate (goal >= 0.95),
   `session_cache_speedup`, and whether greedy outputs are identical; 3b. the same shape as a GRPO
   run sees it (`agent_*`): first prompts = a system prompt shared by all sessions + a task prompt
   shared by each group of attempts, so cross-session prefix reuse applies ("off" = no session
   cache and no prefix sharing);
4. capture on vs off on the same workload, interleaved runs, medians -> `capture_overhead`
   (goal <= 1.02).

Throughput runs of (1) and (2) are interleaved `--repeats` times and the median is reported, so
that the noise of a shared machine hits every contender alike; `*_best` ratios use the best run of
each side instead (noise only adds time), as a check on the medians. `--threads N` sets torch's
threads for the engine and every baseline alike (all run in this one process).

    .venv/bin/python benchmarks/replica.py            # full run, about a minute on 2 cores
    .venv/bin/python benchmarks/replica.py --quick    # smoke test, < 60 s
"""

from __future__ import annotations

import argparse
import json
import platform
import queue
import random
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from burstrl.config import EngineConfig, HttpServerSection, ModelConfig, ServeConfig
from burstrl.inference.dense import DecodeBatch, PackedPrefillAttention, SessionKV
from burstrl.inference.engine import Request, default_threads
from burstrl.inference.generic import GenericRunner
from burstrl.inference.replica import InferenceReplica, build_replica
from burstrl.inference.runner import ModelRunner
from burstrl.inference.sampling import SamplingParams

GOALS = {
    "engine_vs_generate": (">=", 5.0),
    "engine_efficiency": (">=", 0.7),
    "cache_hit_rate": (">=", 0.95),
    "agent_cache_hit_rate": (">=", 0.95),
    "capture_overhead": ("<=", 1.02),
}
VERSION = "base"


def log(msg: str) -> None:
    print(f"[bench-replica {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- arguments and inputs

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=".cache/tiny-qwen3", help="HF model dir (the tiny one is made if missing)")
    p.add_argument("--engine-path", default="auto", choices=["auto", "fast", "generic"],
                   help="the replicas' engine.path (auto: the fast runner if the probe proves it)")
    p.add_argument("--quick", action="store_true", help="small sizes for a smoke test (< 60 s)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    p.add_argument("--threads", type=int, default=0,
                   help="torch threads for the engine and the baselines; 0 = the engine's default (the cores)")
    p.add_argument("--batch", type=int, help="(1, 2) sequences decoded together [32; quick 8]")
    p.add_argument("--prompt-len", type=int, help="(1, 2) prompt tokens per sequence [16]")
    p.add_argument("--new-tokens", type=int, help="(1, 2) tokens generated per sequence [128; quick 32]")
    p.add_argument("--repeats", type=int, help="(1, 2) interleaved timed rounds, median kept [5; quick 1]")
    p.add_argument("--mixed-requests", type=int, help="(1b) requests of mixed output lengths [96; quick 16]")
    p.add_argument("--mixed-max-tokens", type=int, help="(1b) output lengths uniform in [8, this] [256; quick 48]")
    p.add_argument("--sessions", type=int, help="(3, 4) concurrent sessions [20; quick 6]")
    p.add_argument("--turns", type=int, help="(3, 4) calls per session [10; quick 4]")
    p.add_argument("--first-prompt", type=int, help="(3, 4) tokens of a session's first prompt [32; quick 16]")
    p.add_argument("--tool-tokens", type=int, help="(3, 4) new 'tool output' tokens per turn [20]")
    p.add_argument("--turn-tokens", type=int, help="(3, 4) max_tokens per call [16; quick 8]")
    p.add_argument("--agent-system", type=int, help="(3b) system-prompt ids shared by all sessions [256; quick 64]")
    p.add_argument("--agent-task", type=int, help="(3b) task ids shared by a group [64; quick 32]")
    p.add_argument("--agent-group", type=int, help="(3b) sessions per group (GRPO attempts of a task) [5; quick 3]")
    p.add_argument("--cache-repeats", type=int, help="(3) runs of the workload per cache setting [3; quick 1]")
    p.add_argument("--capture-repeats", type=int, help="(4) interleaved runs per capture setting [5; quick 2]")
    args = p.parse_args(argv)
    full = dict(batch=32, prompt_len=16, new_tokens=128, repeats=5, sessions=20, turns=10,
                first_prompt=32, tool_tokens=20, turn_tokens=16, cache_repeats=3, capture_repeats=5,
                mixed_requests=96, mixed_max_tokens=256, agent_system=256, agent_task=64, agent_group=5)
    quick = dict(full, batch=8, new_tokens=32, repeats=1, sessions=6, turns=4, first_prompt=16,
                 turn_tokens=8, cache_repeats=1, capture_repeats=2, mixed_requests=16, mixed_max_tokens=48,
                 agent_system=64, agent_task=32, agent_group=3)
    for key, value in (quick if args.quick else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def ensure_model(path: str) -> Path:
    model_dir = Path(path)
    if not (model_dir / "config.json").exists():
        from burstrl.model.tiny import ensure_tiny_model

        log(f"{model_dir} missing: making the tiny model")
        ensure_tiny_model(model_dir)
    return model_dir


class TokenSource:
    """Reproducible random token ids that are never special tokens (so no accidental EOS)."""

    def __init__(self, vocab: int, special: list[int], seed: int) -> None:
        self.allowed = torch.tensor([i for i in range(vocab) if i not in set(special)])
        self.gen = torch.Generator().manual_seed(seed)

    def take(self, n: int) -> list[int]:
        idx = torch.randint(len(self.allowed), (n,), generator=self.gen)
        return self.allowed[idx].tolist()


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


# ---------------------------------------------------------------- replica helpers

def start_replica(model_dir: Path, state_dir: str, **engine: object) -> InferenceReplica:
    cfg = ServeConfig(model=ModelConfig(path=str(model_dir)), engine=EngineConfig(**engine),
                      server=HttpServerSection(admin_token="benchmark", state_dir=state_dir))
    return build_replica(cfg)


def _request(rep: InferenceReplica, rid: str, session_id: str | None, prompt: list[int], max_tokens: int,
             on_done: Callable[[Request], None]) -> Request:
    session = rep.sessions.begin(session_id, VERSION, rid)
    return Request(id=rid, session=session, prompt_ids=list(prompt), params=greedy(max_tokens),
                   version=VERSION, adapter=None, on_done=on_done)


def engine_batch(rep: InferenceReplica, prompts: list[list[int]], new_tokens: int | list[int],
                 tag: str, sessions: list[str] | None = None, timeout_s: float = 600.0) -> tuple[float, list[list[int]]]:
    """Submit every prompt at once (ephemeral calls, or one per session of `sessions`); seconds from
    first submit to last done, outputs."""
    left, done = [len(prompts)], threading.Event()
    lock = threading.Lock()

    def on_done(_: Request) -> None:
        with lock:
            left[0] -= 1
            if left[0] == 0:
                done.set()

    lengths = new_tokens if isinstance(new_tokens, list) else [new_tokens] * len(prompts)
    sids = sessions or [None] * len(prompts)
    reqs = [_request(rep, f"{tag}-{i}", sid, p, n, on_done)
            for i, (sid, p, n) in enumerate(zip(sids, prompts, lengths, strict=True))]
    t0 = time.perf_counter()
    for req in reqs:
        rep.engine.submit(req)
    if not done.wait(timeout=timeout_s):
        raise TimeoutError(f"{tag}: engine batch did not finish in {timeout_s:g} s")
    wall = time.perf_counter() - t0
    errors = [r.error for r in reqs if r.error]
    if errors:
        raise RuntimeError(f"{tag}: engine errors: {errors[:3]}")
    return wall, [r.completion_ids for r in reqs]


@dataclass
class Workload:
    """Multi-turn sessions: a first prompt each, then `tool` new ids appended before every later turn."""

    first: list[list[int]]  # [session] -> ids
    tool: list[list[list[int]]]  # [session][turn] -> ids appended before that turn (turn 0 unused)
    turn_tokens: int
    system: int = 0  # leading ids of every first prompt that all sessions share
    group: int = 1  # consecutive sessions that share their whole first prompt (a GRPO group)

    @property
    def sessions(self) -> int:
        return len(self.first)

    @property
    def turns(self) -> int:
        return len(self.tool[0])


def make_workload(src: TokenSource, sessions: int, turns: int, first: int, tool: int,
                  turn_tokens: int, system: int = 0, group: int = 1) -> Workload:
    """Random ids; with `system`/`group`, first prompts = shared system ids + the group's task ids."""
    shared = src.take(system)
    tasks = [src.take(first) for _ in range(-(-sessions // group))]
    return Workload(first=[shared + tasks[i // group] for i in range(sessions)],
                    tool=[[src.take(tool) for _ in range(turns)] for _ in range(sessions)],
                    turn_tokens=turn_tokens, system=system, group=group)


@dataclass
class SessionRun:
    wall_s: float
    outputs: list[list[list[int]]]  # [session][turn] -> completion ids
    prompt_lens: list[list[int]]  # [session][turn]
    hit_tokens: int
    query_tokens: int
    captured_calls: int


def run_sessions(rep: InferenceReplica, work: Workload, tag: str) -> SessionRun:
    """Sessions run concurrently, each session's turns one after the other (token-in prompts)."""
    done: queue.SimpleQueue[Request] = queue.SimpleQueue()
    where: dict[str, tuple[int, int]] = {}
    outputs: list[list[list[int]]] = [[] for _ in range(work.sessions)]
    lens: list[list[int]] = [[] for _ in range(work.sessions)]
    before = rep.engine.loads()

    def submit(i: int, turn: int, prompt: list[int]) -> None:
        rid = f"{tag}-{i}-{turn}"
        where[rid] = (i, turn)
        lens[i].append(len(prompt))
        rep.engine.submit(_request(rep, rid, f"{tag}-s{i}", prompt, work.turn_tokens, done.put))

    t0 = time.perf_counter()
    for i in range(work.sessions):
        submit(i, 0, work.first[i])
    for _ in range(work.sessions * work.turns):
        req = done.get(timeout=600)
        if req.error:
            raise RuntimeError(f"engine error: {req.error}")
        i, turn = where[req.id]
        outputs[i].append(req.completion_ids)
        if turn + 1 < work.turns:
            submit(i, turn + 1, req.prompt_ids + req.completion_ids + work.tool[i][turn + 1])
    wall = time.perf_counter() - t0
    after = rep.engine.loads()
    captured = 0
    for i in range(work.sessions):  # release: frees the idle caches and the traces
        sid = f"{tag}-s{i}"
        captured += len(rep.sessions.release(sid).calls)
        rep.engine.drop_session(sid)
    return SessionRun(
        wall_s=wall, outputs=outputs, prompt_lens=lens,
        hit_tokens=after["prefix_cache_hit_tokens"] - before["prefix_cache_hit_tokens"],
        query_tokens=after["prefix_cache_queries_tokens"] - before["prefix_cache_queries_tokens"],
        captured_calls=captured,
    )


def hit_ceiling(run: SessionRun, work: Workload) -> float:
    """Best possible token hit rate of this workload: every prompt token already fed is reused.

    A session's first prompt and each turn's new tool tokens are misses, and so is the last
    sampled token of the previous call (sampled, not yet fed through the model).
    """
    total = sum(sum(lens) for lens in run.prompt_lens)
    reusable = sum(lens[t - 1] + work.turn_tokens - 1 for lens in run.prompt_lens for t in range(1, len(lens)))
    for i, first in enumerate(work.first[1:], start=1):  # what a first prompt can copy from others
        reusable += len(first) - 1 if i % work.group else min(work.system, len(first) - 1)
    return reusable / total


# ---------------------------------------------------------------- baselines

@torch.inference_mode()
def hf_generate(model: torch.nn.Module, prompts: list[list[int]], new_tokens: int,
                pad_id: int) -> tuple[float, list[list[int]]]:
    ids = torch.tensor(prompts, device=model.device)
    t0 = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                         min_new_tokens=new_tokens, do_sample=False, pad_token_id=pad_id)
    wall = time.perf_counter() - t0
    return wall, out[:, ids.shape[1]:].tolist()


@torch.inference_mode()
def bare_runner(runner: ModelRunner | GenericRunner, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[list[int]]]:
    """The engine's forward over a DecodeBatch pre-filled with the prompts; argmax, no scheduler.

    Timed: `new_tokens` decode steps (the prefill is not timed). Returns the greedy tokens too
    (the first from the prefill logits), which must equal the engine's.
    """
    r = runner
    batch = DecodeBatch(r.num_layers, r.num_kv_heads, r.head_dim, r.dtype, r.device, r.scaling)
    first = []
    for p in prompts:
        kv = SessionKV(r.num_layers, r.num_kv_heads, r.head_dim, r.dtype, r.device, len(p) + new_tokens + 1)
        attention = PackedPrefillAttention([kv], [len(p)], r.scaling)
        positions = torch.arange(len(p), device=r.device)[None]
        logits = r.forward(torch.tensor([p], device=r.device), positions, attention)
        attention.commit()
        first.append(int(logits.argmax(-1)))
        batch.add(kv)
    ids = torch.tensor(first, device=r.device)[:, None]
    tokens = [ids]
    t0 = time.perf_counter()
    for _ in range(new_tokens):
        batch.prepare()
        logits = r.forward(ids, batch.lens[:, None].clone(), batch)
        batch.advance()
        ids = logits.argmax(-1, keepdim=True)
        tokens.append(ids)
    wall = time.perf_counter() - t0
    return wall, torch.cat(tokens, dim=1)[:, :new_tokens].tolist()


@torch.inference_mode()
def hf_static(model: torch.nn.Module, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[list[int]]]:
    """HF's own forward over a StaticCache: prefill (not timed), then `new_tokens` decode steps."""
    from transformers import StaticCache

    ids = torch.tensor(prompts, device=model.device)
    plen = ids.shape[1]
    cache = StaticCache(config=model.config, max_cache_len=plen + new_tokens + 1)
    out = model(input_ids=ids, cache=cache, cache_position=torch.arange(plen, device=ids.device), use_cache=True)
    tok = out.logits[:, -1].argmax(-1, keepdim=True)
    tokens = [tok]
    t0 = time.perf_counter()
    for step in range(new_tokens):
        pos = torch.tensor([plen + step], device=ids.device)
        out = model(input_ids=tok, cache=cache, cache_position=pos, use_cache=True)
        tok = out.logits[:, -1].argmax(-1, keepdim=True)
        tokens.append(tok)
    wall = time.perf_counter() - t0
    return wall, torch.cat(tokens, dim=1)[:, :new_tokens].tolist()


# ---------------------------------------------------------------- the four figures

def decode_figures(rep: InferenceReplica, model: torch.nn.Module, prompts: list[list[int]], args: argparse.Namespace,
                   pad_id: int) -> dict:
    """(1) and (2): interleaved rounds of engine / generate / bare runner / HF static cache."""
    n_tok = len(prompts) * args.new_tokens
    runner = rep.engine.runner  # the path the replica proved and serves with (fast or generic)
    log("warm-up round (engine, generate, bare runner, HF static)")
    warm = min(16, args.new_tokens)
    engine_batch(rep, prompts, warm, "warm")
    hf_generate(model, prompts, warm, pad_id)
    bare_runner(runner, prompts, warm)
    hf_static(model, prompts, warm)
    times: dict[str, list[float]] = {"engine": [], "generate": [], "bare": [], "hf_static": []}
    split = {"prefill_s": [], "decode_s": [], "steps": []}
    outs: dict[str, list[list[int]]] = {}
    for k in range(args.repeats):
        c0 = rep.engine.counters
        p0, d0, s0 = c0.prefill_s, c0.decode_s, c0.decode_steps
        wall, outs["engine"] = engine_batch(rep, prompts, args.new_tokens, f"round{k}")
        times["engine"].append(wall)
        wall, outs["generate"] = hf_generate(model, prompts, args.new_tokens, pad_id)
        times["generate"].append(wall)
        wall, outs["bare"] = bare_runner(runner, prompts, args.new_tokens)
        times["bare"].append(wall)
        wall, outs["hf_static"] = hf_static(model, prompts, args.new_tokens)
        times["hf_static"].append(wall)
        # the engine counts a step after its last on_done: read its counters once it is idle
        c1 = rep.engine.counters
        split["prefill_s"].append(c1.prefill_s - p0)
        split["decode_s"].append(c1.decode_s - d0)
        split["steps"].append(c1.decode_steps - s0)
        log(f"round {k + 1}/{args.repeats}: " + ", ".join(
            f"{name} {n_tok / ts[-1]:.0f} tok/s" for name, ts in times.items()))
    med = {name: statistics.median(ts) for name, ts in times.items()}
    tps = {name: n_tok / s for name, s in med.items()}
    best = {name: min(ts) for name, ts in times.items()}  # noise only adds time: best-of-N as a check
    steps = statistics.median(split["steps"])
    return {
        "engine_tok_s": round(tps["engine"], 1),
        "generate_tok_s": round(tps["generate"], 1),
        "bare_runner_tok_s": round(tps["bare"], 1),
        "hf_static_tok_s": round(tps["hf_static"], 1),
        "engine_vs_generate": round(tps["engine"] / tps["generate"], 3),
        "engine_efficiency": round(tps["engine"] / tps["bare"], 3),
        "bare_runner_vs_hf_static": round(tps["bare"] / tps["hf_static"], 3),
        "engine_vs_generate_best": round(best["generate"] / best["engine"], 3),
        "engine_efficiency_best": round(best["bare"] / best["engine"], 3),
        "engine_wall_s": round(med["engine"], 4),
        "engine_prefill_s": round(statistics.median(split["prefill_s"]), 4),
        "engine_decode_s": round(statistics.median(split["decode_s"]), 4),
        "engine_decode_steps": steps,
        "engine_decode_step_ms": round(1e3 * statistics.median(split["decode_s"]) / max(steps, 1), 3),
        "bare_decode_step_ms": round(1e3 * med["bare"] / args.new_tokens, 3),
        "hf_static_decode_step_ms": round(1e3 * med["hf_static"] / args.new_tokens, 3),
        "engine_matches_generate_rows": sum(a == b for a, b in zip(outs["engine"], outs["generate"], strict=False)),
        "engine_matches_bare_rows": sum(a == b for a, b in zip(outs["engine"], outs["bare"], strict=False)),
        "generate_matches_hf_static_rows": sum(a == b for a, b in zip(outs["generate"], outs["hf_static"], strict=False)),
        "rows": len(prompts),
        "raw_s": {name: [round(t, 4) for t in ts] for name, ts in times.items()},
    }


def mixed_figures(rep: InferenceReplica, model: torch.nn.Module, src: TokenSource, args: argparse.Namespace,
                  pad_id: int) -> dict:
    """(1b) Requests of different output lengths, as RL rollouts are: useful tokens/s.

    `generate` runs static batches of `batch` requests in arrival order, each to its longest
    member (lengths are not known in advance); the engine keeps `batch` slots busy and refills a
    slot as soon as its request ends (its max_running_requests is `batch`).
    """
    rng = random.Random(args.seed + 1)
    n = args.mixed_requests
    prompts = [src.take(args.prompt_len) for _ in range(n)]
    lengths = [rng.randint(8, args.mixed_max_tokens) for _ in range(n)]
    useful = sum(lengths)
    times: dict[str, list[float]] = {"engine": [], "generate": []}
    for k in range(max(1, args.repeats // 2)):
        wall, outs = engine_batch(rep, prompts, lengths, f"mixed{k}")
        assert [len(o) for o in outs] == lengths
        times["engine"].append(wall)
        t0 = time.perf_counter()
        for i in range(0, n, args.batch):
            batch = prompts[i:i + args.batch]
            hf_generate(model, batch, max(lengths[i:i + args.batch]), pad_id)
        times["generate"].append(time.perf_counter() - t0)
        log(f"mixed round {k + 1}: engine {useful / times['engine'][-1]:.0f}, "
            f"generate {useful / times['generate'][-1]:.0f} useful tok/s")
    med = {name: statistics.median(ts) for name, ts in times.items()}
    return {
        "mixed_requests": n,
        "mixed_useful_tokens": useful,
        "mixed_engine_useful_tok_s": round(useful / med["engine"], 1),
        "mixed_generate_useful_tok_s": round(useful / med["generate"], 1),
        "mixed_engine_vs_generate": round(med["generate"] / med["engine"], 3),
    }


class RecordTimer:
    """Wraps the engine's capture step (`Engine._record`) to add up its own time, on the engine thread.

    The wall-clock ratio of interleaved runs is what the goal is about, but on a shared machine its
    noise (several %) exceeds the effect; this direct figure says how much of it capture can be.
    """

    def __init__(self, rep: InferenceReplica) -> None:
        self.engine, self.seconds = rep.engine, 0.0
        self.inner = getattr(rep.engine, "_record", None)
        if self.inner is not None:
            rep.engine._record = self  # instance attribute shadows the method

    def __call__(self, req: Request):
        t0 = time.perf_counter()
        try:
            return self.inner(req)
        finally:
            self.seconds += time.perf_counter() - t0

    def close(self) -> None:
        if self.inner is not None:
            del self.engine._record


def capture_figures(rep: InferenceReplica, work: Workload, repeats: int) -> dict:
    """(4) capture on/off, interleaved on one replica (capture is read when a call finishes)."""
    timer = RecordTimer(rep)
    try:
        return _capture_runs(rep, work, repeats, timer)
    finally:
        timer.close()


def _capture_runs(rep: InferenceReplica, work: Workload, repeats: int, timer: RecordTimer) -> dict:
    runs: dict[bool, list[float]] = {True: [], False: []}
    captured: dict[bool, int] = {True: 0, False: 0}
    order = [flag for k in range(repeats) for flag in ((True, False) if k % 2 == 0 else (False, True))]
    for j, flag in enumerate(order):
        rep.engine.cfg.capture = flag
        run = run_sessions(rep, work, f"cap{j}")
        runs[flag].append(run.wall_s)
        captured[flag] += run.captured_calls
        log(f"capture {'on ' if flag else 'off'} run {j + 1}/{len(order)}: {run.wall_s:.3f} s")
    rep.engine.cfg.capture = True
    on, off = statistics.median(runs[True]), statistics.median(runs[False])
    record_s = timer.seconds / max(1, len(runs[True]))
    return {
        "capture_on_s": round(on, 4),
        "capture_off_s": round(off, 4),
        "capture_overhead": round(on / off, 4),
        "capture_overhead_best": round(min(runs[True]) / min(runs[False]), 4),
        "capture_record_ms_per_run": round(1e3 * record_s, 3),
        "capture_overhead_direct": round((off + record_s) / off, 5),
        "captured_calls_on": captured[True],
        "captured_calls_off": captured[False],
        "raw_s": {"on": [round(t, 4) for t in runs[True]], "off": [round(t, 4) for t in runs[False]]},
    }


def session_runs(rep: InferenceReplica, work: Workload, repeats: int, tag: str) -> list[SessionRun]:
    runs = []
    for k in range(repeats):
        runs.append(run_sessions(rep, work, f"{tag}{k}"))
        log(f"multi-turn ({tag}) run {k + 1}/{repeats}: {runs[-1].wall_s:.3f} s")
    return runs


def cache_figures(on: list[SessionRun], off: list[SessionRun], work: Workload) -> dict:
    """(3) session cache on vs off, from runs on two replicas built the same way."""
    hits, queries = sum(r.hit_tokens for r in on), sum(r.query_tokens for r in on)
    rate = hits / queries if queries else 0.0
    ceiling = hit_ceiling(on[0], work)
    t_on = statistics.median(r.wall_s for r in on)
    t_off = statistics.median(r.wall_s for r in off)
    return {
        "cache_hit_rate": round(rate, 4),
        "cache_hit_rate_ceiling": round(ceiling, 4),
        "cache_hit_vs_ceiling": round(rate / ceiling, 4) if ceiling else 0.0,
        "cache_off_hit_rate": round(sum(r.hit_tokens for r in off) / max(1, sum(r.query_tokens for r in off)), 4),
        "prompt_tokens_per_run": sum(sum(lens) for lens in on[0].prompt_lens),
        "generated_tokens_per_run": work.sessions * work.turns * work.turn_tokens,
        "cache_on_s": round(t_on, 4),
        "cache_off_s": round(t_off, 4),
        "session_cache_speedup": round(t_off / t_on, 3),
        "session_cache_speedup_best": round(min(r.wall_s for r in off) / min(r.wall_s for r in on), 3),
        "outputs_match": all(r.outputs == on[0].outputs for r in [*on, *off]),
        "raw_s": {"on": [round(r.wall_s, 4) for r in on], "off": [round(r.wall_s, 4) for r in off]},
    }


def kv_bytes(rep: InferenceReplica) -> dict:
    """KV memory per cached token vs the dense formula (2 x layers x KV heads x head dim x bytes),
    after a multi-turn run: the blocks in use (a shared block once) over the tokens the caches and
    rows hold (a shared token for each holder), so block rounding costs and prefix sharing saves.
    The pool itself is allocated once at the budget (`kv_pool_bytes`); pages never touched stay
    unmapped on CPU."""
    engine = rep.engine
    r = engine.runner
    size = torch.tensor([], dtype=r.dtype).element_size()
    dense = 2 * r.num_layers * r.num_kv_heads * r.head_dim * size
    pool = engine.pool
    held = pool.used_blocks * pool.block_size * dense // pool.sequence_blocks  # a block: one layer group's
    tokens = sum(e.table.length for e in engine.cache.idle.values()) + sum(r.kv.length for r in engine.rows)
    return {"kv_bytes_per_token_dense": dense, "kv_tokens_held": tokens, "kv_pool_bytes": engine.pool.nbytes,
            "kv_bytes_per_token_allocated": round(held / tokens, 1) if tokens else None}


def goals(flat: dict, notes: dict[str, dict]) -> dict:
    out = {}
    for name, (op, target) in GOALS.items():
        value = flat[name]
        met = value >= target if op == ">=" else value <= target
        out[name] = {"value": value, "goal": f"{op} {target}", "met": bool(met), **notes.get(name, {})}
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from burstrl.model.hf import load_model, load_tokenizer

    t_start = time.perf_counter()
    model_dir = ensure_model(args.model)
    tokenizer = load_tokenizer(model_dir)
    model = load_model(model_dir)  # the baselines' copy; each replica loads its own
    src = TokenSource(int(model.config.vocab_size), list(tokenizer.all_special_ids), args.seed)
    prompts = [src.take(args.prompt_len) for _ in range(args.batch)]
    work = make_workload(src, args.sessions, args.turns, args.first_prompt, args.tool_tokens, args.turn_tokens)
    agent = make_workload(src, args.sessions, args.turns, args.agent_task, args.tool_tokens, args.turn_tokens,
                          system=args.agent_system, group=args.agent_group)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

    engine_opts = {"num_threads": args.threads, "max_running_requests": args.batch, "path": args.engine_path}
    state = tempfile.TemporaryDirectory(prefix="bench-replica-")  # the replicas' state dirs
    log(f"replica A (session cache on) from {model_dir}")
    t0 = time.perf_counter()
    rep = start_replica(model_dir, f"{state.name}/a", session_cache=True, capture=True, **engine_opts)
    start = {"replica_start_s": round(time.perf_counter() - t0, 2), "engine_path": rep.engine.runner.path,
             "probe_max_abs_dlogp": rep.engine.probe_error}
    log(f"replica up in {start['replica_start_s']} s on the {start['engine_path']} path")
    try:
        decode = decode_figures(rep, model, prompts, args, pad_id)
        log(f"decode: engine {decode['engine_tok_s']} tok/s, generate {decode['generate_tok_s']}, "
            f"bare {decode['bare_runner_tok_s']}, hf static {decode['hf_static_tok_s']}")
        mixed = mixed_figures(rep, model, src, args, pad_id)
        log(f"mixed lengths: engine / generate useful tokens/s = {mixed['mixed_engine_vs_generate']}")
        cache_on = session_runs(rep, work, args.cache_repeats, "on")
        start.update(kv_bytes(rep))
        agent_on = session_runs(rep, agent, args.cache_repeats, "agent-on")
        capture = capture_figures(rep, work, args.capture_repeats)
    finally:
        rep.close()
    log("replica B (session cache off)")
    rep = start_replica(model_dir, f"{state.name}/b", session_cache=False, prefix_sharing=False, capture=True,
                        **engine_opts)
    try:
        session_runs(rep, make_workload(src, 2, 2, 8, 4, 4), 1, "warm")  # first-call costs off the clock
        cache_off = session_runs(rep, work, args.cache_repeats, "off")
        agent_off = session_runs(rep, agent, args.cache_repeats, "agent-off")
    finally:
        rep.close()
        state.cleanup()
    cache = cache_figures(cache_on, cache_off, work)
    agent_fig = cache_figures(agent_on, agent_off, agent)

    flat = {**decode, **cache, **capture, "agent_cache_hit_rate": agent_fig["cache_hit_rate"]}
    decode.update(mixed)
    result = {
        "benchmark": "replica",
        "engine_vs_generate": decode["engine_vs_generate"],
        "engine_efficiency": decode["engine_efficiency"],
        "mixed_engine_vs_generate": mixed["mixed_engine_vs_generate"],
        "cache_hit_rate": cache["cache_hit_rate"],
        "agent_cache_hit_rate": agent_fig["cache_hit_rate"],
        "session_cache_speedup": cache["session_cache_speedup"],
        "agent_session_cache_speedup": agent_fig["session_cache_speedup"],
        "outputs_match": cache["outputs_match"],
        "capture_overhead": capture["capture_overhead"],
        **start,
        "goals": goals(flat, notes={
            "cache_hit_rate": {"workload_ceiling": cache["cache_hit_rate_ceiling"]},
            "agent_cache_hit_rate": {"workload_ceiling": agent_fig["cache_hit_rate_ceiling"]},
            "capture_overhead": {"direct": capture["capture_overhead_direct"]},
        }),
        "decode": decode,
        "multi_turn": cache,
        "agent_multi_turn": agent_fig,
        "capture": capture,
        "env": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": __import__("transformers").__version__,
            "torch_threads": torch.get_num_threads(),
            "cores": default_threads(),
            "model": str(model_dir),
            "params": sum(p.numel() for p in model.parameters()),
        },
        "args": vars(args),
        "total_s": round(time.perf_counter() - t_start, 1),
    }
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
