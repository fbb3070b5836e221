"""The quickstart's learning curve: 30 steps of `burstrl run`, locally and on a local Ray instance.

What the suite's short learning tests (tests/e2e/test_run.py::test_quickstart_killed_mid_step_resumes_and_learns and, across a
launcher kill on Ray, tests/e2e/test_ray.py::test_kill_9_of_the_launcher_takes_every_actor_with_it_
then_resume_and_learn, 8 steps each; tests/integration/test_learning.py, 6 synchronous steps) no
longer measure: the whole curve. Per provider, one
`burstrl run` at the quickstart's batch (4 groups of 8, difficulty pinned to 1, selective
recomputation), from the warm-started tiny model:

- sampled reward: mean of the first 5 steps -> mean of the last 5 (the run's metrics.jsonl);
- greedy held-out reward: the warm model -> the final adapter, one held-out prompt per letter
  (plain HF in this process, the same score the tests use);
- wall time of the run.

    .venv/bin/python benchmarks/learning.py                    # local, then Ray; ~6-10 min
    .venv/bin/python benchmarks/learning.py --providers local  # ~3 min
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from burstrl.envs.toy_eval import held_out_greedy  # noqa: E402
from burstrl.envs.toy_warm import ensure_warm_model  # noqa: E402
from burstrl.model.tiny import ensure_tiny_model  # noqa: E402

QUICKSTART = ["--trainer.batch_groups", "4", "--orchestrator.group_size", "8",
              "--orchestrator.curriculum.max_difficulty", "1", "--trainer.activation_checkpointing", "attention",
              "--engine.num_threads", "1", "--trainer.num_threads", "1"]


def curve(run_dir: Path, model: Path, steps: int, *provider: str) -> dict:
    """One `burstrl run` to the end; its sampled and greedy figures."""
    cmd = [sys.executable, "-c", "from burstrl.cli import main; main()", "run", "--run_dir", str(run_dir),
           "--model.path", str(model), "--trainer.steps", str(steps), *QUICKSTART, *provider]
    t0 = time.monotonic()
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    wall = time.monotonic() - t0
    if out.returncode != 0:
        raise RuntimeError(f"burstrl run failed ({out.returncode}):\n{out.stderr[-3000:]}")
    rewards = [json.loads(line)["reward_mean"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {"wall_s": round(wall, 1), "sampled_first5": round(sum(rewards[:5]) / 5, 3),
            "sampled_last5": round(sum(rewards[-5:]) / 5, 3),
            "greedy_before": round(held_out_greedy(model, None), 3),
            "greedy_after": round(held_out_greedy(model, run_dir / "adapters" / f"policy-v{steps}"), 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--providers", default="local,ray", help="comma-separated: local, ray")
    args = parser.parse_args()
    model = ensure_warm_model(ensure_tiny_model(REPO / ".cache" / "tiny-qwen3"), REPO / ".cache" / "tiny-qwen3-warm")
    results: dict = {"steps": args.steps, "config": "quickstart (4 groups x 8, difficulty 1, 3 replicas)"}
    with tempfile.TemporaryDirectory(prefix="bench-learning-") as tmp:
        for provider in args.providers.split(","):
            if provider == "local":
                results["local"] = curve(Path(tmp) / "local", model, args.steps)
            elif provider == "ray":
                results["ray"] = _on_ray(Path(tmp), model, args.steps)
            else:
                parser.error(f"unknown provider {provider!r}")
            print(f"{provider} -> {results[provider]}", file=sys.stderr, flush=True)
    print(json.dumps(results))


def _on_ray(tmp: Path, model: Path, steps: int) -> dict:
    """The same run with every role but the orchestrator in a Ray actor, on a local Ray instance."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray

    ctx = ray.init(address="local", num_cpus=16, num_gpus=4, include_dashboard=False,
                   object_store_memory=100 * 2**20, log_to_driver=False)
    try:
        return curve(tmp / "ray", model, steps, "--provider", "ray", "--ray.address", ctx.address_info["gcs_address"])
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
