"""Router benchmark, simulator part: `headroom` (K = 2, 3, 4) against every baseline on one trace.

Same generated agentic trace for all policies; mixed pool (a few 8x-capacity reserved replicas and
many 1x on-demand ones); the arrival rate puts the fleet near KV saturation (see `kv_live_peak`).
Goal: `headroom` session-cache hit rate >= 0.996 for every K, and higher throughput or lower p99
rollout time than every baseline. Prints one JSON line: the config, each policy's figures, and
headroom's ratios vs each baseline (hit rate, throughput: higher is better; p99: lower is better).

`hit_rate` = cached tokens / tokens computed before (the session's earlier context): the part a
router can influence. `prefix_hit_rate` = cached tokens / all input tokens (first prompts and new
tool output can never hit) is reported too.

`--live` runs the issue's live part instead: 3 real replicas (`burstrl serve` on the tiny model, a
small KV budget so that placement matters) behind the real router, once with `headroom` and once
with `round_robin` (a fresh router each), the same multi-turn token-in workload through both;
reports the replicas' cache hit rate, evictions and thrashing (deltas of their `/v1/loads`), mean
and p99 rollout time, and headroom / round_robin ratios.

    .venv/bin/python benchmarks/router.py              # full run, ~1 min on 2 cores
    .venv/bin/python benchmarks/router.py --quick      # smoke test
    .venv/bin/python benchmarks/router.py --live       # live run, ~30 s on 2 cores
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from burstrl.protocol import process
from burstrl.protocol.process import RoleProcess, start_replica
from burstrl.router.sim import (
    PoolSpec,
    RouterSimulator,
    config_dict,
    generate_trace,
    load_config,
)

BASELINES = ("random", "round_robin", "least_loaded", "cache_aware")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=4000)
    parser.add_argument("--rate", type=float, default=5.0, help="new sessions per second")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="a small trace (smoke test)")
    parser.add_argument("--live", action="store_true", help="real replicas and router (headroom vs round_robin)")
    args = parser.parse_args()
    if args.live:
        run_live(seed=args.seed)
        return
    sessions = 600 if args.quick else args.sessions
    cfg = load_config(seed=args.seed, sessions=sessions, arrival_rate=args.rate, size_prior_tokens=32768,
                      pools=[PoolSpec("reserved", 4, 8, 1_600_000), PoolSpec("on_demand", 32, 1, 200_000)])
    trace = generate_trace(cfg)
    figures: dict[str, dict] = {}
    for name in BASELINES:
        t0 = time.perf_counter()
        figures[name] = RouterSimulator(cfg, trace, name).run()
        print(f"{name}: {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    for k in (2, 3, 4):
        t0 = time.perf_counter()
        figures[f"headroom_k{k}"] = RouterSimulator(cfg, trace, "headroom", k=k).run()
        print(f"headroom k={k}: {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    ratios, goals = {}, {}
    for k in (2, 3, 4):
        h = figures[f"headroom_k{k}"]
        per = {}
        wins = True
        for name in BASELINES:
            b = figures[name]
            per[name] = {
                "hit_rate": h["hit_rate"] / max(b["hit_rate"], 1e-12),
                "throughput": h["throughput_tok_s"] / b["throughput_tok_s"],
                "p99_rollout": h["p99_rollout_s"] / b["p99_rollout_s"],
            }
            wins &= per[name]["throughput"] > 1 or per[name]["p99_rollout"] < 1
        ratios[f"k{k}"] = per
        goals[f"k{k}"] = {"hit_rate_ge_0.996": h["hit_rate"] >= 0.996, "beats_every_baseline": wins}
    print(json.dumps({"benchmark": "router_sim", "config": config_dict(cfg), "figures": figures,
                      "headroom_vs_baseline": ratios, "goals": goals}))


# --- live: 3 real replicas behind the real router ----------------------------------------

ADMIN = "bench-admin-token"
CLUSTER = "bench-cluster-token"
LIVE = {"replicas": 3, "kv_tokens": 3000, "sessions": 48, "turns": 6, "concurrency": 12,
        "first_prompt": (150, 700), "new_ids_per_turn": 30, "max_tokens": 16, "k": 2, "scrape_s": 0.5}
COUNTERS = ("prefix_cache_hit_tokens", "prefix_cache_queries_tokens", "evictions", "thrash", "refills")


def start_router(workdir: Path, policy: str, replicas: list[str]) -> RoleProcess:
    """`burstrl route serve` as a child process; returns once it prints its ready line."""
    return process.start_router(workdir, "--cluster_token", CLUSTER, "--policy", policy, "--k", str(LIVE["k"]),
                                "--scrape_s", str(LIVE["scrape_s"]), "--replicas", json.dumps(replicas))


def replica_counters(urls: list[str]) -> dict[str, dict[str, int]]:
    return {u: {k: int(httpx.get(u + "/v1/loads", timeout=30).json()[k]) for k in COUNTERS} for u in urls}


def run_session(router_url: str, sid: str, first: list[int], rng: random.Random) -> tuple[float, str]:
    """One rollout: `turns` token-in calls, each prompt = previous prompt + completion + new ids."""
    client = httpx.Client(timeout=300)
    ids = list(first)
    t0 = time.perf_counter()
    for _ in range(LIVE["turns"]):
        body = {"model": "base", "prompt": "", "input_ids": ids, "max_tokens": LIVE["max_tokens"],
                "temperature": 0, "ignore_eos": True, "return_token_ids": True, "session_id": sid}
        r = client.post(router_url + "/v1/completions", json=body)
        r.raise_for_status()
        ids = ids + r.json()["choices"][0]["token_ids"] + [rng.randrange(100, 2000) for _ in range(LIVE["new_ids_per_turn"])]
    elapsed = time.perf_counter() - t0
    home = client.post(router_url + "/v1/assign", json={"session_id": sid, "version": "base"}).json()["url"]
    client.delete(home + f"/v1/traces/{sid}", headers={"Authorization": f"Bearer {ADMIN}"}).raise_for_status()
    client.close()
    return elapsed, home


def run_policy(policy: str, replicas: list[str], workdir: Path, seed: int) -> dict:
    """The workload through a fresh router with `policy`; figures from the replicas' counter deltas."""
    rng = random.Random(seed)  # the same prompts for every policy
    lo, hi = LIVE["first_prompt"]
    firsts = [[rng.randrange(100, 2000) for _ in range(rng.randint(lo, hi))] for _ in range(LIVE["sessions"])]
    router = start_router(workdir / policy, policy, replicas)
    try:
        before = replica_counters(replicas)
        t0 = time.perf_counter()
        with ThreadPoolExecutor(LIVE["concurrency"]) as pool:
            results = list(pool.map(lambda i: run_session(router.url, f"{policy}-{i}", firsts[i], random.Random(seed + i)),
                                    range(LIVE["sessions"])))
        wall = time.perf_counter() - t0
        after = replica_counters(replicas)
        rehomes = httpx.get(router.url + "/v1/stats", timeout=30).json()["totals"]["rehomes"]
    finally:
        router.stop()
    delta = {k: sum(after[u][k] - before[u][k] for u in replicas) for k in COUNTERS}
    times = sorted(t for t, _ in results)
    return {"hit_rate": delta["prefix_cache_hit_tokens"] / max(delta["prefix_cache_queries_tokens"], 1),
            "evictions": delta["evictions"], "thrash": delta["thrash"], "refills": delta["refills"],
            "mean_rollout_s": statistics.mean(times), "p99_rollout_s": times[min(len(times) - 1, int(0.99 * len(times)))],
            "wall_s": wall, "rehomes": rehomes,
            "sessions_per_replica": [sum(1 for _, home in results if home == u) for u in replicas]}


def run_live(seed: int = 0) -> None:
    from burstrl.model.tiny import ensure_tiny_model

    model = ensure_tiny_model(Path(".cache/tiny-qwen3"))
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        with ThreadPoolExecutor(LIVE["replicas"]) as pool:
            procs = list(pool.map(lambda i: start_replica(
                model, root / f"r{i}", "--server.admin_token", ADMIN, "--engine.num_threads", "1",
                "--engine.max_total_num_tokens", str(LIVE["kv_tokens"])), range(LIVE["replicas"])))
        try:
            urls = [p.url for p in procs]
            figures = {}
            for policy in ("headroom", "round_robin"):
                t0 = time.perf_counter()
                figures[policy] = run_policy(policy, urls, root, seed)
                print(f"{policy}: {time.perf_counter() - t0:.1f} s", file=sys.stderr)
        finally:
            for p in procs:
                p.stop()
    h, b = figures["headroom"], figures["round_robin"]
    ratios = {"hit_rate": h["hit_rate"] / max(b["hit_rate"], 1e-12),
              "mean_rollout": h["mean_rollout_s"] / b["mean_rollout_s"],
              "p99_rollout": h["p99_rollout_s"] / b["p99_rollout_s"]}
    print(json.dumps({"benchmark": "router_live", "config": LIVE, "seed": seed, "figures": figures,
                      "headroom_vs_round_robin": ratios}))


if __name__ == "__main__":
    main()
