"""The warm start for coding tasks: full-weight SFT of a base model on toy-task demonstrations, cached.

Why: a random-init tiny model cannot write a bash command, so RL on coding tasks has no signal to
start from; supervised training on the generator's own correct trajectories (real commands, real
observations: `demos.demonstration_chat`) gives it the agent's format and a start. Built once per
recipe (base weights, task count, steps) and cached like `trainer.sft.ensure_warm_model`.
"""

from __future__ import annotations

import hashlib
import json
import sys
import tempfile
from pathlib import Path

from burstrl.atomic import build_dir

MARKER = "burstrl_swe_warm.json"
RECIPE_VERSION = 1
TASKS = 128
STEPS = 150
LR = 1e-3
BATCH_SIZE = 16


def recipe(base_dir: Path) -> dict:
    digest = hashlib.sha256()
    for path in sorted(base_dir.glob("*.safetensors")) + [base_dir / "config.json"]:
        digest.update(path.read_bytes())
    return {"version": RECIPE_VERSION, "base_sha256": digest.hexdigest(), "tasks": TASKS, "steps": STEPS,
            "lr": LR, "batch_size": BATCH_SIZE}


def ensure_swe_warm_model(base_dir: str | Path, out_dir: str | Path) -> Path:
    """`out_dir`: the base after SFT on demonstrations of TASKS toy tasks (train split, difficulty 1)."""
    from burstrl.envs.swe.demos import write_demonstrations
    from burstrl.envs.swe.toygen import make_task
    from burstrl.trainer.sft import sft

    base, out = Path(base_dir), Path(out_dir).absolute()
    want = recipe(base)
    if _has_recipe(out, want):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="swe-warm-", dir=out.parent) as tmp:
        print(f"[swe-warm] generating {TASKS} toy tasks and their demonstrations", file=sys.stderr, flush=True)
        tasks = [make_task(Path(tmp) / "tasks", i, seed=1000, difficulty=1, split="train") for i in range(TASKS)]
        demos = write_demonstrations(tasks, Path(tmp) / "demos.jsonl")

        def train(model: Path) -> None:  # into the temp dir that build_dir renames to `out`
            sft(base, demos, model, steps=STEPS, lr=LR, batch_size=BATCH_SIZE, log_every=50,
                device="cpu")
            (model / MARKER).write_text(json.dumps({"recipe": want}, indent=2) + "\n")

        # A racing first build (two runs, or a run and an eval) that published first wins; an
        # older recipe's cache is swapped out, never deleted under a reader.
        build_dir(out, train, force=out.exists(), accept=lambda winner: _has_recipe(winner, want))
    return out


def _has_recipe(out: Path, want: dict) -> bool:
    marker = out / MARKER
    return marker.is_file() and json.loads(marker.read_text()).get("recipe") == want
