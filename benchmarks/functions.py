"""Does RL through the whole loop teach a real pretrained model to write code? (issue 35)

Gemma 3 270M (the base model, `make gemma`), one-function Python problems (`envs/functions`):
1. before: `burstrl eval --env functions` of the base model on held-out test tasks (templates and
   constants training never sees), K attempts each at the RL temperature, 48 tokens;
2. RL: `burstrl run examples/functions-gemma.toml` for `--steps` steps (router, replica on the fast
   path with capture, sandboxes with the sealed test run, store, LoRA trainer, pushes);
3. after: the same eval of the run's last adapter, `--compare` against (1): the paired bootstrap
   interval of the lift per metric (resampling tasks);
4. what was learned: each attempt's failure kind (`envs/functions/env.py` `failure_kind`: ok, empty,
   syntax, error, timeout, wrong, partial, suspicious...) counted before and after;
5. where a step's time goes: the trainer's wait (sampling + grading) and compute per step, from the
   run's metrics.

Engine and dtype: `--engine vllm` serves the RL run's replica and both evals' replicas on vLLM
(`--engine.backend vllm --engine.vllm.kv_cache_gib 2`; `make vllm` first), `--dtype bfloat16` loads
the model in bf16 for all three (`--model.dtype` of the run, `--model_dtype` of `burstrl eval`), so
the lift is measured on the engine and precision the policy was trained with. Both are in the result.

The before-eval runs beside RL by default (`--before-alongside`: the results do not depend on timing,
sampling seeds are fixed); with `--engine vllm` it runs first, since each vLLM replica binds the cores
it may use and two on the same cores slow each other down many times over. Wall time, steps, groups and load are in the output.

    .venv/bin/python benchmarks/functions.py --model ~/.cache/burstrl/gemma-3-270m
    .venv/bin/python benchmarks/functions.py --model DIR --quick    # 8 tasks x 4, 2 steps: a smoke run
    .venv/bin/python benchmarks/functions.py --model DIR --engine vllm --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))


def burstrl(*args: str, timeout: float = 14400) -> str:
    r = subprocess.run([sys.executable, "-c", "from burstrl.cli import main; main()", *args], capture_output=True,
                       text=True, timeout=timeout)
    if r.returncode != 0:
        raise RuntimeError(f"burstrl {' '.join(args[:2])} failed ({r.returncode}):\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
    return r.stdout


def summary(out: Path) -> dict:
    results = json.loads((out / "results.json").read_text())
    keep = ("pass@1", "pass@2", "pass@4", "pass@8", "f2p", "n_tasks", "attempts", "resolved", "infra_failures")
    s = {k: v for k, v in results["summary"]["overall"].items() if k in keep}
    if "comparison" in results:
        s["comparison"] = {m: results["comparison"][m] for m in ("pass@1", "f2p") if m in results["comparison"]}
    kinds = Counter(str(r.get("extra", {}).get("kind", "?")) for r in _records(results))
    s["kinds"] = dict(sorted(kinds.items()))
    return s


def _records(results: dict) -> list[dict]:
    for key in ("records", "attempts"):
        if isinstance(results.get(key), list):
            return results[key]
    return [r for task in results.get("tasks", []) for r in task.get("records", [])]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="Gemma 3 270M directory (`make gemma`)")
    p.add_argument("--tasks", type=int, default=40, help="held-out test tasks [40; quick 8]")
    p.add_argument("--attempts", type=int, default=8, help="attempts per task (K) [8; quick 4]")
    p.add_argument("--steps", type=int, default=20, help="RL steps [20; quick 2]")
    p.add_argument("--groups", type=int, default=4, help="groups per step [4; quick 2]")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--before-alongside", action=argparse.BooleanOptionalAction, default=None,
                   help="run the before-eval beside RL [yes; no with --engine vllm: each vLLM binds its cores]")
    p.add_argument("--work-dir", default="", help="keep everything here (default: a temp dir)")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--engine", choices=("burstrl", "vllm"), default="burstrl",
                   help="engine of every replica (RL run and both evals) [burstrl]")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="model dtype of every replica and of the trainer [float32]")
    args = p.parse_args()
    if args.before_alongside is None:
        args.before_alongside = args.engine != "vllm"
    if args.quick:
        args.tasks, args.attempts, args.steps, args.groups = 8, 4, 2, 2
    model = str(Path(args.model).expanduser())
    result: dict = {"benchmark": "functions", "model": model, "tasks": args.tasks, "attempts": args.attempts,
                    "steps": args.steps, "groups_per_step": args.groups, "temperature": args.temperature,
                    "engine": args.engine, "dtype": args.dtype, "before_alongside": args.before_alongside,
                    "load_at_start": os.getloadavg()[0], "cores": os.cpu_count()}
    with tempfile.TemporaryDirectory(prefix="bench-functions-") as tmp:
        root = Path(args.work_dir).absolute() if args.work_dir else Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        engine_args = ["--engine.backend", args.engine]
        engine_args += ["--engine.vllm.kv_cache_gib", "2"] if args.engine == "vllm" else []
        evals = ["--model", model, "--env", "functions", "--n", str(args.tasks), "--split", "test", "--attempts",
                 str(args.attempts), "--temperature", str(args.temperature), "--max-tokens", "48",
                 "--env-option", f"n_tasks={max(300, args.tasks)}", "--env-option", "max_sandboxes=4",
                 *engine_args, "--model_dtype", args.dtype]
        t0 = time.monotonic()
        with ThreadPoolExecutor(max_workers=2, thread_name_prefix="bench") as ex:
            before = ex.submit(burstrl, "eval", *evals, "--out", str(root / "before"))
            if not args.before_alongside:
                before.result()
            ex.submit(burstrl, "run", str(REPO / "examples" / "functions-gemma.toml"), "--run_dir", str(root / "run"),
                      "--model.path", model, "--trainer.steps", str(args.steps), "--trainer.batch_groups",
                      str(args.groups), "--orchestrator.temperature", str(args.temperature), *engine_args,
                      "--model.dtype", args.dtype).result()
            before.result()
        result["before_and_rl_wall_s"] = round(time.monotonic() - t0, 1)
        result["before"] = summary(root / "before")
        metrics = [json.loads(line) for line in (root / "run" / "metrics.jsonl").read_text().splitlines()]
        result["rl_reward_by_step"] = [round(m["reward_mean"], 3) for m in metrics]
        result["rl_step_wait_s"] = [round(m["wait_s"], 1) for m in metrics]
        result["rl_step_compute_s"] = [round(m["compute_s"], 1) for m in metrics]
        result["rl_ratio_max"] = max(m["ratio_max"] for m in metrics)
        # behaviour (captured) vs the trainer's recomputed logprobs, per step before its update
        result["rl_ratio_mean_by_step"] = [round(m.get("ratio_mean", float("nan")), 4) for m in metrics]
        result["rl_ratio_outside_frac_by_step"] = [round(m.get("ratio_outside_frac", float("nan")), 4) for m in metrics]
        adapter = root / "run" / "adapters" / f"policy-v{args.steps}"
        t1 = time.monotonic()
        burstrl("eval", *evals, "--adapter", str(adapter), "--out", str(root / "after"), "--compare", str(root / "before"))
        result["after_eval_wall_s"] = round(time.monotonic() - t1, 1)
        result["after"] = summary(root / "after")
        result["total_wall_s"] = round(time.monotonic() - t0, 1)
        if args.work_dir:
            (root / "result.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
