"""Agentic coding on toy tasks: held-out scores before and after RL, and grading throughput.

In one invocation on this machine:
1. held-out tasks: `burstrl tasks make-toy` of difficulty 0 (the statement gives the line, file
   and fragment; the fix is one copied `sed` and a commit) from a seed no training task uses
   (`--seed`), checked with `burstrl tasks check`; with `--split test` also templates and words
   the training split never uses;
2. before: `burstrl eval` of the warm-started tiny model (SFT on the generator's demonstration
   trajectories), K attempts per task at the RL sampling temperature and with the RL agent's limits
   (turns, tokens per call); with `--before-alongside` at the same time as (3);
3. RL: `burstrl run examples/toy-swe.toml` from that model;
4. after: `burstrl eval` of the run's last adapter with `--compare` against (2): the paired
   bootstrap interval of the lift per metric (resampling tasks);
5. grading throughput: attempts graded per minute with N = 1, 4, 8 sandboxes at once, gold and
   empty patches alternating.

    .venv/bin/python benchmarks/swe.py                 # 40 tasks x 4 attempts, 20 RL steps
    .venv/bin/python benchmarks/swe.py --quick         # 6 tasks x 2 attempts, 3 RL steps
    .venv/bin/python benchmarks/swe.py --warm forgetful   # from the warm start with a sampled flaw
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

if TYPE_CHECKING:
    from burstrl.envs.swe.task import SweTask


def burstrl(*args: str, timeout: float = 7200) -> str:
    r = subprocess.run([sys.executable, "-c", "from burstrl.cli import main; main()", *args], capture_output=True,
                       text=True, timeout=timeout)
    if r.returncode != 0:
        raise RuntimeError(f"burstrl {' '.join(args[:2])} failed ({r.returncode}):\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
    return r.stdout


def overall(out: Path) -> dict:
    results = json.loads((out / "results.json").read_text())
    keep = ("pass@1", "pass@2", "pass@4", "pass@8", "f2p", "strict", "n_tasks", "attempts", "resolved", "apply_failures",
            "infra_failures")
    return {k: v for k, v in results["summary"]["overall"].items() if k in keep} | (
        {"comparison": {m: results["comparison"][m] for m in ("pass@1", "f2p", "strict") if m in results["comparison"]}}
        if "comparison" in results else {})


def grading_throughput(tasks: Sequence[SweTask], patches: Sequence[str], pool: Any, n: int,
                       timeout_s: float = 300) -> dict[str, Any]:
    """Grade `patches[i]` for `tasks[i]` with `n` graders at once; attempts graded per minute.

    The base exports are made (and cached) before the clock starts: the figure is the grading
    itself, which is what scales with sandboxes.
    """
    from burstrl.envs.swe.grade import base_tar, grade

    for task in {t.instance_id: t for t in tasks}.values():
        base_tar(task)
    start = time.monotonic()
    with ThreadPoolExecutor(max_workers=n, thread_name_prefix="grader") as ex:
        results = list(ex.map(lambda tp: grade(tp[0], tp[1], pool, timeout_s=timeout_s), zip(tasks, patches, strict=False)))
    seconds = time.monotonic() - start
    return {"n": n, "attempts": len(results), "seconds": round(seconds, 3),
            "per_minute": round(60 * len(results) / seconds, 1) if seconds > 0 else 0.0,
            "resolved": sum(r.resolved for r in results),
            "infra_errors": sum(bool(r.infra_error) for r in results),
            "failures": [r.reason or r.infra_error or r.model_error for r in results if not r.resolved]}


def throughput(root: Path, n_tasks: int) -> dict:
    from burstrl.envs.swe.toygen import make_toy_tasks
    from burstrl.sandbox.pool import SandboxPool

    tasks = make_toy_tasks(root / "grade-tasks", n_tasks, seed=5, difficulty=1, split="train")
    patches = [t.patch if i % 2 == 0 else "" for i, t in enumerate(tasks)]
    out = {}
    for n in (1, 4, 8):
        with SandboxPool("namespace", max_concurrent=n) as pool:
            out[str(n)] = grading_throughput(tasks, patches, pool, n)
    return out


def rl_overrides(pairs: list[str]) -> list[str]:
    """`key=value` pairs as `burstrl run` flags (`--key value`)."""
    flags = []
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"--rl-override wants KEY=VALUE, got {pair!r}")
        flags += [f"--{key}", value]
    return flags


def agent_limits(overrides: list[str]) -> tuple[int, int]:
    """(max_turns, max_tokens_per_call) of the RL run's agent: examples/toy-swe.toml with the overrides.

    Why: the evals must give the agent the limits it is trained under (before 2026-12-01's fifth
    session they used `burstrl eval`'s own defaults, 6 turns of 128 tokens, against RL's 2 of 160).
    """
    import tomllib

    swe = tomllib.loads((REPO / "examples" / "toy-swe.toml").read_text())["orchestrator"]["swe"]
    limits = {"max_turns": swe["max_turns"], "max_tokens_per_call": swe["max_tokens_per_call"]}
    for pair in overrides:
        key, _, value = pair.partition("=")
        name = key.removeprefix("orchestrator.swe.")
        if name != key and name in limits:
            limits[name] = int(value)
    return limits["max_turns"], limits["max_tokens_per_call"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=40)
    parser.add_argument("--attempts", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seed", type=int, default=7, help="Seed of the held-out tasks (training uses 0, the "
                        "warm start 1000 and 2000).")
    parser.add_argument("--split", default="train", help="train: unseen tasks of the training templates and "
                        "words; test: other templates and words too.")
    parser.add_argument("--difficulty", type=int, default=0)
    parser.add_argument("--temperature", type=float, default=0.7, help="Sampling temperature of both evals "
                        "and of the RL run.")
    parser.add_argument("--model", default="", help="Warm-started model dir; default: the cached recipe "
                        "(`envs.swe.warm`, built on first use).")
    parser.add_argument("--warm", choices=("plain", "forgetful"), default="plain", help="Which cached warm start "
                        "when --model is empty: forgetful also leaves out the commit half the time "
                        "(`envs.swe.warm`: a sampled flaw for RL to fix).")
    parser.add_argument("--no-throughput", action="store_true")
    parser.add_argument("--rl-override", action="append", default=[], metavar="KEY=VALUE",
                        help="A dotted override for the RL run (repeatable), e.g. trainer.lr=3e-3.")
    parser.add_argument("--before-alongside", action="store_true", help="Run the before-eval at the same time "
                        "as the RL run (both start from the warm start) instead of first.")
    parser.add_argument("--work-dir", default="", help="Keep the tasks, evals and the run here (an empty or new "
                        "dir) instead of a temporary dir.")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.tasks, args.attempts, args.steps = 6, 2, 3
    from burstrl.launcher.preflight import quickstart_swe_model

    t0 = time.monotonic()
    model = Path(args.model) if args.model else quickstart_swe_model(forgetful=args.warm == "forgetful")
    result: dict = {"model": str(model), "warm": "given" if args.model else args.warm,
                    "warm_start_s": round(time.monotonic() - t0, 1), "tasks": args.tasks,
                    "attempts": args.attempts, "rl_steps": args.steps, "seed": args.seed, "split": args.split,
                    "difficulty": args.difficulty, "temperature": args.temperature, "rl_overrides": args.rl_override}
    with tempfile.TemporaryDirectory(prefix="bench-swe-") as tmp:
        root = Path(args.work_dir).absolute() if args.work_dir else Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        burstrl("tasks", "make-toy", str(root / "test"), "--n", str(args.tasks), "--split", args.split, "--seed",
                str(args.seed), "--difficulty", str(args.difficulty))
        tasks = root / "test" / "tasks.jsonl"
        # exit 1 just means some task is flawed: those ids are excluded below
        subprocess.run([sys.executable, "-c", "from burstrl.cli import main; main()", "tasks", "check", str(tasks),
                        "--flawed-out", str(root / "flawed.txt")], capture_output=True, text=True)
        flawed = root / "flawed.txt"
        result["flawed_tasks"] = len(flawed.read_text().split()) if flawed.exists() else 0
        exclude = ["--exclude", str(flawed)] if result["flawed_tasks"] else []
        max_turns, max_tokens = agent_limits(args.rl_override)
        result["eval_agent_limits"] = {"max_turns": max_turns, "max_tokens_per_call": max_tokens}
        evals = ["--model", str(model), "--tasks", str(tasks), "--attempts", str(args.attempts), "--temperature",
                 str(args.temperature), "--max-turns", str(max_turns), "--swe.max_tokens_per_call", str(max_tokens), *exclude]
        t1 = time.monotonic()
        with ThreadPoolExecutor(max_workers=2, thread_name_prefix="bench") as ex:
            # The before-eval depends only on the warm start: alongside the RL run it uses the cores the
            # run leaves idle (the results do not depend on timing: sampling seeds are fixed).
            before = ex.submit(burstrl, "eval", *evals, "--out", str(root / "before"))
            if not args.before_alongside:
                before.result()
            ex.submit(burstrl, "run", str(REPO / "examples" / "toy-swe.toml"), "--run_dir", str(root / "run"),
                      "--model.path", str(model), "--trainer.steps", str(args.steps), "--orchestrator.temperature",
                      str(args.temperature), *rl_overrides(args.rl_override)).result()
            before.result()
        result["before"] = overall(root / "before")
        result["before_and_rl_wall_s"] = round(time.monotonic() - t1, 1)
        metrics = [json.loads(line) for line in (root / "run" / "metrics.jsonl").read_text().splitlines()]
        result["rl_reward_first5"] = sum(m["reward_mean"] for m in metrics[:5]) / min(5, len(metrics))
        result["rl_reward_last5"] = sum(m["reward_mean"] for m in metrics[-5:]) / min(5, len(metrics))
        adapter = root / "run" / "adapters" / f"policy-v{args.steps}"
        burstrl("eval", *evals, "--adapter", str(adapter), "--out", str(root / "after"), "--compare", str(root / "before"))
        result["after"] = overall(root / "after")
        result["rl_reward_by_step"] = [round(m["reward_mean"], 3) for m in metrics]
        result["rl_kept_groups_by_step"] = [m["kept_groups"] for m in metrics]
        if not args.no_throughput:
            result["grading_per_minute"] = throughput(root, 16 if args.quick else 48)
        if args.work_dir:
            (root / "result.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
