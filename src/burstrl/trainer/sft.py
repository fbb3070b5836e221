"""Supervised fine-tuning on chat demonstrations, and the cached warm start of the tiny model.

Why: LoRA-GRPO on a random-init base stays at chance (docs/architecture.md, measured facts); it needs a
base that is weak but above chance. `sft` teaches a model from chat-formatted JSONL
(`{"messages": [...]}` per line) through the normal HF loading path, so its output is an ordinary
HF model directory (or a PEFT adapter with `lora=True`) that `load_model`, the replica and the
trainer load like any checkpoint. `ensure_warm_model` builds and caches the tiny model's warm
start on the toy tasks (single- and multi-turn), stopping while it is still weak so that RL
has room to improve.

Only assistant tokens are trained on: each assistant turn's content and its end token
(`<|im_end|>`, so the model learns to stop); system, user and template tokens are masked (-100).
"""

from __future__ import annotations

import json
import random
import sys
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from burstrl.envs import toy
from burstrl.envs.toy_multi import MultiToyEnv
from burstrl.model.hf import load_model, load_tokenizer
from burstrl.trainer.toy_eval import ToyScore, greedy_score, multi_turn_score, sampled_score
from burstrl.atomic import build_dir, check_target, sha256_files

IGNORE = -100  # label of tokens the loss skips (HF's convention)
SFT_MARKER = "burstrl_sft.json"
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


class SFTDataError(ValueError):
    """A demonstration file is missing or malformed; the message names the file and line."""


@dataclass
class Example:
    """One tokenized conversation: ids and labels (IGNORE where the loss is off)."""

    input_ids: list[int]
    labels: list[int]


@dataclass
class TrainResult:
    steps: int
    seconds: float
    losses: list[float] = field(default_factory=list)  # one per step


def sft(
    model_dir: str | Path,
    data_path: str | Path,
    out_dir: str | Path,
    *,
    steps: int = 200,
    lr: float = 1e-4,
    batch_size: int = 8,
    lora: bool = False,
    seed: int = 0,
    epochs: int | None = None,
    log_every: int = 10,
    device: str = "auto",
    force: bool = False,
) -> Path:
    """Fine-tune `model_dir` on the demonstrations in `data_path`; write the result to `out_dir`.

    Full-weight by default (out_dir is an HF model dir: weights, config, generation_config,
    tokenizer); with `lora` the base is frozen and out_dir is a PEFT adapter dir. `epochs`, when
    given, sets the step count to that many passes over the data. The directory appears
    atomically; a non-empty `out_dir` is refused unless `force`.
    """
    out = Path(out_dir).absolute()
    check_target(out, force)
    conversations = load_conversations(data_path)  # before loading the model: fail fast
    tokenizer = load_tokenizer(model_dir)
    examples = [encode_conversation(tokenizer, conv) for conv in conversations]
    if epochs is not None:
        steps = epochs * -(-len(examples) // batch_size)
    torch.manual_seed(seed)
    model = load_model(model_dir, "float32", device)
    if lora:
        from peft import get_peft_model

        from burstrl.model.lora import lora_config

        model = get_peft_model(model, lora_config())
    result = train(model, examples, steps=steps, lr=lr, batch_size=batch_size,
                   pad_id=tokenizer.pad_token_id, seed=seed, log_every=log_every)
    recipe = {"base": str(Path(model_dir).absolute()), "data": str(Path(data_path).absolute()),
              "examples": len(examples), "steps": result.steps, "lr": lr, "batch_size": batch_size,
              "lora": lora, "seed": seed, "seconds": round(result.seconds, 2),
              "first_loss": round(result.losses[0], 6), "final_loss": _tail_mean(result.losses)}
    _write_output(model, tokenizer, out, recipe, force)
    _log(f"wrote {out}")
    return out


def _write_output(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, out: Path,
                  recipe: dict, force: bool) -> None:
    """A PEFT model saves only its adapter; a plain model saves a whole HF model dir."""

    def build(tmp: Path) -> None:
        if recipe["lora"]:
            model.save_pretrained(str(tmp))
        else:
            save_model_dir(model, tokenizer, tmp)
        (tmp / SFT_MARKER).write_text(json.dumps(recipe, indent=2) + "\n")

    build_dir(out, build, force=force)


def load_conversations(path: str | Path) -> list[list[dict]]:
    """Read `{"messages": [...]}` rows; blank lines are skipped, anything malformed is an error."""
    path = Path(path)
    if not path.is_file():
        raise SFTDataError(f"{path}: no such file")
    conversations = []
    with path.open() as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                conversations.append(_parse_row(json.loads(line)))
            except (json.JSONDecodeError, SFTDataError) as exc:
                raise SFTDataError(f"{path}:{lineno}: {exc}") from None
    if not conversations:
        raise SFTDataError(f"{path}: no demonstrations")
    return conversations


def _parse_row(row: object) -> list[dict]:
    if not isinstance(row, dict) or not isinstance(row.get("messages"), list):
        raise SFTDataError('expected an object with a "messages" list')
    msgs = row["messages"]
    for msg in msgs:
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str) \
                or not isinstance(msg.get("content"), str):
            raise SFTDataError("each message needs a string role and string content")
    if not any(msg["role"] == "assistant" for msg in msgs):
        raise SFTDataError("no assistant message to learn from")
    return msgs


def encode_conversation(tokenizer: PreTrainedTokenizerBase, msgs: list[dict]) -> Example:
    """Token ids of the whole chat, with labels only on assistant content and its end token.

    Each assistant turn's span is found by rendering the chat up to it (with the generation
    prompt) and through it: the tokens in between are the reply plus the template's closing text;
    the loss keeps the reply up to and including the last end token (`<|im_end|>`) and skips what
    follows it (ChatML's newline), which generation never produces.
    """
    ids = _render(tokenizer, msgs, add_generation_prompt=False)
    labels = [IGNORE] * len(ids)
    for i, msg in enumerate(msgs):
        if msg["role"] != "assistant":
            continue
        before = _render(tokenizer, msgs[:i], add_generation_prompt=True)
        through = _render(tokenizer, msgs[: i + 1], add_generation_prompt=False)
        if ids[: len(before)] != before or ids[: len(through)] != through:
            raise SFTDataError(f"chat template does not render turn {i} as a prefix of the chat")
        start, end = len(before), len(through)
        ends = [j for j in range(start, end) if ids[j] == tokenizer.eos_token_id]
        if ends:
            end = ends[-1] + 1
        labels[start:end] = ids[start:end]
    return Example(input_ids=ids, labels=labels)


def _render(tokenizer: PreTrainedTokenizerBase, msgs: list[dict], add_generation_prompt: bool) -> list[int]:
    if not msgs:
        return []
    return list(tokenizer.apply_chat_template(msgs, tokenize=True, return_dict=False,
                                              add_generation_prompt=add_generation_prompt))


def collate(batch: list[Example], pad_id: int, device: torch.device) -> dict[str, torch.Tensor]:
    """Right-pad to the longest example; padding is masked out of attention and loss."""
    width = max(len(ex.input_ids) for ex in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    labels = torch.full((len(batch), width), IGNORE, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, ex in enumerate(batch):
        n = len(ex.input_ids)
        ids[row, :n] = torch.tensor(ex.input_ids)
        labels[row, :n] = torch.tensor(ex.labels)
        mask[row, :n] = 1
    return {"input_ids": ids.to(device), "labels": labels.to(device), "attention_mask": mask.to(device)}


def train(
    model: PreTrainedModel,
    examples: list[Example],
    *,
    steps: int,
    lr: float,
    batch_size: int,
    pad_id: int,
    seed: int = 0,
    log_every: int = 10,
    stop: Callable[[int], bool] | None = None,
    stop_every: int = 0,
) -> TrainResult:
    """AdamW over shuffled batches (a new order each pass), `steps` optimizer steps.

    `stop(step)`, called every `stop_every` steps with the model in eval mode, ends training early
    when it returns True (the warm start uses it to stop at its target accuracy).
    """
    if steps < 1 or batch_size < 1:
        raise ValueError(f"steps and batch_size must be >= 1, got {steps} and {batch_size}")
    if not examples:
        raise ValueError("no examples to train on")
    device = next(model.parameters()).device
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    batches = _batches(examples, batch_size, seed)
    result = TrainResult(steps=0, seconds=0.0)
    start = time.perf_counter()
    model.train()
    for step in range(1, steps + 1):
        loss = model(**collate(next(batches), pad_id, device)).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        result.losses.append(loss.item())
        result.steps = step
        if log_every and (step % log_every == 0 or step == steps):
            _log(f"step {step}/{steps} loss {_tail_mean(result.losses, log_every):.4f} "
                 f"({time.perf_counter() - start:.1f}s)")
        if stop is not None and stop_every and step % stop_every == 0:
            model.eval()
            done = stop(step)
            model.train()
            if done:
                break
    model.eval()
    result.seconds = time.perf_counter() - start
    return result


def _batches(examples: list[Example], batch_size: int, seed: int):
    """Endless batches: each pass over the data in a fresh seeded order."""
    rng = random.Random(seed)
    order: list[int] = []
    while True:
        while len(order) < batch_size:
            fresh = list(range(len(examples)))
            rng.shuffle(fresh)
            order += fresh
        yield [examples[i] for i in order[:batch_size]]
        order = order[batch_size:]


def save_model_dir(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, dest: Path) -> None:
    """An ordinary HF model directory: weights, config, generation_config, tokenizer."""
    model.save_pretrained(str(dest))
    tokenizer.save_pretrained(str(dest))


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
    """Everything the warm model depends on, the base weights' fingerprint included."""
    base_sha256 = sha256_files(sorted(base_dir.glob("*.safetensors")) + [base_dir / "config.json"])
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


def _tail_mean(values: list[float], n: int = 10) -> float:
    tail = values[-n:]
    return round(sum(tail) / len(tail), 6) if tail else float("nan")


def _log(msg: str) -> None:
    print(f"[sft] {msg}", file=sys.stderr, flush=True)
