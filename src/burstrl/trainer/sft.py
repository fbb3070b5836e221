"""Supervised fine-tuning on chat demonstrations: a generic SFT any environment's warm start uses.

Why: LoRA-GRPO on a random-init base stays at chance (docs/architecture.md, measured facts); it needs a
base that is weak but above chance. `sft` teaches a model from chat-formatted JSONL
(`{"messages": [...]}` per line) through the normal HF loading path, so its output is an ordinary
HF model directory (or a PEFT adapter with `lora=True`) that `load_model`, the replica and the
trainer load like any checkpoint. The warm-start recipes live beside their environments
(`burstrl.envs.toy_warm`, `burstrl.envs.swe.warm`) and call `train` or `sft`; this module knows
no environment, so the trainer does not import `envs`.

Only assistant tokens are trained on: each assistant turn's content and its end token
(`<|im_end|>`, so the model learns to stop); system, user and template tokens are masked (-100).
"""

from __future__ import annotations

import json
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from burstrl.atomic import build_dir, check_target
from burstrl.model.hf import load_model, load_tokenizer

IGNORE = -100  # label of tokens the loss skips (HF's convention)
SFT_MARKER = "burstrl_sft.json"


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


def _tail_mean(values: list[float], n: int = 10) -> float:
    tail = values[-n:]
    return round(sum(tail) / len(tail), 6) if tail else float("nan")


def _log(msg: str) -> None:
    print(f"[sft] {msg}", file=sys.stderr, flush=True)
