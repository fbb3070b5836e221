"""The warm start for coding tasks: full-weight SFT of a base model on toy-task demonstrations, cached.

Why: a random-init tiny model cannot write a bash command, so RL on coding tasks has no signal to
start from; supervised training on the generator's own correct trajectories (real commands, real
observations: `demos.demonstration_chat`) gives it the agent's format and a start. The demos are
of difficulty 0 (the statement names the line, file and fragment; the fix is one copied `sed`):
the one level a ~1M-parameter model can learn to solve at all, partly, so that RL has groups with
both outcomes to learn from. Two stages (600 tasks, then 1,200 with 600 new ones) because copying
exact literals generalises to unseen tasks only with more distinct examples than one stage's worth
of steps can use (600 steps on 400 tasks memorised them: 0 of 120 unseen tasks solved). Built once
per recipe and cached like `envs.toy_warm.ensure_warm_model`; 30-55 min on 2 cores.

The *forgetful* variant (`ensure_swe_forgetful_model`) adds one stage on top: SFT on new tasks'
demonstrations of which half leave out the commit (`sed ... && echo <sentinel>`), as a sloppy
demonstrator would. The grader reads only committed work, so such an attempt scores 0. Why: the
plain warm start's failures are systematic (a task it cannot copy it never copies: Pass@4 - Pass@1
is 5-9 points), so most GRPO groups have zero variance and 20 CPU steps move nothing measurable;
a flaw *sampled* on every attempt gives every group both outcomes, which is the case RL is for:
learning from reward alone which of the demonstrated habits pays. 10-20 min on 2 cores, cached.
"""

from __future__ import annotations

import hashlib
import json
import sys
import tempfile
from pathlib import Path

from burstrl.atomic import build_dir

MARKER = "burstrl_swe_warm.json"
RECIPE_VERSION = 2
DIFFICULTY = 0
# Each stage: {task seed: number of tasks} it trains on (train split), its steps and its RNG seed.
STAGES = ({"tasks": {1000: 600}, "steps": 300, "seed": 0},
          {"tasks": {1000: 600, 2000: 600}, "steps": 400, "seed": 1})
LR = 1e-3
BATCH_SIZE = 16
FORGETFUL_MARKER = "burstrl_swe_forgetful.json"
# The forgetful stage: tasks of an unused seed, the share of demonstrations without the commit.
FORGETFUL = {"version": 1, "tasks": {3000: 1200}, "no_commit_share": 0.5, "choice_seed": 0, "steps": 150, "seed": 3,
             "lr": LR}


def recipe(base_dir: Path) -> dict:
    digest = hashlib.sha256()
    for path in sorted(base_dir.glob("*.safetensors")) + [base_dir / "config.json"]:
        digest.update(path.read_bytes())
    return {"version": RECIPE_VERSION, "base_sha256": digest.hexdigest(), "difficulty": DIFFICULTY,
            "stages": [{**st, "tasks": {str(k): v for k, v in st["tasks"].items()}} for st in STAGES],
            "lr": LR, "batch_size": BATCH_SIZE}


def ensure_swe_warm_model(base_dir: str | Path, out_dir: str | Path) -> Path:
    """`out_dir`: the base after the STAGES of SFT on difficulty-0 toy-task demonstrations."""
    from burstrl.trainer.sft import sft

    base, out = Path(base_dir), Path(out_dir).absolute()
    want = recipe(base)
    if _has_recipe(out, want):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="swe-warm-", dir=out.parent) as tmp:

        def train(final: Path) -> None:  # into the temp dir that build_dir renames to `out`
            model = base
            for i, stage in enumerate(STAGES):
                demos = _stage_demos(Path(tmp), stage["tasks"])
                last = i == len(STAGES) - 1
                print(f"[swe-warm] stage {i + 1}/{len(STAGES)}: {stage['steps']} SFT steps", file=sys.stderr,
                      flush=True)
                model = sft(model, demos, final if last else Path(tmp) / f"model-{i}", steps=stage["steps"], lr=LR,
                            batch_size=BATCH_SIZE, seed=stage["seed"], log_every=50, device="cpu")
            (final / MARKER).write_text(json.dumps({"recipe": want}, indent=2) + "\n")

        # A racing first build (two runs, or a run and an eval) that published first wins; an
        # older recipe's cache is swapped out, never deleted under a reader.
        build_dir(out, train, force=out.exists(), accept=lambda winner: _has_recipe(winner, want))
    return out


def forgetful_recipe(warm_dir: Path) -> dict:
    """What a forgetful model's marker records: the stage and the warm start's own recipe under it."""
    return {**FORGETFUL, "tasks": {str(k): v for k, v in FORGETFUL["tasks"].items()},
            "warm": json.loads((warm_dir / MARKER).read_text())["recipe"]}


def ensure_swe_forgetful_model(warm_dir: str | Path, out_dir: str | Path) -> Path:
    """`out_dir`: the SWE warm start (`ensure_swe_warm_model`'s output) after the FORGETFUL stage."""
    from burstrl.trainer.sft import sft

    warm, out = Path(warm_dir), Path(out_dir).absolute()
    want = forgetful_recipe(warm)
    if _has_recipe(out, want, FORGETFUL_MARKER):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="swe-forgetful-", dir=out.parent) as tmp:

        def train(final: Path) -> None:
            (seed, n), = FORGETFUL["tasks"].items()
            demos = forgetful_demos(Path(tmp), seed, n, FORGETFUL["no_commit_share"], FORGETFUL["choice_seed"])
            print(f"[swe-warm] forgetful stage: {FORGETFUL['steps']} SFT steps", file=sys.stderr, flush=True)
            sft(warm, demos, final, steps=FORGETFUL["steps"], lr=FORGETFUL["lr"], batch_size=BATCH_SIZE,
                seed=FORGETFUL["seed"], log_every=25, device="cpu")
            (final / FORGETFUL_MARKER).write_text(json.dumps({"recipe": want}, indent=2) + "\n")

        build_dir(out, train, force=out.exists(), accept=lambda winner: _has_recipe(winner, want, FORGETFUL_MARKER))
    return out


def forgetful_demos(tmp: Path, seed: int, n: int, no_commit_share: float, choice_seed: int) -> Path:
    """Demonstrations of `n` difficulty-0 tasks; a `no_commit_share` of them, drawn with `choice_seed`,
    never commit."""
    import random

    from burstrl.envs.swe.demos import demonstration_chat
    from burstrl.envs.swe.toygen import located_fix_command, make_task
    from burstrl.envs.toy import write_jsonl

    rng = random.Random(choice_seed)
    print(f"[swe-warm] generating {n} toy tasks (seed {seed}) and their demonstrations", file=sys.stderr, flush=True)
    chats = []
    for i in range(n):
        task = make_task(tmp / f"tasks-{seed}", i, seed=seed, difficulty=DIFFICULTY, split="train")
        command = located_fix_command(task, commit=rng.random() >= no_commit_share)
        chats.append({"messages": demonstration_chat(task, commands=[command])})
    return write_jsonl(chats, tmp / f"demos-forgetful-{seed}-{n}.jsonl")


def _stage_demos(tmp: Path, seeds: dict[int, int]) -> Path:
    """One stage's demonstrations (made once per seed and reused by later stages), concatenated."""
    from burstrl.envs.swe.demos import write_demonstrations
    from burstrl.envs.swe.toygen import make_task

    parts = []
    for seed, n in seeds.items():
        path = tmp / f"demos-{seed}-{n}.jsonl"
        if not path.exists():
            print(f"[swe-warm] generating {n} toy tasks (seed {seed}) and their demonstrations", file=sys.stderr,
                  flush=True)
            tasks = [make_task(tmp / f"tasks-{seed}", i, seed=seed, difficulty=DIFFICULTY, split="train")
                     for i in range(n)]
            write_demonstrations(tasks, path)
        parts.append(path.read_text())
    out = tmp / f"demos-stage-{'-'.join(map(str, seeds))}.jsonl"
    out.write_text("".join(parts))
    return out


def _has_recipe(out: Path, want: dict, marker_name: str = MARKER) -> bool:
    marker = out / marker_name
    return marker.is_file() and json.loads(marker.read_text()).get("recipe") == want
