"""Router soak: 24 h at 10 new sessions/s (864k sessions) through the router's registry, flat memory.

The router never hears that most rollouts ended, so its session maps (homes, pinned versions,
kinds) grow with every session it placed unless finished ones are pruned. This drives the real
`Registry` (placement with the default `headroom` policy, scrapes, pruning) on a simulated clock:
sessions call every 30 s for an exponential lifetime (mean 2 min); 90% are released through the
router when they end, the rest idle on their replica until its session TTL (30 min); 5% are
assigned and never called; every hour a replica dies and a fresh one joins. No sockets, no sleeps.

Prints one JSON object: the config, a sample every simulated hour (map sizes, sessions pruned,
tracemalloc's traced memory in MiB), and `figures`: the samples at the end of the warm-up (the
replica TTL plus the router's grace, 1 h) and at the end, and end / warm-up ratios (goal: ~1.0,
i.e. flat), against the baseline of never pruning (every session ever placed still held).

    .venv/bin/python benchmarks/router_soak.py            # 24 h simulated, ~10 min on 2 busy cores
    .venv/bin/python benchmarks/router_soak.py --quick    # 2 h simulated
"""

from __future__ import annotations

import argparse
import json
import time

from burstrl.router.soak import SoakConfig, soak_registry


def figures(result: dict, cfg: SoakConfig) -> dict:
    """Warm-up vs end samples of the maps and memory, and their ratios."""
    warm_h = (cfg.replica_ttl_s + cfg.grace_s) / 3600
    samples = result["samples"]
    warm = next((s for s in samples if s["hour"] >= warm_h), samples[0])
    end = samples[-1]
    after = [s for s in samples if s["hour"] >= warm["hour"]]
    keys = ("homes", "pinned", "kinds", "seen", "session_kinds", "live_sessions", "traced_mib")
    return {
        "sessions_started": end["sessions_started"],
        "sessions_pruned": end["pruned"],
        "rehomes": end["rehomes"],
        "warmup": {k: warm[k] for k in ("hour", *keys)},
        "end": {k: end[k] for k in ("hour", *keys)},
        "max_after_warmup": {k: max(s[k] for s in after) for k in keys},
        "ratio_end_vs_warmup": {k: round(end[k] / warm[k], 3) if warm[k] else None for k in keys},
        "baseline_no_pruning_homes": end["sessions_started"],
        "ratio_homes_vs_no_pruning": round(end["homes"] / max(end["sessions_started"], 1), 4),
        "traced_peak_mib": result["traced_peak_mib"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hours", type=float, default=24.0, help="simulated hours")
    parser.add_argument("--rate", type=float, default=10.0, help="new sessions per second")
    parser.add_argument("--policy", default="headroom", help="placement policy")
    parser.add_argument("--quick", action="store_true", help="2 simulated hours")
    args = parser.parse_args()
    hours = 2.0 if args.quick else args.hours
    cfg = SoakConfig(hours=hours, rate=args.rate, policy=args.policy, samples=max(2, round(hours)))
    t0 = time.monotonic()
    result = soak_registry(cfg)
    print(json.dumps({"benchmark": "router_soak", "config": result["config"], "figures": figures(result, cfg),
                      "samples": result["samples"], "wall_s": round(time.monotonic() - t0, 1)}))


if __name__ == "__main__":
    main()
