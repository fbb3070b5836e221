"""`burstrl run` at several inference:trainer ratios, and through a 40% replica loss.

Figures, each from real `burstrl run` processes on this machine, in one invocation:
- trainer utilisation (sum of compute_s / sum of step_s over the run's steps) and mean staleness
  at 1:1, 2:1, 3:1, 4:1 replicas per trainer rank (reserved replicas, one trainer rank), with the
  push to the replicas in the background (the default) and inside the step;
- the outage: with 5 replicas, `--chaos.kill_fraction 0.4` kills 2 during step `steps // 2`; the
  ratio of that step's time to the median of its neighbours (12 groups a step by default, ~3 s) (reference: 37/35 min = 1.06; goal
  <= 1.10), and rollouts lost by id (the store's attempt ledger; must be 0).

Caveat that matters on a 2-core machine: replicas and the trainer share the same cores, so more
replicas also means less CPU for training; the ratios are this machine's, not a GPU cluster's.

    .venv/bin/python benchmarks/run.py            # 4 ratios + the outage, 16 steps each; ~10 min
    .venv/bin/python benchmarks/run.py --quick    # ratios 1,2 and the outage, 8 steps; ~2 min
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from burstrl.envs.toy_warm import ensure_warm_model  # noqa: E402
from burstrl.eval.report import summary  # noqa: E402
from burstrl.model.tiny import ensure_tiny_model  # noqa: E402
from burstrl.store import RolloutStore  # noqa: E402


def run(run_dir: Path, model: Path, steps: int, *overrides: str) -> dict:
    """One `burstrl run` to completion; its summary plus the store's audit and wall time."""
    cmd = [sys.executable, "-c", "from burstrl.cli import main; main()", "run", "--run_dir", str(run_dir),
           "--model.path", str(model), "--trainer.steps", str(steps), *overrides]
    t0 = time.monotonic()
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    wall = time.monotonic() - t0
    if out.returncode != 0:
        raise RuntimeError(f"burstrl run failed ({out.returncode}):\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}")
    figures = summary(run_dir)
    steps_ = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    phases = {f"{k}_mean": round(sum(m[k] for m in steps_) / len(steps_), 3)
              for k in ("wait_s", "compute_s", "checkpoint_s", "publish_s", "step_s")}
    with RolloutStore(run_dir / "store.sqlite") as store:
        audit = store.audit()
    return {"wall_s": round(wall, 1), "utilisation": _r(figures["utilisation"]),
            "staleness_mean": _r(figures["staleness_mean"]), "step_s_median": _r(figures["step_s_median"]),
            "reward_first": _r(figures["reward_first"]), "reward_last5": _r(figures["reward_last5"]),
            "rollouts_done": figures["rollouts_done"], "outage_ratio": _r(figures["outage_ratio"]),
            "outage_steps": figures.get("outage_steps"), "attempts": audit["attempts"], "lost": audit["lost"],
            "consumed_twice": audit["consumed_twice"], **phases}


def _r(x: float | None) -> float | None:
    return None if x is None else round(float(x), 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ratios", default="1,2,3,4", help="replicas per trainer rank, comma-separated")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--outage-batch-groups", type=int, default=12,
                        help="groups per step in the outage runs: longer steps, so a fixed blip weighs less")
    parser.add_argument("--quick", action="store_true", help="ratios 1,2 and the outage at 8 steps")
    args = parser.parse_args()
    if args.quick:
        args.ratios, args.steps = "1,2", 8
    model = ensure_warm_model(ensure_tiny_model(REPO / ".cache" / "tiny-qwen3"), REPO / ".cache" / "tiny-qwen3-warm")
    ratios = [int(r) for r in args.ratios.split(",")]
    results: dict = {"steps": args.steps, "config": "quickstart (toy + toy_multi, 4 groups x 8 per step, "
                     "1 trainer rank, engine.num_threads 1 per replica)", "ratios": {}}
    with tempfile.TemporaryDirectory(prefix="bench-run-") as tmp:
        results["ratios_sync_push"] = {}
        for r in ratios:  # the push in the background (default) and in the step, one after the other
            for key, push in (("ratios", "true"), ("ratios_sync_push", "false")):
                results[key][f"{r}:1"] = run(Path(tmp) / f"ratio-{r}-{key}", model, args.steps,
                                             "--fleet.reserved", str(r), "--fleet.on_demand", "0",
                                             "--weights.async_push", push)
                print(f"{key} {r}:1 -> {results[key][f'{r}:1']}", file=sys.stderr, flush=True)
        at = max(2, args.steps // 2)
        chaos = ["--fleet.reserved", "1", "--fleet.on_demand", "4", "--chaos.kill_fraction", "0.4",
                 "--chaos.at_step", str(at), "--trainer.batch_groups", str(args.outage_batch_groups)]
        # With replacement (the product's behaviour) the replacements' model loads share these two
        # cores with the trainer; without it, the ratio isolates the loss itself.
        for name, extra in (("outage", []), ("outage_no_replacement", ["--fleet.replace_dead", "false"])):
            results[name] = run(Path(tmp) / name, model, args.steps, *chaos, *extra)
            results[name]["kill_step"] = at
            print(f"{name} -> {results[name]}", file=sys.stderr, flush=True)
        results["reference_outage_ratio"] = round(37 / 35, 3)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
