"""Prefix sharing keyed by adapter version (issue 14): the fix's cost and effect, old vs new code, in one run.

Commit 9eb5497 keys every KV cache and shared prefix block by (adapter version, tokens); before it
(409ce38) blocks were keyed by tokens only, so a session on one version could reuse keys/values
computed under another. This script runs the same client code against both trees, side by side:

1. single-version groups: the GRPO-shaped workload of benchmarks/replica.py (3b) (`agent_*`: a
   system prompt shared by all sessions + a task prompt shared by each group of attempts,
   multi-turn token-in prompts), every session on one random LoRA (`policy-v1`) -> prefix-cache
   hit rate against the workload's ceiling (goal >= 0.95 of it, and >= 0.95 absolute as replica.py's
   `agent_cache_hit_rate`) and wall time, new / old;
2. mixed-version groups: the same prompts, session i on `base`, `policy-v1`, `policy-v2` in turn
   (so every group spans the three versions) -> hit rate per side, and exactness: every call is
   replayed alone on a fresh replica with no session cache and no prefix sharing (same code), and
   its ids and logprobs are checked against the version's own HF/PEFT forward over prompt +
   completion (one forward per session); a call is wrong if its greedy ids differ from the solo run,
   a logprob differs from that forward by more than 1e-4, or an id is not its argmax ->
   `wrong_calls` (the single-version calls get the forward check, not the solo replay).

Each side runs in a subprocess of this script (`--side new|old`) with `PYTHONPATH=<tree>/src`
prepended; the subprocess prints which `burstrl` it imported and refuses to run from another tree.
The old tree is a git worktree of 409ce38 at /tmp/burstrl-409ce38, created if missing (and then
removed at exit unless --keep-worktree). Sides alternate (old, new / new, old ...) `--repeats`
times, `--runs` timed single-version runs each (a small untimed workload on every version first
takes first-call costs off the clock); single-version times are medians over all runs, `*_best`
use the best run of each side (noise only adds time), `cpu_s` is the process's CPU time (less
sensitive to other load on a shared machine), `prefix_ms` the engine thread's time in the prefix
bookkeeping the fix changed (PrefixTimer): the fix's own cost. The mixed-version part and the
exactness checks run in the first round. The workload helpers (`make_workload`, `run_sessions`, `hit_ceiling`,
`TokenSource`, `start_replica`) are benchmarks/replica.py's, imported from its path; its `_request`
is swapped for one that puts each session on its version and keeps every Request.

Prints one JSON object (one line) on stdout; progress goes to stderr.

    .venv/bin/python benchmarks/prefix_versions.py            # full run, ~3.5 min on 2 cores
    .venv/bin/python benchmarks/prefix_versions.py --quick    # smoke test, ~1 min
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OLD_REF = "409ce38"
VERSIONS = ("base", "policy-v1", "policy-v2")  # mixed groups: session i runs on VERSIONS[i % 3]
SINGLE = "policy-v1"
TOLERANCE = 1e-4  # nats: a call whose logprobs differ from its version's own forward by more is wrong
SIDE = ""


def log(msg: str) -> None:
    who = f"bench-prefix-versions{' ' + SIDE if SIDE else ''}"
    print(f"[{who} {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=".cache/tiny-qwen3", help="HF model dir (the tiny one is made if missing)")
    p.add_argument("--quick", action="store_true", help="small sizes for a smoke test (< 90 s)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    p.add_argument("--threads", type=int, default=0, help="torch threads of each side's engine; 0 = the cores")
    p.add_argument("--repeats", type=int, help="alternating old/new rounds, medians kept [3; quick 1]")
    p.add_argument("--runs", type=int, help="timed single-version runs per side per round [1]")
    p.add_argument("--sessions", type=int, help="concurrent sessions [20; quick 6]")
    p.add_argument("--turns", type=int, help="calls per session [10; quick 4]")
    p.add_argument("--tool-tokens", type=int, help="new 'tool output' ids per turn [20]")
    p.add_argument("--turn-tokens", type=int, help="max_tokens per call [16; quick 8]")
    p.add_argument("--agent-system", type=int, help="system-prompt ids shared by all sessions [256; quick 64]")
    p.add_argument("--agent-task", type=int, help="task ids shared by a group [64; quick 32]")
    p.add_argument("--agent-group", type=int, help="sessions per group (GRPO attempts of a task) [5; quick 3]")
    p.add_argument("--new-tree", default=str(ROOT), help="tree of the new code [this checkout]")
    p.add_argument("--old-tree", default=f"/tmp/burstrl-{OLD_REF}", help="git worktree of the pre-fix code")
    p.add_argument("--old-ref", default=OLD_REF, help="commit checked out in --old-tree when it is created")
    p.add_argument("--keep-worktree", action="store_true", help="keep --old-tree if this run created it")
    # internal: one side, run by the parent in a subprocess
    p.add_argument("--side", choices=("new", "old"), help=argparse.SUPPRESS)
    p.add_argument("--tree", help=argparse.SUPPRESS)
    p.add_argument("--adapters", help=argparse.SUPPRESS)
    p.add_argument("--mixed", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    # (3b) of benchmarks/replica.py, full and quick
    full = {"repeats": 3, "runs": 1, "sessions": 20, "turns": 10, "tool_tokens": 20, "turn_tokens": 16,
            "agent_system": 256, "agent_task": 64, "agent_group": 5}
    quick = dict(full, repeats=1, runs=1, sessions=6, turns=4, turn_tokens=8, agent_system=64, agent_task=32,
                 agent_group=3)
    for key, value in (quick if args.quick else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def digest(obj: object) -> str:
    return hashlib.sha256(json.dumps(obj).encode()).hexdigest()[:16]


# ================================================================ one side (a subprocess)

def load_replica_bench():
    """benchmarks/replica.py as a module (from this file's directory, whichever burstrl is imported)."""
    path = Path(__file__).resolve().parent / "replica.py"
    spec = importlib.util.spec_from_file_location("bench_replica", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


class VersionedCalls:
    """Stands in for replica.py's `_request`: each session runs on its version; every Request is kept.

    `run_sessions` names sessions f"{tag}-s{i}"; session i gets `versions[i]`.
    """

    def __init__(self, R, versions: list[str]) -> None:
        from burstrl.inference.engine import Request

        self.R, self.Request, self.versions = R, Request, versions
        self.requests: list = []

    def __call__(self, rep, rid: str, session_id: str | None, prompt: list[int], max_tokens: int, on_done):
        _, sep, index = (session_id or "").rpartition("-s")
        if not sep or not index.isdigit():
            raise RuntimeError(f"unexpected session id {session_id!r} from run_sessions")
        version = self.versions[int(index)]
        adapter = None if version == "base" else rep.registry.for_new_session(version)
        session = rep.sessions.begin(session_id, version, rid)
        req = self.Request(id=rid, session=session, prompt_ids=list(prompt), params=self.R.greedy(max_tokens),
                           version=version, adapter=adapter, on_done=on_done)
        self.requests.append(req)
        return req


class PrefixTimer:
    """Time spent in the prefix-cache bookkeeping, on the engine thread: the part the fix touched.

    Wraps (per instance) SessionCache.take/share/put/add_running/remove_running and
    Engine._better_after, whose keys gained the namespace (`share` now forks block tables, no copy).
    """

    CACHE = ("take", "share", "put", "add_running", "remove_running")

    def __init__(self, engine) -> None:
        self.seconds, self.calls = 0.0, 0
        for owner, names in ((engine.cache, self.CACHE), (engine, ("_better_after",))):
            for name in names:
                setattr(owner, name, self._timed(getattr(owner, name)))

    def _timed(self, inner):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0
                self.calls += 1
        return timed


def run_versioned(R, rep, work, versions: list[str], tag: str, timer: PrefixTimer | None = None):
    """replica.py's run_sessions with session i on versions[i]; returns (SessionRun, its Requests)."""
    calls, inner = VersionedCalls(R, versions), R._request
    R._request = calls
    cpu, spent, counted = time.process_time(), timer.seconds if timer else 0.0, timer.calls if timer else 0
    try:
        run = R.run_sessions(rep, work, tag)
    finally:
        R._request = inner
    run.cpu_s = time.process_time() - cpu  # this process, all threads: less sensitive to other load
    run.prefix_ms = 1e3 * (timer.seconds - spent) if timer else 0.0
    run.prefix_calls = timer.calls - counted if timer else 0
    return run, calls.requests


def solo_runs(R, rep, reqs: list) -> list:
    """Every call again, alone (one at a time) on `rep`: same version, prompt and max_tokens."""
    from burstrl.inference.engine import Request

    out = []
    for k, r in enumerate(reqs):
        done = threading.Event()
        adapter = None if r.version == "base" else rep.registry.for_new_session(r.version)
        session = rep.sessions.begin(None, r.version, f"solo-{k}")
        ref = Request(id=f"solo-{k}", session=session, prompt_ids=list(r.prompt_ids),
                      params=R.greedy(r.params.max_tokens), version=r.version, adapter=adapter,
                      on_done=lambda _, d=done: d.set())
        rep.engine.submit(ref)
        if not done.wait(timeout=600):
            raise TimeoutError("solo call did not finish in 600 s")
        if ref.error:
            raise RuntimeError(f"solo call failed: {ref.error}")
        out.append(ref)
    return out


def hf_references(model_dir: Path, adapters: dict[str, Path]) -> dict:
    """version -> HF model (PEFT-wrapped for adapters), float32 on CPU as the engine runs here."""
    from peft import PeftModel

    from burstrl.model.hf import load_model

    models = {"base": load_model(model_dir, "float32", "cpu")}
    for name, path in adapters.items():
        models[name] = PeftModel.from_pretrained(load_model(model_dir, "float32", "cpu"), str(path)).eval()
    return models


def teacher_forced(models: dict, reqs: list) -> dict[str, tuple]:
    """request id -> (log-softmax, argmax) at its completion positions, from the version's own forward.

    One forward per session: a later call's prompt extends the earlier calls' prompt + completion,
    so the session's last sequence holds every call of it as a prefix (checked).
    """
    import torch

    by_session: dict[str, list] = {}
    for r in reqs:
        by_session.setdefault(r.session.id, []).append(r)
    out = {}
    for calls in by_session.values():
        full = max((r.prompt_ids + r.completion_ids for r in calls), key=len)
        with torch.inference_mode():
            logp = torch.log_softmax(models[calls[0].version](torch.tensor([full])).logits[0].float(), dim=-1)
        for r in calls:
            seq, start = r.prompt_ids + r.completion_ids, len(r.prompt_ids) - 1
            if full[:len(seq)] != seq:
                raise RuntimeError(f"call {r.id} is not a prefix of its session's last call")
            at = logp[start:start + len(r.completion_ids)]
            out[r.id] = (at, at.argmax(-1))
    return out


def exactness(reqs: list, refs: list | None, models: dict) -> dict:
    """Wrong calls: greedy ids differ from the call's solo run (when `refs`), or a logprob differs by
    more than TOLERANCE from the version's own HF/PEFT forward over the call's prompt + completion,
    or an id is not that forward's argmax. The solo runs are checked against the forward too."""
    import torch

    forward = teacher_forced(models, reqs)
    wrong_ids = wrong_lp = wrong_argmax = wrong_turn0 = solo_checked = 0
    max_err = solo_err = 0.0
    wrong_by_version: dict[str, int] = {}
    for k, r in enumerate(reqs):
        logp, argmax = forward[r.id]
        ids = torch.tensor(r.completion_ids)
        ref_lp = logp.gather(1, ids[:, None])[:, 0]
        err = float((torch.tensor(r.logprobs) - ref_lp).abs().max()) if len(ids) else 0.0
        max_err = max(max_err, err)
        bad_argmax = bool((argmax != ids).any())
        ids_differ = refs is not None and refs[k].completion_ids != r.completion_ids
        if refs is not None and not ids_differ:  # same ids: the solo run's logprobs are comparable too
            solo_err = max(solo_err, float((torch.tensor(refs[k].logprobs) - ref_lp).abs().max()))
            solo_checked += 1
        wrong_ids += ids_differ
        wrong_lp += err > TOLERANCE
        wrong_argmax += bad_argmax
        if ids_differ or err > TOLERANCE or bad_argmax:
            wrong_by_version[r.version] = wrong_by_version.get(r.version, 0) + 1
            wrong_turn0 += r.id.endswith("-0")
    return {"calls": len(reqs), "wrong_calls": sum(wrong_by_version.values()),
            "wrong_ids_calls": wrong_ids if refs is not None else None, "wrong_logprob_calls": wrong_lp,
            "wrong_argmax_calls": wrong_argmax, "wrong_first_turn_calls": wrong_turn0,
            "wrong_by_version": wrong_by_version, "max_abs_logprob_err": round(max_err, 6),
            "solo_max_abs_logprob_err": round(solo_err, 6) if refs is not None else None,
            "solo_calls_checked": solo_checked if refs is not None else None}


def version_ceiling(R, run, work, versions: list[str]) -> float:
    """replica.py's hit_ceiling when a first prompt may only copy from earlier sessions of its version."""
    total = sum(sum(lens) for lens in run.prompt_lens)
    lost = 0
    for i in range(1, work.sessions):
        n = len(work.first[i])
        blind = n - 1 if i % work.group else min(work.system, n - 1)
        same = [j for j in range(i) if versions[j] == versions[i]]
        if any(j // work.group == i // work.group for j in same):
            aware = n - 1
        elif same:
            aware = min(work.system, n - 1)
        else:
            aware = 0
        lost += blind - aware
    return R.hit_ceiling(run, work) - lost / total


def hit_figures(run, reqs: list, ceiling: float) -> dict:
    rate = run.hit_tokens / run.query_tokens if run.query_tokens else 0.0
    by_version: dict[str, list[int]] = {}
    for r in reqs:
        acc = by_version.setdefault(r.version, [0, 0])
        acc[0] += r.cached_tokens
        acc[1] += len(r.prompt_ids)
    return {"hit_rate": round(rate, 4), "ceiling": round(ceiling, 4),
            "hit_vs_ceiling": round(rate / ceiling, 4) if ceiling else 0.0,
            "hit_tokens": run.hit_tokens, "query_tokens": run.query_tokens,
            "hit_rate_by_version": {v: round(h / q, 4) for v, (h, q) in sorted(by_version.items())},
            "wall_s": round(run.wall_s, 4), "cpu_s": round(run.cpu_s, 4), "prefix_ms": round(run.prefix_ms, 3),
            "prefix_calls": run.prefix_calls, "outputs_digest": digest(run.outputs)}


def side_main(args: argparse.Namespace) -> int:
    global SIDE
    SIDE = args.side
    import burstrl

    where = Path(burstrl.__file__).resolve()
    log(f"burstrl imported from {where}")
    if not where.is_relative_to(Path(args.tree).resolve() / "src"):
        raise SystemExit(f"side {args.side}: burstrl comes from {where}, not from {args.tree}/src")
    R = load_replica_bench()
    model_dir = R.ensure_model(args.model)
    adapters = {v: Path(args.adapters) / v for v in VERSIONS if v != "base"}
    work_dir = tempfile.TemporaryDirectory(prefix=f"bench-prefix-{args.side}-")
    rep = R.start_replica(model_dir, f"{work_dir.name}/a", session_cache=True, prefix_sharing=True,
                          capture=True, num_threads=args.threads)
    try:
        for name, path in adapters.items():
            rep.registry.load(name, path)
        vocab, special = int(rep.engine.runner.model.config.vocab_size), list(rep.tokenizer.all_special_ids)
        src = R.TokenSource(vocab, special, args.seed)
        work = R.make_workload(src, args.sessions, args.turns, args.agent_task, args.tool_tokens,
                               args.turn_tokens, system=args.agent_system, group=args.agent_group)
        warm = R.make_workload(R.TokenSource(vocab, special, args.seed + 99), 3, 2, 40, 4, 4)
        timer = PrefixTimer(rep.engine)
        run_versioned(R, rep, warm, list(VERSIONS), "warm")  # first-call costs of every version off the clock
        timed, single_reqs = [], []
        for j in range(max(1, args.runs)):  # each run releases its sessions: the next starts from an empty cache
            single, reqs = run_versioned(R, rep, work, [SINGLE] * work.sessions, f"single{j}", timer)
            timed.append(hit_figures(single, reqs, R.hit_ceiling(single, work)))
            single_reqs = single_reqs or reqs  # the first run's calls are checked for exactness
            log(f"single-version run {j + 1}/{args.runs}: {single.wall_s:.3f} s (cpu {single.cpu_s:.2f} s, "
                f"prefix bookkeeping {single.prefix_ms:.1f} ms), "
                f"hit rate {timed[-1]['hit_rate']} (ceiling {timed[-1]['ceiling']})")
        out = {"side": args.side, "burstrl": str(where), "workload_digest": digest([work.first, work.tool]),
               "single": {**timed[0], "runs": timed}}
        if args.mixed:
            versions = [VERSIONS[i % len(VERSIONS)] for i in range(work.sessions)]
            mixed, mixed_reqs = run_versioned(R, rep, work, versions, "mixed", timer)
            out["mixed"] = hit_figures(mixed, mixed_reqs, version_ceiling(R, mixed, work, versions))
            out["mixed"]["ceiling_version_blind"] = round(R.hit_ceiling(mixed, work), 4)
            log(f"mixed-version: {mixed.wall_s:.3f} s, hit rate {out['mixed']['hit_rate']}")
    finally:
        rep.close()
    if args.mixed:  # the reference: every call alone, no session cache, no prefix sharing
        ref = R.start_replica(model_dir, f"{work_dir.name}/b", session_cache=False, prefix_sharing=False,
                              capture=False, num_threads=args.threads)
        try:
            for name, path in adapters.items():
                ref.registry.load(name, path)
            t0 = time.perf_counter()
            models = hf_references(model_dir, adapters)
            out["single"].update(exactness(single_reqs, None, models))
            out["mixed"].update(exactness(mixed_reqs, solo_runs(R, ref, mixed_reqs), models))
            log(f"solo replays of {len(mixed_reqs)} calls, HF forwards of {2 * work.sessions} sessions: "
                f"{time.perf_counter() - t0:.1f} s; "
                f"wrong calls: "
                f"single {out['single']['wrong_calls']}, mixed {out['mixed']['wrong_calls']}")
        finally:
            ref.close()
    work_dir.cleanup()
    print(json.dumps(out), flush=True)
    return 0


# ================================================================ the parent: both sides, alternating

def git(tree: str | Path, *cmd: str) -> str:
    done = subprocess.run(["git", "-C", str(tree), *cmd], check=True, capture_output=True, text=True)
    return done.stdout.rstrip("\n")


def ensure_old_tree(args: argparse.Namespace) -> bool:
    """The pre-fix tree as a git worktree; True if this run created it."""
    tree = Path(args.old_tree)
    want = git(ROOT, "rev-parse", f"{args.old_ref}^{{commit}}")
    if (tree / "src" / "burstrl").is_dir():
        have = git(tree, "rev-parse", "HEAD")
        if have != want:
            raise SystemExit(f"{tree} is at {have[:12]}, not {args.old_ref} ({want[:12]})")
        log(f"old code: existing worktree {tree} at {have[:12]}")
        return False
    log(f"old code: {tree} missing, creating it: git worktree add --detach {tree} {args.old_ref}")
    git(ROOT, "worktree", "add", "--detach", str(tree), want)
    return True


def tree_info(tree: str | Path) -> dict:
    dirty = git(tree, "status", "--porcelain", "--", "src").splitlines()
    return {"tree": str(tree), "commit": git(tree, "rev-parse", "--short=12", "HEAD"),
            "src_uncommitted": [line[3:] for line in dirty]}


def run_side(args: argparse.Namespace, side: str, tree: str, adapters: str, mixed: bool) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(Path(tree) / "src"), *filter(None, [env.get("PYTHONPATH")])])
    cmd = [sys.executable, str(Path(__file__).resolve()), "--side", side, "--tree", tree, "--adapters", adapters,
           "--model", args.model, "--seed", str(args.seed), "--threads", str(args.threads),
           "--runs", str(args.runs),
           "--sessions", str(args.sessions), "--turns", str(args.turns), "--tool-tokens", str(args.tool_tokens),
           "--turn-tokens", str(args.turn_tokens), "--agent-system", str(args.agent_system),
           "--agent-task", str(args.agent_task), "--agent-group", str(args.agent_group)]
    if mixed:
        cmd.append("--mixed")
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, check=False, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True, timeout=900)
    if proc.returncode != 0:
        raise SystemExit(f"side {side} failed (exit {proc.returncode})")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["process_s"] = round(time.perf_counter() - t0, 1)
    return result


def summarize(runs: dict[str, list[dict]], args: argparse.Namespace) -> dict:
    single: dict = {}
    for side in ("new", "old"):
        rs = [t for r in runs[side] for t in r["single"]["runs"]]  # every timed run, round by round
        hits, queries = sum(r["hit_tokens"] for r in rs), sum(r["query_tokens"] for r in rs)
        first = runs[side][0]["single"]
        single[side] = {
            "hit_rate": round(hits / queries, 4), "ceiling": first["ceiling"],
            "hit_vs_ceiling": round(hits / queries / first["ceiling"], 4),
            "hit_rate_runs": [r["hit_rate"] for r in rs],
            "wall_s": round(statistics.median(r["wall_s"] for r in rs), 4),
            "cpu_s": round(statistics.median(r["cpu_s"] for r in rs), 4),
            "prefix_ms": round(statistics.median(r["prefix_ms"] for r in rs), 3),
            "prefix_calls": first["prefix_calls"],
            "raw_s": [r["wall_s"] for r in rs],
            "raw_cpu_s": [r["cpu_s"] for r in rs],
            "raw_prefix_ms": [r["prefix_ms"] for r in rs],
            **{k: first[k] for k in ("calls", "wrong_calls", "wrong_argmax_calls", "max_abs_logprob_err")},
        }
    new, old = single["new"], single["old"]
    single["wall_new_vs_old"] = round(new["wall_s"] / old["wall_s"], 3)
    single["wall_new_vs_old_best"] = round(min(new["raw_s"]) / min(old["raw_s"]), 3)
    single["cpu_new_vs_old"] = round(new["cpu_s"] / old["cpu_s"], 3)
    single["prefix_ms_new_vs_old"] = round(new["prefix_ms"] / old["prefix_ms"], 3)
    single["prefix_ms_new_vs_old_best"] = round(min(new["raw_prefix_ms"]) / min(old["raw_prefix_ms"]), 3)
    single["hit_rate_new_vs_old"] = round(new["hit_rate"] / old["hit_rate"], 4)
    digests = {t["outputs_digest"] for side in runs for r in runs[side] for t in r["single"]["runs"]}
    single["outputs_identical_all_runs"] = len(digests) == 1  # greedy, same prompts: old = new here
    keep = ("hit_rate", "ceiling", "ceiling_version_blind", "hit_rate_by_version", "wall_s", "prefix_ms", "calls",
            "wrong_calls", "wrong_ids_calls", "wrong_logprob_calls", "wrong_argmax_calls",
            "wrong_first_turn_calls", "wrong_by_version", "max_abs_logprob_err", "solo_max_abs_logprob_err",
            "solo_calls_checked")
    mixed = {side: {k: runs[side][0]["mixed"][k] for k in keep} for side in ("new", "old")}
    mixed["hit_rate_new_vs_old"] = round(mixed["new"]["hit_rate"] / mixed["old"]["hit_rate"], 4)
    mixed["hit_rate_lost"] = round(mixed["old"]["hit_rate"] - mixed["new"]["hit_rate"], 4)
    mixed["new_vs_its_ceiling"] = round(mixed["new"]["hit_rate"] / mixed["new"]["ceiling"], 4)
    mixed["wall_new_vs_old"] = round(mixed["new"]["wall_s"] / mixed["old"]["wall_s"], 3)
    goals = {
        "single_hit_vs_ceiling": {"value": new["hit_vs_ceiling"], "goal": ">= 0.95",
                                  "met": new["hit_vs_ceiling"] >= 0.95},
        "single_hit_rate": {"value": new["hit_rate"], "goal": ">= 0.95", "met": new["hit_rate"] >= 0.95,
                            "workload_ceiling": new["ceiling"]},
        "mixed_wrong_calls_new": {"value": mixed["new"]["wrong_calls"], "goal": "== 0",
                                  "met": mixed["new"]["wrong_calls"] == 0},
        "single_wrong_calls_new": {"value": new["wrong_calls"], "goal": "== 0", "met": new["wrong_calls"] == 0},
    }
    return {"single_version": single, "mixed_versions": mixed, "goals": goals}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.side:
        return side_main(args)
    t_start = time.perf_counter()
    created = ensure_old_tree(args)
    try:
        from burstrl.model.lora import make_random_adapter
        from burstrl.model.tiny import ensure_tiny_model

        model_dir = Path(args.model)
        if not (model_dir / "config.json").exists():
            log(f"{model_dir} missing: making the tiny model")
            ensure_tiny_model(model_dir)
        adapters = tempfile.TemporaryDirectory(prefix="bench-prefix-adapters-")
        for seed, name in enumerate(VERSIONS[1:], start=1):
            make_random_adapter(model_dir, Path(adapters.name) / name, seed=seed)
        log(f"adapters {VERSIONS[1:]} (random LoRA, seeds 1, 2) in {adapters.name}")
        trees = {"new": args.new_tree, "old": args.old_tree}
        runs: dict[str, list[dict]] = {"new": [], "old": []}
        for k in range(args.repeats):
            for side in ("old", "new") if k % 2 == 0 else ("new", "old"):
                log(f"round {k + 1}/{args.repeats}: side {side} ({trees[side]})")
                runs[side].append(run_side(args, side, trees[side], adapters.name, mixed=k == 0))
        adapters.cleanup()
        workloads = {r["workload_digest"] for side in runs for r in runs[side]}
        if len(workloads) != 1:
            raise SystemExit(f"the sides generated different workloads: {workloads}")
        sides = {side: {**tree_info(trees[side]), "burstrl": runs[side][0]["burstrl"],
                        "process_s": [r["process_s"] for r in runs[side]]} for side in runs}
    finally:
        if created and not args.keep_worktree:
            git(ROOT, "worktree", "remove", "--force", args.old_tree)
            log(f"removed the worktree {args.old_tree} this run created")
    import torch

    result = {"benchmark": "prefix_versions", **summarize(runs, args), "sides": sides,
              "workload": {"sessions": args.sessions, "turns": args.turns, "system_ids": args.agent_system,
                           "task_ids": args.agent_task, "group": args.agent_group,
                           "tool_ids_per_turn": args.tool_tokens, "tokens_per_call": args.turn_tokens,
                           "single_version": SINGLE, "mixed_versions": "session i on " + "/".join(VERSIONS)
                           + "[i % 3]", "digest": workloads.pop()},
              "env": {"python": platform.python_version(), "torch": torch.__version__,
                      "load_avg": [round(x, 2) for x in os.getloadavg()], "cores": os.cpu_count()},
              "args": {k: v for k, v in vars(args).items() if k not in ("side", "tree", "adapters", "mixed")},
              "total_s": round(time.perf_counter() - t_start, 1)}
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
