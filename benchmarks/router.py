"""Router benchmark: the default `kv` policy against every baseline, simulated and live.

Simulated (`--part generated`, `--part mooncake`), every figure per seed (0-4 by default), then the
median and worst over seeds; each run is one JSON line as it finishes, then a summary line.

- generated: agentic rollouts (`burstrl.router.sim.generate_trace`, 4000 sessions at 5 new/s) on a
  mixed fleet (4 reserved replicas of weight 8 and 1.6M KV tokens, 32 on-demand of weight 1 and
  200k) and a uniform one (64 x 200k, the same total KV). `kv` and `headroom` at K = 2, 3, 4.
  `hit_rate` = cached / previously computed context tokens. A finished rollout's blocks are freed
  (the orchestrator releases it); `--keep-finished` keeps them in the LRU (the model before).
- mooncake: Mooncake's production conversation trace (`../shared/traces`, 512-token blocks), per
  request and with sessions inferred from hash chains, 1x and 4x its rate, on the default fleet
  (2 x weight 8 / 1.6M + 8 x weight 1 / 200k) and a uniform one (24 x 200k, the same KV), plus the
  pooled reference (one replica with the whole fleet's KV and weight). `prefix_hit_rate` = cached /
  all input tokens; latency is per call (`p99_call_s`), since inferred sessions span minutes.
  `--half first` (the half `kv`'s weight was chosen on) or `--half second` (held out).

`--live` (or `--part live`): real replicas (`burstrl serve`, tiny model) behind the real router,
multi-turn token-in sessions with tool gaps, groups of sessions sharing a first prompt (GRPO), on
an equal pool and a heterogeneous one (different KV budgets and weights); `kv` vs `round_robin`
vs `cache_aware`, a fresh router each, the same workload, after one unmeasured warm-up pass.
`--aa` runs round_robin a second time each round (`round_robin_again`): the ratio of a policy to
itself on the same workload is the noise floor of every live ratio (`--fleets equal` picks a pool).
`--chat`: the same workload as chat sessions (`messages` of words, the first prompt shared by a
group; each turn appends the reply and a user message), `kv` with the router's text prefix keys
(`router.text_prefix_keys`, router/text_keys.py) against `kv_text_off` (placed by load alone).

    .venv/bin/python benchmarks/router.py --part generated --workers 2     # ~1 h on 2 busy cores
    .venv/bin/python benchmarks/router.py --part mooncake --workers 2
    .venv/bin/python benchmarks/router.py --live [--rounds 3] [--aa] [--fleets equal]
    .venv/bin/python benchmarks/router.py --live --chat --fleets equal [--rounds 3]  # text keys on vs off: ~1.5 / 3 min
    .venv/bin/python benchmarks/router.py --part generated --quick          # smoke test
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor, as_completed
from pathlib import Path

import httpx

from burstrl.protocol import process
from burstrl.protocol.process import RoleProcess, start_replica
from burstrl.router.replay import load_mooncake
from burstrl.router.sim import PoolSpec, RouterSimulator, TraceSession, generate_trace, load_config

MOONCAKE = Path(__file__).resolve().parents[1] / ".." / "shared" / "traces" / "mooncake_conversation_trace.jsonl"
GEN_FLEETS = {"mixed": [("reserved", 4, 8, 1_600_000), ("on_demand", 32, 1, 200_000)],
              "uniform": [("on_demand", 64, 1, 200_000)]}
MC_FLEETS = {"default": [("reserved", 2, 8, 1_600_000), ("on_demand", 8, 1, 200_000)],
             "uniform": [("on_demand", 24, 1, 200_000)], "pooled": [("reserved", 1, 24, 4_800_000)]}
KEYS = ("hit_rate", "prefix_hit_rate", "throughput_tok_s", "p99_rollout_s", "p99_call_s", "p50_call_s",
        "evicted_tokens", "rehomes", "rehomes_pressure", "kv_live_peak")


def pools(spec: list[tuple]) -> list[PoolSpec]:
    return [PoolSpec(*p) for p in spec]


def gen_job(fleet: str, seed: int, policy: str, k: int, sessions: int, rate: float, release: bool = True,
            eviction: str = "block", group_size: int = 1) -> dict:
    cfg = load_config(seed=seed, sessions=sessions, arrival_rate=rate, size_prior_tokens=32768,
                      pools=pools(GEN_FLEETS[fleet]), release_finished=release, eviction=eviction,
                      group_size=group_size)
    t0 = time.perf_counter()
    fig = RouterSimulator(cfg, generate_trace(cfg), policy, k=k).run()
    label = f"{policy}_k{k}" if policy in ("kv", "headroom") else policy
    return {"part": "generated", "fleet": fleet, "seed": seed, "policy": label, "release_finished": release,
            "eviction": eviction, "group_size": group_size,
            "wall_s": round(time.perf_counter() - t0, 1), **{key: fig[key] for key in KEYS}}


def trace_half(trace: list[TraceSession], half: str) -> list[TraceSession]:
    """`all`, or the first or second half of the sessions by arrival (the second re-timed to start at 0).

    Why: `kv`'s weight was chosen on the first half; the second half is held out.
    """
    if half == "all":
        return trace
    mid = len(trace) // 2
    if half == "first":
        return trace[:mid]
    rest = trace[mid:]
    t0 = rest[0].arrival_s
    return [TraceSession(s.id, s.kind, s.arrival_s - t0,
                         [dataclasses.replace(c, not_before_s=c.not_before_s - t0) for c in s.calls]) for s in rest]


def mc_job(mode: str, fleet: str, scale: float, seed: int, policy: str, trace_path: str, half: str = "all") -> dict:
    trace = trace_half(load_mooncake(trace_path, sessions=mode, rate_scale=scale), half)
    pooled = policy == "pooled"
    cfg = load_config(seed=seed, block_size=512, pools=pools(MC_FLEETS["pooled" if pooled else fleet]))
    t0 = time.perf_counter()
    fig = RouterSimulator(cfg, trace, "round_robin" if pooled else policy).run()
    return {"part": "mooncake", "mode": mode, "fleet": fleet, "rate_scale": scale, "half": half, "seed": seed,
            "policy": policy,
            "wall_s": round(time.perf_counter() - t0, 1), **{key: fig[key] for key in KEYS}}


def run_jobs(jobs: list[tuple], workers: int) -> list[dict]:
    """Every job in a process pool; each result printed as one JSON line as soon as it is done."""
    results = []
    with ProcessPoolExecutor(workers) as pool:
        futures = [pool.submit(fn, *args) for fn, *args in jobs]
        for future in as_completed(futures):
            results.append(future.result())
            print(json.dumps(results[-1]), flush=True)
    return results


def spread(values: list[float], higher_better: bool) -> dict:
    return {"median": statistics.median(values), "worst": min(values) if higher_better else max(values)}


def summarize(results: list[dict], cell_keys: tuple[str, ...], metrics: dict[str, bool], default: str) -> dict:
    """Per cell and policy: median and worst over seeds; and whether `default` is at least as good as
    every other policy (a baseline) on every metric, at the median and at every seed."""
    cells: dict[tuple, dict[str, dict[int, dict]]] = {}
    for r in results:
        cells.setdefault(tuple(r[k] for k in cell_keys), {}).setdefault(r["policy"], {})[r["seed"]] = r
    out = {}
    for cell, by_policy in sorted(cells.items(), key=lambda kv: str(kv[0])):
        figures = {p: {m: spread([s[m] for s in seeds.values()], hb) for m, hb in metrics.items()}
                   for p, seeds in by_policy.items()}
        losses = []
        mine = by_policy.get(default, {})
        for p, seeds in by_policy.items():
            if p == default or p == "pooled" or p.startswith(default.split("_")[0] + "_"):
                continue
            for m, hb in metrics.items():
                for seed, r in seeds.items():
                    if seed in mine and (mine[seed][m] < r[m] if hb else mine[seed][m] > r[m]):
                        losses.append(f"{m} vs {p} seed {seed}: {mine[seed][m]:.4g} vs {r[m]:.4g}")
        out["/".join(map(str, cell))] = {"figures": figures, "default_losses": losses}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("generated", "mooncake", "live"), default="generated")
    parser.add_argument("--seeds", default="0,1,2,3,4")
    parser.add_argument("--sessions", type=int, default=4000)
    parser.add_argument("--rate", type=float, default=5.0, help="new sessions per second (generated)")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--fleets", default="", help="comma-separated fleets, or pools for --live (default: all)")
    parser.add_argument("--policies", default="", help="comma-separated policies (default: kv and every baseline)")
    parser.add_argument("--trace", default=str(MOONCAKE))
    parser.add_argument("--ks", default="2,3,4", help="K values of kv (generated; baselines and headroom: K = 2)")
    parser.add_argument("--quick", action="store_true", help="a small generated trace, seed 0 only")
    parser.add_argument("--live", action="store_true", help="= --part live")
    parser.add_argument("--seed", type=int, default=0, help="live: workload seed")
    parser.add_argument("--rounds", type=int, default=1,
                        help="live: runs of every policy per pool (p99 over all their sessions; order rotated)")
    parser.add_argument("--aa", action="store_true",
                        help="live: run round_robin twice per round, to show one policy's spread against itself")
    parser.add_argument("--chat", action="store_true",
                        help="live: chat sessions, kv with text prefix keys vs kv_text_off (router.text_prefix_keys)")
    parser.add_argument("--keep-finished", action="store_true",
                        help="generated: finished sessions' blocks stay in the LRU (the model before 2026-12-01's fifth session)")
    parser.add_argument("--eviction", choices=("block", "session"), default="block",
                        help="generated: a full replica evicts LRU blocks (vLLM, SGLang) or LRU idle sessions whole "
                             "(burstrl's replica)")
    parser.add_argument("--group-size", type=int, default=1,
                        help="generated: sessions per GRPO group (they arrive together and share the first prompt)")
    parser.add_argument("--half", choices=("all", "first", "second"), default="all",
                        help="mooncake: the whole trace, or its first (tuning) or second (held-out) half of sessions")
    args = parser.parse_args()
    if args.live or args.part == "live":
        run_live(seed=args.seed, rounds=args.rounds, pools=tuple(args.fleets.split(",")) if args.fleets else tuple(POOLS),
                 aa=args.aa, chat=args.chat)
        return
    seeds = [0] if args.quick else [int(s) for s in args.seeds.split(",")]
    policies = args.policies.split(",") if args.policies else ["kv", "least_sessions", "headroom", "cache_aware",
                                                               "least_requests", "smooth_wrr", "weighted_random",
                                                               "round_robin", "random"]
    jobs: list[tuple] = []
    if args.part == "generated":
        sessions = 600 if args.quick else args.sessions
        fleets = args.fleets.split(",") if args.fleets else list(GEN_FLEETS)
        ks = [int(k) for k in args.ks.split(",")]
        runs = [(p, 2) for p in policies if p != "kv" or 2 in ks] + [("kv", k) for k in ks if k != 2]
        for policy, k in runs:  # policy-major: a run cut short still has whole policies over seeds
            for fleet in fleets:
                for seed in seeds:
                    jobs.append((gen_job, fleet, seed, policy, k, sessions, args.rate, not args.keep_finished,
                                 args.eviction, args.group_size))
        results = run_jobs(jobs, args.workers)
        metrics = {"hit_rate": True, "throughput_tok_s": True, "p99_rollout_s": False}
        summary = summarize(results, ("fleet",), metrics, "kv_k2")
        goals = {f"{r['fleet']} seed {r['seed']} {r['policy']}": r["hit_rate"]
                 for r in results if r["policy"].startswith("kv_") and r["hit_rate"] < 0.996}
        print(json.dumps({"benchmark": "router_generated", "seeds": seeds, "sessions": sessions, "rate": args.rate,
                          "release_finished": not args.keep_finished, "eviction": args.eviction,
                          "group_size": args.group_size,
                          "summary": summary, "kv_below_0.996": goals}))
        return
    mc_policies = args.policies.split(",") if args.policies else ["kv", "cache_aware", "pooled", "least_requests",
                                                                  "headroom", "least_sessions", "smooth_wrr",
                                                                  "weighted_random", "round_robin", "random"]
    for policy in mc_policies:  # policy-major: a run cut short still has whole policies over every cell
        for mode in ("request", "infer"):
            for fleet in args.fleets.split(",") if args.fleets else ("default", "uniform"):
                for scale in (1.0, 4.0):
                    for seed in seeds:
                        jobs.append((mc_job, mode, fleet, scale, seed, policy, args.trace, args.half))
    results = run_jobs(jobs, args.workers)
    metrics = {"prefix_hit_rate": True, "p99_call_s": False}
    summary = summarize(results, ("mode", "fleet", "rate_scale"), metrics, "kv")
    for cell in summary.values():
        figs = cell["figures"]
        if "kv" in figs and "pooled" in figs:
            cell["kv_vs_pooled_hit"] = figs["kv"]["prefix_hit_rate"]["median"] / max(
                figs["pooled"]["prefix_hit_rate"]["median"], 1e-12)
    print(json.dumps({"benchmark": "router_mooncake", "seeds": seeds, "half": args.half, "summary": summary}))


# --- live: real replicas behind the real router --------------------------------------------

ADMIN = "bench-admin-token"
CLUSTER = "bench-cluster-token"
LIVE = {"sessions": 48, "group": 4, "turns": 6, "concurrency": 12, "first_prompt": (150, 700),
        "new_ids_per_turn": 30, "max_tokens": 16, "tool_gap_s": (0.0, 0.4), "k": 2, "scrape_s": 0.5}
# (KV tokens, weight) per replica; the heterogeneous pool has the equal pool's total KV
POOLS = {"equal": [(3000, 1), (3000, 1), (3000, 1)], "hetero": [(5000, 2), (2000, 1), (2000, 1)]}
LIVE_POLICIES = ("kv", "round_robin", "cache_aware")
CHAT_POLICIES = ("kv", "kv_text_off")  # --chat: the router's text prefix keys on, then off
WORDS = ("apple river stone cloud seven orange quiet table music bridge lamp forest number paper window "
         "garden silver yellow engine planet").split()
COUNTERS = ("prefix_cache_hit_tokens", "prefix_cache_queries_tokens", "evictions", "thrash", "refills")


def start_router(workdir: Path, policy: str, replicas: list[str], pool: list[tuple[int, int]]) -> RoleProcess:
    """`burstrl route serve` as a child process, replicas registered with their weight and KV budget;
    `kv_text_off` is `kv` with `router.text_prefix_keys` off."""
    off = ("--text_prefix_keys", "false") if policy == "kv_text_off" else ()
    router = process.start_router(workdir, "--cluster_token", CLUSTER, "--policy", policy.removesuffix("_text_off"),
                                  "--k", str(LIVE["k"]), "--scrape_s", str(LIVE["scrape_s"]), *off)
    for url, (kv, weight) in zip(replicas, pool, strict=True):
        httpx.post(router.url + "/v1/replicas", json={"url": url, "weight": weight, "capacity_tokens": kv},
                   headers={"Authorization": f"Bearer {CLUSTER}"}, timeout=30).raise_for_status()
    return router


def replica_counters(urls: list[str]) -> dict[str, dict[str, int]]:
    return {u: {k: int(httpx.get(u + "/v1/loads", timeout=30).json()[k]) for k in COUNTERS} for u in urls}


def run_session(router_url: str, sid: str, first: list[int], rng: random.Random, chat: bool = False) -> tuple[float, str]:
    """One rollout: `turns` token-in calls, each prompt = previous prompt + completion + tool ids, a tool gap
    between; `chat`: the same as messages (the first prompt's ids as words, new ids as a user message)."""
    client = httpx.Client(timeout=300)
    ids = list(first)
    messages = [{"role": "user", "content": words(first)}]
    t0 = time.perf_counter()
    for turn in range(LIVE["turns"]):
        if turn:
            time.sleep(rng.uniform(*LIVE["tool_gap_s"]))
        new = [rng.randrange(100, 2000) for _ in range(LIVE["new_ids_per_turn"])]
        if chat:
            messages += chat_turn(client, router_url, sid, messages, new)
            continue
        body = {"model": "base", "prompt": "", "input_ids": ids, "max_tokens": LIVE["max_tokens"],
                "temperature": 0, "ignore_eos": True, "return_token_ids": True, "session_id": sid}
        r = client.post(router_url + "/v1/completions", json=body)
        r.raise_for_status()
        ids = ids + r.json()["choices"][0]["token_ids"] + new
    elapsed = time.perf_counter() - t0
    # read and released through the router, as the orchestrator does: every replica that holds part
    # of the capture (a session moved off an overflowing home left its earlier calls there)
    admin = {"Authorization": f"Bearer {ADMIN}"}
    answer = client.get(router_url + f"/v1/traces/{sid}", headers=admin)
    answer.raise_for_status()
    trace = answer.json()
    if len(trace["calls"]) != LIVE["turns"]:
        raise RuntimeError(f"session {sid}: {len(trace['calls'])} of {LIVE['turns']} calls captured")
    client.delete(router_url + f"/v1/traces/{sid}", headers=admin).raise_for_status()
    client.close()
    return elapsed, trace["replica"]


def words(ids: list[int]) -> str:
    """Ids as words (~2.5 tiny-model tokens a word): a chat prompt as long as the token-in one, a third as many words."""
    return " ".join(WORDS[i % len(WORDS)] for i in ids[::3])


def chat_turn(client: httpx.Client, router_url: str, sid: str, messages: list[dict], new: list[int]) -> list[dict]:
    """One chat call of a session; the messages the next call appends: the reply as returned, then new words
    (the replica then continues the session's ids instead of re-tokenizing, as an agent's loop does)."""
    body = {"model": "base", "messages": messages, "max_tokens": LIVE["max_tokens"], "temperature": 0,
            "ignore_eos": True, "session_id": sid}
    r = client.post(router_url + "/v1/chat/completions", json=body)
    r.raise_for_status()
    reply = r.json()["choices"][0]["message"]
    return [{"role": "assistant", "content": reply["content"]}, {"role": "user", "content": words(new)}]


def run_policy(policy: str, replicas: list[str], pool: list[tuple[int, int]], workdir: Path, seed: int,
               tag: str = "", chat: bool = False) -> dict:
    """The workload through a fresh router with `policy`: the replicas' counter deltas, rollout times, homes."""
    rng = random.Random(seed)  # the same prompts for every policy; a group of sessions shares its first prompt
    lo, hi = LIVE["first_prompt"]
    groups = [[rng.randrange(100, 2000) for _ in range(rng.randint(lo, hi))]
              for _ in range(LIVE["sessions"] // LIVE["group"])]
    firsts = [groups[i // LIVE["group"]] for i in range(LIVE["sessions"])]
    router = start_router(workdir / f"{policy}{tag}", policy, replicas, pool)
    try:
        before = replica_counters(replicas)
        t0 = time.perf_counter()
        with ThreadPoolExecutor(LIVE["concurrency"]) as threads:
            results = list(threads.map(
                lambda i: run_session(router.url, f"{policy}{tag}-{i}", firsts[i], random.Random(seed + i), chat),
                range(LIVE["sessions"])))
        wall = time.perf_counter() - t0
        after = replica_counters(replicas)
        totals = httpx.get(router.url + "/v1/stats", timeout=30).json()["totals"]
    finally:
        router.stop()
    return {"delta": {k: sum(after[u][k] - before[u][k] for u in replicas) for k in COUNTERS},
            "times": [t for t, _ in results], "wall_s": wall, "rehomes": totals["rehomes"],
            "rehomes_overflow": totals.get("rehomes_overflow", 0), "rehomes_pressure": totals.get("rehomes_pressure", 0),
            "sessions_per_replica": [sum(1 for _, home in results if home == u) for u in replicas]}


def live_figures(runs: list[dict]) -> dict:
    """One policy's figures over its rounds: counters summed, mean and p99 over every session of every round."""
    delta = {k: sum(r["delta"][k] for r in runs) for k in COUNTERS}
    times = sorted(t for r in runs for t in r["times"])
    return {"hit_rate": delta["prefix_cache_hit_tokens"] / max(delta["prefix_cache_queries_tokens"], 1),
            "evictions": delta["evictions"], "thrash": delta["thrash"], "refills": delta["refills"],
            "mean_rollout_s": statistics.mean(times), "p99_rollout_s": times[min(len(times) - 1, int(0.99 * len(times)))],
            "sessions": len(times), "wall_s": sum(r["wall_s"] for r in runs),
            "rehomes": sum(r["rehomes"] for r in runs), "rehomes_overflow": sum(r["rehomes_overflow"] for r in runs),
            "rehomes_pressure": sum(r["rehomes_pressure"] for r in runs),
            "sessions_per_replica": [sum(col) for col in zip(*(r["sessions_per_replica"] for r in runs), strict=True)]}


def run_live(seed: int = 0, rounds: int = 1, pools: tuple[str, ...] = tuple(POOLS), aa: bool = False,
             chat: bool = False) -> None:
    """Every policy on each pool, `rounds` times; round r runs workload `seed + 100 r` and starts the
    policies at the r-th (rotated), so no policy always runs first on the pool's warmed replicas.

    `aa`: round_robin runs twice per round (the second as `round_robin_again`), so the ratios come
    with the spread of one policy against itself on the same workload: a p99 over a few hundred
    rollouts is their second- or third-highest, and moved by 10-15% from run to run on a 2-core
    machine (docs/benchmarks.md, "Router" and "router.py --live").
    """
    from burstrl.model.tiny import ensure_tiny_model

    model = ensure_tiny_model(Path(".cache/tiny-qwen3"))
    if chat and aa:
        raise SystemExit("--aa is round_robin against itself; --chat runs kv with and without text keys")
    policies = CHAT_POLICIES if chat else LIVE_POLICIES
    labels = policies + (("round_robin_again",) if aa else ())
    figures: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for name in pools:
            pool = POOLS[name]
            with ThreadPoolExecutor(len(pool)) as threads:
                procs = list(threads.map(lambda i, name=name, pool=pool: start_replica(
                    model, root / f"{name}{i}", "--server.admin_token", ADMIN, "--server.cluster_token", CLUSTER,
                    "--engine.num_threads", "1", "--engine.max_total_num_tokens", str(pool[i][0])), range(len(pool))))
            try:
                urls = [p.url for p in procs]
                run_policy("round_robin", urls, pool, root / f"{name}-warmup", seed + 1000, chat=chat)  # not measured
                runs: dict[str, list[dict]] = {label: [] for label in labels}
                for r in range(rounds):
                    for label in labels[r % len(labels):] + labels[:r % len(labels)]:
                        runs[label].append(run_policy(label.removesuffix("_again"), urls, pool, root / name,
                                                      seed + 100 * r, f"-{label}-r{r}", chat))
                        print(f"{name}/{label} round {r}: {json.dumps(live_figures(runs[label][-1:]))}",
                              file=sys.stderr, flush=True)
                for label in labels:
                    figures[f"{name}/{label}"] = live_figures(runs[label])
            finally:
                for p in procs:
                    p.stop()
    ratios = {}
    pairs = [("kv", other) for other in policies[1:]] + ([("round_robin_again", "round_robin")] if aa else [])
    for name in pools:
        for mine, other in pairs:
            a, b = figures[f"{name}/{mine}"], figures[f"{name}/{other}"]
            ratios[f"{name}/{mine}_vs_{other}"] = {"hit_rate": a["hit_rate"] / max(b["hit_rate"], 1e-12),
                                                   "p99_rollout": a["p99_rollout_s"] / b["p99_rollout_s"],
                                                   "mean_rollout": a["mean_rollout_s"] / b["mean_rollout_s"],
                                                   "throughput": b["wall_s"] / a["wall_s"]}
    print(json.dumps({"benchmark": "router_live", "config": LIVE, "pools": {p: POOLS[p] for p in pools}, "seed": seed,
                      "rounds": rounds, "aa": aa, "chat": chat,
                      "figures": figures, "ratios": ratios}))


if __name__ == "__main__":
    main()
