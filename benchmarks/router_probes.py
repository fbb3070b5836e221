"""Two probes of issue 19's last unmet router goals, each a variant of the simulator on the benchmark's traces.

Why: `benchmarks/router.py` says *whether* `kv` meets a goal; these say *why not*, so the next
attempt starts from a measured cause instead of another weight sweep.

- `pressure` (generated fleets, session hit rate >= 0.996 at every seed): `kv`'s pressure moves
  (`KvAwarePolicy.relieve`: a small session leaves a nearly full home before it evicts) at the
  given thresholds (`--variants frac/cheap/dest`: home above `frac` of its KV, session at most
  `cheap` of it, landing replica below `dest` with it), side by side with `kv` without them
  (`off`) on the same traces. Main's thresholds are 0.9/0.1/0.6.
- `tail` (Mooncake, per-call p99 at least as low as every baseline): what the calls above the
  p98.5 are made of, per policy: time queued before a slot, output tokens, prompt tokens, the
  share on weight-1 replicas and the batch they decoded in. p99 here is the decode time of the
  longest outputs, so it ranks policies by the batch size those few calls met.

    .venv/bin/python benchmarks/router_probes.py pressure --seeds 0,1,2,3,4 --workers 2
    .venv/bin/python benchmarks/router_probes.py tail --cell infer/uniform/1 --policies kv,least_requests,smooth_wrr
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from concurrent.futures import ProcessPoolExecutor

from router import GEN_FLEETS, MC_FLEETS, MOONCAKE, pools, trace_half

from burstrl.router.replay import load_mooncake
from burstrl.router.sim import RouterSimulator, SimReplica, TraceSession, generate_trace, load_config


def pressure_job(fleet: str, seed: int, frac: float, cheap: float, dest: float, sessions: int) -> dict:
    """One generated trace on `fleet` under `kv` with pressure moves at (frac, cheap, dest), or without (frac 0)."""
    cfg = load_config(seed=seed, sessions=sessions, arrival_rate=5.0, size_prior_tokens=32768,
                      pools=pools(GEN_FLEETS[fleet]), release_finished=True)
    t0 = time.perf_counter()
    sim = RouterSimulator(cfg, generate_trace(cfg), "kv")
    policy = sim.policy
    policy.relieve_above, policy.relieve_max, policy.relieve_to = (frac, cheap, dest) if frac > 0 else (math.inf, 0, 0)
    fig = sim.run()
    return {"probe": "pressure", "fleet": fleet, "seed": seed, "variant": f"{frac}/{cheap}/{dest}" if frac > 0 else "off",
            "hit_rate": round(fig["hit_rate"], 4), "throughput_tok_s": round(fig["throughput_tok_s"]),
            "p99_rollout_s": round(fig["p99_rollout_s"], 1), "rehomes_pressure": fig["rehomes_pressure"],
            "rehomes_after_eviction": fig["rehomes"] - fig["rehomes_pressure"],
            "wall_s": round(time.perf_counter() - t0, 1)}


class TailSimulator(RouterSimulator):
    """Records, per call: seconds at its replica, seconds queued, tokens in and out, weight, batch at start."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self.started: dict[tuple[str, int], tuple[float, float, int]] = {}
        self.calls: list[tuple[float, float, int, int, float, int]] = []

    def start(self, t: float, r: SimReplica, s: TraceSession, idx: int) -> bool:
        ok = super().start(t, r, s, idx)
        if ok:
            self.started[(s.id, idx)] = (t - self.call_start[(s.id, idx)], r.view.weight, r.running)
        return ok

    def done(self, t: float, r: SimReplica, s: TraceSession, idx: int, pinned: bool) -> None:
        queued, weight, batch = self.started.pop((s.id, idx))
        call = s.calls[idx]
        self.calls.append((t - self.call_start[(s.id, idx)], queued, call.input_tokens, call.output_tokens,
                           weight, batch))
        super().done(t, r, s, idx, pinned)


def tail_job(cell: str, policy: str, seed: int, half: str, trace_path: str) -> dict:
    """One Mooncake cell (`mode/fleet/rate`) under one policy: p99 and what its slowest calls are made of."""
    mode, fleet, scale = cell.split("/")
    trace = trace_half(load_mooncake(trace_path, sessions=mode, rate_scale=float(scale)), half)
    cfg = load_config(seed=seed, block_size=512, pools=pools(MC_FLEETS[fleet]))
    sim = TailSimulator(cfg, trace, policy)
    fig = sim.run()
    calls = sorted(sim.calls)
    top = calls[int(0.985 * len(calls)):]
    return {"probe": "tail", "cell": cell, "policy": policy, "seed": seed, "half": half,
            "p99_call_s": round(fig["p99_call_s"], 2), "calls": len(calls), "top_calls": len(top),
            "top_mean_queued_s": round(statistics.fmean(c[1] for c in top), 3),
            "top_mean_output_tokens": round(statistics.fmean(c[3] for c in top)),
            "all_mean_output_tokens": round(statistics.fmean(c[3] for c in calls)),
            "top_mean_input_tokens": round(statistics.fmean(c[2] for c in top)),
            "top_share_weight1": round(sum(c[4] == 1 for c in top) / len(top), 2),
            "top_mean_batch_at_start": round(statistics.fmean(c[5] for c in top), 2),
            "calls_queued_over_1s": sum(c[1] > 1 for c in calls)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("probe", choices=("pressure", "tail"))
    parser.add_argument("--seeds", default="0,1,2,3,4")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--sessions", type=int, default=4000, help="pressure: sessions per generated trace")
    parser.add_argument("--fleet", choices=tuple(GEN_FLEETS), default="uniform", help="pressure")
    parser.add_argument("--variants", default="0.9/0.1/0.6",
                        help="pressure: frac/cheap/dest triples (kv without pressure moves always runs beside them)")
    parser.add_argument("--cell", default="infer/uniform/1", help="tail: mode/fleet/rate")
    parser.add_argument("--policies", default="kv,least_requests,smooth_wrr,cache_aware,headroom", help="tail")
    parser.add_argument("--half", choices=("all", "first", "second"), default="second", help="tail")
    parser.add_argument("--trace", default=str(MOONCAKE))
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    if args.probe == "pressure":
        variants = [(0.0, 0.0, 0.0)] + [tuple(float(x) for x in v.split("/")) for v in args.variants.split(",") if v]
        jobs = [(pressure_job, args.fleet, seed, *v, args.sessions) for v in variants for seed in seeds]
    else:
        jobs = [(tail_job, args.cell, p, seed, args.half, args.trace) for p in args.policies.split(",") for seed in seeds]
    with ProcessPoolExecutor(args.workers) as pool:
        for future in [pool.submit(fn, *a) for fn, *a in jobs]:  # in submission order
            print(json.dumps(future.result()), flush=True)


if __name__ == "__main__":
    main()
