"""Score a model on the toy task with plain HF generation: greedy accuracy and sampled groups.

Why plain `generate` and not a replica: the warm start (and tests) need a quick, dependency-free
measurement inside one process, before any server exists. Greedy mean reward says what the model
knows; sampling G replies per prompt at temperature 1 says what GRPO will see (a group whose
rewards are all equal carries no learning signal). It lives beside the toy environments because
it grades with their rewards; the toy warm start (`envs/toy_warm.py`) is its main user.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from burstrl.envs import toy, toy_multi
from burstrl.envs.base import Task


@dataclass
class ToyScore:
    mean_reward: float
    exact: float  # fraction of replies exactly right
    groups_with_variance: float = 1.0  # sampled only: fraction of groups whose rewards differ


@torch.no_grad()
def generate(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    chats: list[list[dict]],
    *,
    max_new_tokens: int = 8,
    do_sample: bool = False,
    temperature: float = 1.0,
    num_return_sequences: int = 1,
) -> list[str]:
    """Completion texts (special tokens dropped), `num_return_sequences` per chat, chat by chat.

    Prompts are left-padded into one batch; sampling is plain (no top-k/top-p), as GRPO samples.
    """
    prompts = [
        list(tokenizer.apply_chat_template(chat, tokenize=True, return_dict=False,
                                           add_generation_prompt=True))
        for chat in chats
    ]
    width = max(len(p) for p in prompts)
    pad = tokenizer.pad_token_id
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    sampling = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
    device = next(model.parameters()).device
    out = model.generate(
        input_ids=ids.to(device),
        attention_mask=mask.to(device),
        max_new_tokens=max_new_tokens,
        num_return_sequences=num_return_sequences,
        pad_token_id=pad,
        **(sampling if do_sample else {"do_sample": False}),
    )
    return tokenizer.batch_decode(out[:, width:], skip_special_tokens=True)


def greedy_score(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, tasks: list[toy.ToyTask], batch_size: int = 64
) -> ToyScore:
    """Mean reward and exact-match rate of greedy replies to `tasks`."""
    rewards, exact = [], []
    for i in range(0, len(tasks), batch_size):
        chunk = tasks[i : i + batch_size]
        texts = generate(model, tokenizer, [toy.messages(t) for t in chunk])
        for task, text in zip(chunk, texts, strict=False):
            total, parts = toy.reward(task, text)
            rewards.append(total)
            exact.append(parts["exact"])
    return ToyScore(mean_reward=statistics.fmean(rewards), exact=statistics.fmean(exact))


def held_out_greedy(model_dir: str | Path, adapter: str | Path | None = None) -> float:
    """Greedy mean reward on one held-out toy prompt per letter, of the model or of an adapter on it.

    Why one prompt per letter: the quickstart's learning checks (the e2e tests, benchmarks/learning.py)
    compare a warm model with the adapter a run ends with, and need a cheap, fixed, balanced probe.
    """
    from burstrl.model.hf import load_model, load_tokenizer

    model = load_model(str(model_dir), "float32", "cpu")
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter))
    by_letter = {t.answer: t for t in toy.make_tasks(500, seed=11, split="test")}
    return greedy_score(model, load_tokenizer(str(model_dir)), [by_letter[c] for c in sorted(by_letter)]).mean_reward


def sampled_score(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    tasks: list[toy.ToyTask],
    *,
    group_size: int = 8,
    temperature: float = 1.0,
    seed: int = 0,
) -> ToyScore:
    """GRPO's view: `group_size` sampled replies per task (seeded; the caller's RNG is kept)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        texts = generate(model, tokenizer, [toy.messages(t) for t in tasks], do_sample=True,
                         temperature=temperature, num_return_sequences=group_size)
    rewards, exact, varied = [], [], []
    for i, task in enumerate(tasks):
        graded = [toy.reward(task, text) for text in texts[i * group_size : (i + 1) * group_size]]
        group = [total for total, _ in graded]
        rewards += group
        exact += [parts["exact"] for _, parts in graded]
        varied.append(float(max(group) > min(group)))
    return ToyScore(mean_reward=statistics.fmean(rewards), exact=statistics.fmean(exact),
                    groups_with_variance=statistics.fmean(varied))


def multi_turn_score(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    tasks: list[Task],
    *,
    group_size: int = 1,
    do_sample: bool = False,
    temperature: float = 1.0,
    seed: int = 0,
) -> ToyScore:
    """Score `toy_multi` tasks as their rollouts run: each turn's prompt holds the model's own replies.

    All `group_size` attempts at all tasks advance one turn per batched `generate` call. Replies
    are re-rendered as text (a replica keeps the sampled ids instead), which for a reply of
    letters and `<|im_end|>` gives the same tokens. `exact` is the fraction of passed attempts.
    """
    letters = [t.data["letters"] for t in tasks for _ in range(group_size)]
    replies: list[list[str]] = [[] for _ in letters]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for turn in range(max(len(seq) for seq in letters)):
            live = [i for i, seq in enumerate(letters) if turn < len(seq)]
            chats = [toy_multi.conversation(letters[i], replies[i]) for i in live]
            texts = generate(model, tokenizer, chats, max_new_tokens=toy_multi.MAX_TOKENS,
                             do_sample=do_sample, temperature=temperature)
            for i, text in zip(live, texts, strict=False):
                replies[i].append(text)
    graded = [toy_multi.grade(seq, got) for seq, got in zip(letters, replies, strict=False)]
    rewards = [total for total, _ in graded]
    groups = [rewards[i : i + group_size] for i in range(0, len(rewards), group_size)]
    return ToyScore(mean_reward=statistics.fmean(rewards),
                    exact=statistics.fmean(float(parts["exact"] == 1.0) for _, parts in graded),
                    groups_with_variance=statistics.fmean(float(max(g) > min(g)) for g in groups))
