"""Shared fleet vs dedicated fleets at equal replicas, simulated (issue 51): 128 replicas, 10 RL runs.

Each case runs both modes on the same seeded workload (`burstrl.router.tenant_sim`) and prints
one JSON line per case, then a table. Figures: aggregate rollouts/s and trainer steps per hour,
per-tenant steps/h and share of served rollouts vs weight (Jain's index over share / weight,
counted while every tenant has work), p50/p95 session latency (submission to the router -> last
call answered), and the headline ratio shared / dedicated steps per hour.

Cases:
- equal: 10 tenants of weight 1.
- unequal: weights 1,1,1,1,1,2,2,2,4,4; a run's batch is in proportion to its weight (a bigger
  run), the total batch volume as in `equal`.
- flood: `equal`, but tenant t0 submits 10x its share of the fleet's session places at once
  (2048 sessions, no in-flight limit) as one batch; the check is that every other tenant's steps
  per hour on the shared fleet stay >= its steps per hour on its dedicated share.
- sync (`--cases sync`): `equal` with async_level 0 (on-policy runs: a batch only after the
  previous step), where trainer pauses leave a dedicated fleet idle.

Assumptions (the simulator's, stated beside the figures in docs/benchmarks.md):
- Cost model: `burstrl.router.sim`'s, unchanged: 128 replicas of weight 1, 200k KV tokens each,
  256-token blocks, LRU block eviction, finished rollouts released; a call costs prefill 1/20000 s
  per uncached token plus 20 ms + 0.5 ms per running sequence per generated token; 32 concurrent
  sequences per replica; placement by the `kv` policy on 2 s-stale scrapes.
- Rollouts: sim.py's `swe` kind: 8-30 calls, 3000-token first prompt, +600 tool and +250
  generated tokens per call (exponential), 3 s mean tool gap; GRPO groups of 8 share a first prompt.
- Runs: batch 128 sessions (16 prompts x 8) per step; trainer step 30-120 s (uniform per run,
  drawn from the seed) x uniform(0.8, 1.2) per step; async_level 1 (batch s + 1 samples while step
  s trains, as prime-rl's default); at most batch x (1 + async_level) sessions in flight per run; a
  batch's groups arrive as a Poisson burst over ~10 s; runs start within the first 60 s.
- Router: at most 16 admitted sessions per replica (200k KV / ~12k mean live tokens of a session);
  waiting sessions queue per tenant and a free place goes to the fewest admitted per unit of weight.
- Dedicated: tenant i gets 128 * w_i / sum(w) replicas, largest remainder (equal weights: 8 x 13 +
  2 x 12).
- Not modelled: network and router latency, weight sync (a new version appears at no cost and
  does not gate routing), LoRA adapter swaps or adapter memory, preemptions, replica loss,
  sandboxes (a tool call is a timed gap), failed or retried rollouts, trainer contention.

    nice -n 19 .venv/bin/python benchmarks/shared_fleet_sim.py                 # equal, unequal, flood: ~10 min on 2 busy cores
    nice -n 19 .venv/bin/python benchmarks/shared_fleet_sim.py --cases sync
    nice -n 19 .venv/bin/python benchmarks/shared_fleet_sim.py --quick         # smoke test (32 replicas, 600 s)
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time

from burstrl.router.tenant_sim import TenantSimConfig, TenantSpec, jain, run_modes

UNEQUAL = [1, 1, 1, 1, 1, 2, 2, 2, 4, 4]
GOALS = {"ratio": 1.3, "fairness": 0.9}


def tenants(case: str, count: int, seed: int, replicas: int, per_replica: int, batch: int) -> list[TenantSpec]:
    """The runs of a case; step times and start offsets drawn from the seed (the same in both modes)."""
    rng = random.Random(seed)
    weights = UNEQUAL[:count] if case == "unequal" else [1.0] * count
    specs = []
    for i, w in enumerate(weights):
        group = 8
        b = batch if case != "unequal" else max(group, round(batch * count * w / sum(weights) / group) * group)
        specs.append(TenantSpec(f"t{i}", weight=w, batch=b, group_size=group, step_s=rng.uniform(30, 120),
                                async_level=0 if case == "sync" else 1, start_s=rng.uniform(0, 60)))
    if case == "flood":
        flood = 10 * replicas * per_replica // count  # 10x its share of the fleet's session places
        specs[0] = TenantSpec("t0", batch=flood, step_s=specs[0].step_s, async_level=0, burst_s=0.0, max_in_flight=flood,
                              start_s=specs[0].start_s)
    return specs


def summarize(case: str, res: dict[str, dict]) -> dict:
    shared, dedicated = res["shared"], res["dedicated"]
    out = {"case": case, "ratio_steps_per_hour": shared["steps_per_hour"] / max(dedicated["steps_per_hour"], 1e-9),
           "ratio_rollouts_per_s": shared["rollouts_per_s"] / max(dedicated["rollouts_per_s"], 1e-9)}
    if case == "flood":  # the others: at least their dedicated share?
        others = [(s, d) for s, d in zip(shared["tenants"], dedicated["tenants"], strict=True) if s["name"] != "t0"]
        out["others_min_steps_ratio"] = min(s["steps_per_hour"] / max(d["steps_per_hour"], 1e-9) for s, d in others)
        out["others_min_rollouts_ratio"] = min(s["rollouts"] / max(d["rollouts"], 1) for s, d in others)
        out["others_jain_shared"] = jain([s["rollouts"] / s["weight"] for s, _ in others])
        out["flood_slot_share_shared"] = shared["tenants"][0]["slot_share"]
    return out


def table(rows: list[dict]) -> str:
    cols = ["case", "mode", "steps_per_hour", "rollouts_per_s", "p50_session_s", "p95_session_s", "jain_all_active",
            "jain_backlogged", "slot_occupancy"]
    lines = [cols]
    for r in rows:
        for mode in ("shared", "dedicated"):
            f = r[mode]
            lines.append([r["case"], mode] + [f"{f[c]:.3f}" if isinstance(f[c], float) else str(f[c]) for c in cols[2:]])
    widths = [max(len(x[i]) for x in lines) for i in range(len(cols))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(x, widths, strict=True)) for x in lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default="equal,unequal,flood")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--replicas", type=int, default=128)
    ap.add_argument("--tenants", type=int, default=10)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--horizon", type=float, default=1800.0)
    ap.add_argument("--quick", action="store_true", help="32 replicas, 600 s")
    args = ap.parse_args()
    if args.quick:
        args.replicas, args.horizon, args.batch = 32, 600.0, 32
    per_replica = 16
    rows = []
    for case in args.cases.split(","):
        cfg = TenantSimConfig(tenants=tenants(case, args.tenants, args.seed, args.replicas, per_replica, args.batch),
                              replicas=args.replicas, sessions_per_replica=per_replica, horizon_s=args.horizon,
                              seed=args.seed)
        t0 = time.perf_counter()
        res = run_modes(cfg)
        row = {**summarize(case, res), **res, "wall_s": round(time.perf_counter() - t0, 1), "seed": args.seed,
               "replicas": args.replicas, "horizon_s": args.horizon,
               "specs": [{"name": s.name, "weight": s.weight, "batch": s.batch, "step_s": round(s.step_s, 1),
                          "async_level": s.async_level} for s in cfg.tenants]}
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(table(rows), file=sys.stderr)
    for r in rows:
        extra = {k: round(v, 3) for k, v in r.items() if k.startswith(("ratio", "others", "flood"))}
        print(f"{r['case']}: {extra} (goal ratio >= {GOALS['ratio']}, fairness >= {GOALS['fairness']})", file=sys.stderr)


if __name__ == "__main__":
    main()
