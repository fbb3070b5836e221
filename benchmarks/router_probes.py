"""Two probes of issue 19's last unmet router goals, each a variant of the simulator on the benchmark's traces.

Why: `benchmarks/router.py` says *whether* `kv` meets a goal; these say *why not*, so the next
attempt starts from a measured cause instead of another weight sweep.

- `pressure` (generated uniform fleet, session hit rate >= 0.996 at every seed): `kv` moves a
  session only after its overflowing home evicted it. Here a session is also moved at its next
  call *before* that, while its home's live context is above `--frac` of its KV, if the session
  is small (context <= `--cheap` of the KV: re-prefilling it elsewhere is the price) and the
  replica `kv` picks among those it never lived on holds less than `--dest` of its KV. Side by
  side with `kv` as on main, on the same traces.
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
import statistics
import time
from concurrent.futures import ProcessPoolExecutor

from router import GEN_FLEETS, MC_FLEETS, MOONCAKE, pools, trace_half

from burstrl.router.policies import NewSession, record_assignment
from burstrl.router.replay import load_mooncake
from burstrl.router.sim import RouterSimulator, SimReplica, TraceSession, generate_trace, load_config


class PressureSimulator(RouterSimulator):
    """`kv` plus moves of small sessions off a home whose live context is above `frac` of its KV."""

    def __init__(self, *args: object, frac: float, cheap: float, dest: float, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self.frac, self.cheap, self.dest = frac, cheap, dest
        self.pressure_moves = 0

    def home_for_call(self, s: TraceSession, idx: int) -> SimReplica:
        home, call = self.home[s.id], s.calls[idx]
        if not call.input_hashes or call.input_hashes[0] not in home.cache:
            return super().home_for_call(s, idx)  # evicted: `kv`'s own re-homing
        cap = home.view.capacity_tokens
        size = home.live.get(s.id, 0)
        if sum(home.view.live_sessions.values()) <= self.frac * cap or size > self.cheap * cap:
            return home
        past = self.past_homes.setdefault(s.id, [home])
        others = [v for v in self.views if all(v is not r.view for r in past)]
        if not others:
            return home
        session = NewSession(s.id, s.kind, "v1", expected_tokens=call.input_tokens,
                             prefix_hashes=call.input_hashes, block_tokens=self.cfg.block_size)
        view = self.policy.choose(session, others, self.rng)
        if sum(view.live_sessions.values()) + size > self.dest * view.capacity_tokens:
            return home
        record_assignment(view, session)
        new = self.by_view[id(view)]
        new.live[s.id] = home.live.pop(s.id)
        self.home[s.id] = new
        past.append(new)
        self.pressure_moves += 1
        return new


def pressure_job(seed: int, frac: float, cheap: float, dest: float, sessions: int) -> dict:
    """One uniform-fleet trace under `kv` as on main (frac 0) or with pressure moves."""
    cfg = load_config(seed=seed, sessions=sessions, arrival_rate=5.0, size_prior_tokens=32768,
                      pools=pools(GEN_FLEETS["uniform"]), release_finished=True)
    t0 = time.perf_counter()
    if frac > 0:
        sim = PressureSimulator(cfg, generate_trace(cfg), "kv", frac=frac, cheap=cheap, dest=dest)
    else:
        sim = RouterSimulator(cfg, generate_trace(cfg), "kv")
    fig = sim.run()
    return {"probe": "pressure", "seed": seed, "variant": f"{frac}/{cheap}/{dest}" if frac > 0 else "kv",
            "hit_rate": round(fig["hit_rate"], 4), "throughput_tok_s": round(fig["throughput_tok_s"]),
            "p99_rollout_s": round(fig["p99_rollout_s"], 1), "rehomes_after_eviction": fig["rehomes"],
            "pressure_moves": getattr(sim, "pressure_moves", 0), "wall_s": round(time.perf_counter() - t0, 1)}


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
    parser.add_argument("--variants", default="0.9/0.1/0.6,0.95/0.1/0.6",
                        help="pressure: frac/cheap/dest triples (kv as on main always runs beside them)")
    parser.add_argument("--cell", default="infer/uniform/1", help="tail: mode/fleet/rate")
    parser.add_argument("--policies", default="kv,least_requests,smooth_wrr,cache_aware,headroom", help="tail")
    parser.add_argument("--half", choices=("all", "first", "second"), default="second", help="tail")
    parser.add_argument("--trace", default=str(MOONCAKE))
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    if args.probe == "pressure":
        variants = [(0.0, 0.0, 0.0)] + [tuple(float(x) for x in v.split("/")) for v in args.variants.split(",") if v]
        jobs = [(pressure_job, seed, *v, args.sessions) for v in variants for seed in seeds]
    else:
        jobs = [(tail_job, args.cell, p, seed, args.half, args.trace) for p in args.policies.split(",") for seed in seeds]
    with ProcessPoolExecutor(args.workers) as pool:
        for future in [pool.submit(fn, *a) for fn, *a in jobs]:  # in submission order
            print(json.dumps(future.result()), flush=True)


if __name__ == "__main__":
    main()
