"""Router benchmark, simulator part: `headroom` (K = 2, 3, 4) against every baseline on one trace.

Same generated agentic trace for all policies; mixed pool (a few 8x-capacity reserved replicas and
many 1x on-demand ones); the arrival rate puts the fleet near KV saturation (see `kv_live_peak`).
Goal: `headroom` session-cache hit rate >= 0.996 for every K, and higher throughput or lower p99
rollout time than every baseline. Prints one JSON line: the config, each policy's figures, and
headroom's ratios vs each baseline (hit rate, throughput: higher is better; p99: lower is better).

`hit_rate` = cached tokens / tokens computed before (the session's earlier context): the part a
router can influence. `prefix_hit_rate` = cached tokens / all input tokens (first prompts and new
tool output can never hit) is reported too.

The live part of the issue's benchmark (3 real replicas, `headroom` vs `round_robin`) is not here.

    .venv/bin/python benchmarks/router.py              # full run, ~1 min on 2 cores
    .venv/bin/python benchmarks/router.py --quick      # smoke test
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from burstrl.router.sim import (
    PoolSpec,
    Simulator,
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
    args = parser.parse_args()
    sessions = 600 if args.quick else args.sessions
    cfg = load_config(seed=args.seed, sessions=sessions, arrival_rate=args.rate, size_prior_tokens=32768,
                      pools=[PoolSpec("reserved", 4, 8, 1_600_000), PoolSpec("on_demand", 32, 1, 200_000)])
    trace = generate_trace(cfg)
    figures: dict[str, dict] = {}
    for name in BASELINES:
        t0 = time.perf_counter()
        figures[name] = Simulator(cfg, trace, name).run()
        print(f"{name}: {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    for k in (2, 3, 4):
        t0 = time.perf_counter()
        figures[f"headroom_k{k}"] = Simulator(cfg, trace, "headroom", k=k).run()
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


if __name__ == "__main__":
    main()
