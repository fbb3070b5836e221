"""The toy environments' warm start: the tiny model after a short full-weight SFT, cached.

Why here and not in the trainer: the recipe (which demonstrations, which scores decide when to
stop) is the toy environments' knowledge, as `envs/swe/warm.py` is SWE's; the trainer's `sft`
module stays a generic SFT that knows no environment, so `trainer` never imports `envs`.
`ensure_warm_model` builds and caches the tiny model's warm start on the toy tasks (single- and
multi-turn), stopping while it is still weak so that RL has room to improve.
"""

from __future__ import annotations

import json
import sys
from contextlib import contextmanager
from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from burstrl.atomic import build_dir, sha256_files
from burstrl.envs import toy
from burstrl.envs.toy_eval import ToyScore, greedy_score, multi_turn_score, sampled_score
from burstrl.envs.toy_multi import MultiToyEnv
from burstrl.model.hf import load_model, load_tokenizer
from burstrl.trainer.sft import encode_conversation, save_model_dir, train

WARM_MARKER = "burstrl_warm.json"
WARM_RECIPE_VERSION = 2  # bump when ensure_warm_model's recipe changes, to rebuild caches

# The warm start's recipe: full-weight SFT on single-letter toy demonstrations mixed with whole
# toy_multi conversations (WARM_MULTI_TASKS spread over WARM_MULTI_DIFFICULTIES turns), so both
# environments start weak but above chance (see ensure_warm_model for the stopping rule). On the
# tiny model it stops after 54 steps (~17 s on 2 shared cores).
WARM_TRAIN_TASKS = 512
WARM_MULTI_TASKS = 384
WARM_MULTI_DIFFICULTIES = (1, 2, 3)
WARM_RL_TEMPERATURE = 0.5  # the sampled scores are also measured where the RL tests sample
WARM_LR = 5e-4
WARM_BATCH_SIZE = 32
WARM_MAX_STEPS = 300


def ensure_warm_model(
    base_dir: str | Path,
    out_dir: str | Path,
    *,
    target: tuple[float, float] = (0.2, 0.6),
    seed: int = 0,
) -> Path:
    """The base model after a short full-weight SFT on toy and toy_multi demonstrations, cached at `out_dir`.

    Weak but above chance, so that LoRA-GRPO has both a signal and room to improve: after every
    step the model answers each single-letter test prompt greedily, and training stops at the
    first step whose mean reward lies in [low + (high - low) / 4, high] of `target`. Every step
    is evaluated because greedy accuracy jumps (up and down) as each right letter overtakes
    `<|im_end|>`: the half-trained failure is an empty reply. The marker file records the
    recipe, the step count and the measured scores (greedy and sampled, on toy and on
    toy_multi, where the band is not enforced but lands alike); a cache with the same
    recipe is reused, one with another recipe is replaced. Racing builders each train in a temp
    dir; the first rename wins and the others use its result.
    """
    out = Path(out_dir).absolute()
    recipe = _warm_recipe(Path(base_dir), target, seed)
    found = _read_marker(out, WARM_MARKER)
    if found is not None and found.get("recipe") == recipe:
        return out
    if found is None and out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out} exists and is not a warm model cache")
    with _one_thread():
        model, tokenizer, marker = _build_warm(Path(base_dir), target, seed, recipe)
    return _publish_warm(model, tokenizer, out, marker, stale=found is not None)


@contextmanager
def _one_thread():
    """The tiny model gains nothing from intra-op threads, and when test processes share two
    cores, two spinning threads per process made each step ~15x slower (2.5 s instead of 0.14 s)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _build_warm(
    base_dir: Path, target: tuple[float, float], seed: int, recipe: dict
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, dict]:
    """Train until the greedy reward is in the band; the model, its tokenizer and the marker."""
    low, high = target
    tokenizer = load_tokenizer(base_dir)
    torch.manual_seed(seed)
    model = load_model(base_dir, "float32", "cpu")
    eval_tasks = _letter_tasks(seed)
    base = greedy_score(model, tokenizer, eval_tasks)
    examples = [encode_conversation(tokenizer, row["messages"]) for row in _warm_rows(seed)]
    scores: list[ToyScore] = []

    def in_band(step: int) -> bool:
        scores.append(greedy_score(model, tokenizer, eval_tasks))
        return low + (high - low) / 4 <= scores[-1].mean_reward <= high

    result = train(model, examples, steps=WARM_MAX_STEPS, lr=WARM_LR, batch_size=WARM_BATCH_SIZE,
                   pad_id=tokenizer.pad_token_id, seed=seed, log_every=0, stop=in_band, stop_every=1)
    warm = scores[-1]
    if not low <= warm.mean_reward <= high:
        raise RuntimeError(f"warm start missed its target {target} in {result.steps} steps "
                           f"(greedy mean reward {warm.mean_reward:.3f})")
    sampled = sampled_score(model, tokenizer, eval_tasks, group_size=8, seed=seed)
    sampled_rl = sampled_score(model, tokenizer, eval_tasks, group_size=8, seed=seed,
                               temperature=WARM_RL_TEMPERATURE)
    marker = {"recipe": recipe, "steps": result.steps, "seconds": round(result.seconds, 2),
              "mean_reward": round(warm.mean_reward, 4), "exact": round(warm.exact, 4),
              "base_mean_reward": round(base.mean_reward, 4),
              "sampled_mean_reward": round(sampled.mean_reward, 4),
              "sampled_groups_with_variance": round(sampled.groups_with_variance, 4),
              "sampled_rl": _score_dict(sampled_rl),
              "toy_multi": _multi_scores(model, tokenizer, seed),
              "greedy_curve": [round(s.mean_reward, 4) for s in scores]}
    _log(f"warm start: {result.steps} steps in {result.seconds:.1f}s; greedy mean reward "
         f"{base.mean_reward:.3f} -> {warm.mean_reward:.3f}; sampled {sampled.mean_reward:.3f}, "
         f"{sampled.groups_with_variance:.0%} of groups of 8 with reward variance; toy_multi greedy "
         + ", ".join(f"{d} {s['greedy']['mean_reward']:.3f}" for d, s in marker["toy_multi"].items()))
    return model, tokenizer, marker


def _warm_rows(seed: int) -> list[dict]:
    """Single-letter toy demonstrations plus whole toy_multi conversations of a few turns.

    The multi-turn rows teach the same letter mapping in a conversation that holds earlier
    replies, so RL on toy_multi starts above chance too; the single-letter rows keep the band
    check (and the single-turn RL test) where they were measured.
    """
    rows = toy.demonstrations(toy.make_tasks(WARM_TRAIN_TASKS, seed, difficulty=1, split="train"))
    env = MultiToyEnv()
    per = WARM_MULTI_TASKS // len(WARM_MULTI_DIFFICULTIES)
    for difficulty in WARM_MULTI_DIFFICULTIES:
        rows += env.demonstrations(env.make_tasks(per, seed, difficulty=difficulty, split="train"))
    return rows


def _multi_scores(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, seed: int) -> dict:
    """toy_multi on 32 test tasks per difficulty: greedy, and sampled groups of 8 at the RL temperature."""
    env, out = MultiToyEnv(), {}
    for difficulty in WARM_MULTI_DIFFICULTIES:
        tasks = env.make_tasks(32, seed, difficulty=difficulty, split="test")
        sampled = multi_turn_score(model, tokenizer, tasks, group_size=8, do_sample=True,
                                   temperature=WARM_RL_TEMPERATURE, seed=seed)
        greedy = multi_turn_score(model, tokenizer, tasks)
        out[f"d{difficulty}"] = {"greedy": _score_dict(greedy, groups=False),
                                 "sampled_rl": _score_dict(sampled)}
    return out


def _score_dict(score: ToyScore, groups: bool = True) -> dict:
    out = {"mean_reward": round(score.mean_reward, 4), "pass_rate": round(score.exact, 4)}
    if groups:  # a greedy score has groups of one: no variance to report
        out["groups_with_variance"] = round(score.groups_with_variance, 4)
    return out


def _letter_tasks(seed: int) -> list[toy.ToyTask]:
    """One test-split task per letter: the whole single-letter distribution, each prompt once.

    A greedy reply depends only on the prompt, so the mean over these 26 is exactly the expected
    greedy reward on i.i.d. test draws, without sampling noise and at a fifth of 128 draws' cost.
    """
    by_answer = {t.answer: t for t in reversed(toy.make_tasks(1000, seed, difficulty=1, split="test"))}
    return [by_answer[letter] for letter in toy.LETTERS]


def _warm_recipe(base_dir: Path, target: tuple[float, float], seed: int) -> dict:
    """Everything the warm model depends on, the base weights' and chat template's fingerprint included
    (the warm model is saved with the base's tokenizer: a new template must reach it)."""
    template = [p for p in (base_dir / "chat_template.jinja", base_dir / "tokenizer_config.json") if p.is_file()]
    base_sha256 = sha256_files(sorted(base_dir.glob("*.safetensors")) + [base_dir / "config.json"] + template)
    return {"version": WARM_RECIPE_VERSION, "base_sha256": base_sha256,
            "target": list(target), "seed": seed, "train_tasks": WARM_TRAIN_TASKS,
            "multi_tasks": WARM_MULTI_TASKS, "multi_difficulties": list(WARM_MULTI_DIFFICULTIES),
            "rl_temperature": WARM_RL_TEMPERATURE, "lr": WARM_LR,
            "batch_size": WARM_BATCH_SIZE, "max_steps": WARM_MAX_STEPS}


def _publish_warm(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, out: Path,
                  marker: dict, stale: bool) -> Path:
    """Write beside `out` and rename; losing the race to an identical build is success."""

    def build(tmp: Path) -> None:
        save_model_dir(model, tokenizer, tmp)
        (tmp / WARM_MARKER).write_text(json.dumps(marker, indent=2) + "\n")

    def same_recipe(winner: Path) -> bool:
        found = _read_marker(winner, WARM_MARKER)
        return found is not None and found.get("recipe") == marker["recipe"]

    return build_dir(out, build, force=stale, accept=same_recipe)


def _read_marker(out: Path, name: str) -> dict | None:
    path = out / name
    return json.loads(path.read_text()) if path.is_file() else None


def _log(msg: str) -> None:
    """Same prefix as `burstrl sft`'s lines: the warm start is an SFT run."""
    print(f"[sft] {msg}", file=sys.stderr, flush=True)
