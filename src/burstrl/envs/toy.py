"""Toy single-turn task: repeat the letters the user gives, nothing else.

Why this task: the tiny model (4 layers, 128 wide, random init) must be able to learn it in
seconds on a CPU, and GRPO needs a reward that is verifiable and dense enough that a group of
attempts at one prompt rarely scores all the same. Copying 1-3 uppercase letters fits: in the
tiny tokenizer `Repeat the letter: K` carries the letter as the token " K", and the answer is the
different token "K", so the model must learn a real mapping (chance is 1 in 26 per letter), and
partial answers (right first letter, right length) earn partial credit.

Difficulty is the number of letters (1 = a single letter). The train and test splits draw from
separate random streams: with one letter there are only 26 distinct prompts, so "held out" means
fresh draws from the same distribution, not unseen content.
"""

from __future__ import annotations

import json
import random
import string
from dataclasses import dataclass
from pathlib import Path

from burstrl.envs.base import ChatClient, Outcome, Task

SYSTEM_PROMPT = "Reply with exactly the letters the user asks for, nothing else."
LETTERS = string.ascii_uppercase
MAX_DIFFICULTY = 8
SPLITS = ("train", "test")

# total = sum(weight * part); the weights sum to 1, so total is in [0, 1].
# exact dominates (that is the task); prefix gives credit for each leading letter right; format
# rewards replying with only letters, as many as asked (the model learned to stop and not chatter).
REWARD_WEIGHTS = {"exact": 0.6, "prefix": 0.3, "format": 0.1}


@dataclass
class ToyTask:
    """One prompt and its exact expected answer."""

    id: str
    prompt: str
    answer: str
    difficulty: int


def make_tasks(n: int, seed: int, difficulty: int = 1, split: str = "train") -> list[ToyTask]:
    """`n` tasks of `difficulty` letters each; the same arguments always give the same tasks.

    Letters are drawn independently (repeats allowed). Ids name the split, difficulty, seed and
    index, so tasks from different calls never share an id.
    """
    rng = task_rng("burstrl-toy", n, seed, difficulty, split, MAX_DIFFICULTY)
    noun = "letter" if difficulty == 1 else "letters"
    tasks = []
    for i in range(n):
        answer = "".join(rng.choice(LETTERS) for _ in range(difficulty))
        tasks.append(
            ToyTask(
                id=f"toy-{split}-d{difficulty}-s{seed}-{i:05d}",
                prompt=f"Repeat the {noun}: {answer}",
                answer=answer,
                difficulty=difficulty,
            )
        )
    return tasks


def task_rng(family: str, n: int, seed: int, difficulty: int, split: str, max_difficulty: int) -> random.Random:
    """The random stream of one `make_tasks` call, after checking its arguments (ValueError names them).

    A string seed is hashed with sha512 by `random`, so the stream is the same in every process.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if not 1 <= difficulty <= max_difficulty:
        raise ValueError(f"difficulty must be in 1..{max_difficulty}, got {difficulty}")
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    return random.Random(f"{family}:{split}:{seed}:{difficulty}")


def messages(task: ToyTask) -> list[dict[str, str]]:
    """The chat the model answers: a short system prompt, then the user's request."""
    return [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": task.prompt},
    ]


def reward(task: ToyTask, completion_text: str) -> tuple[float, dict[str, float]]:
    """Grade a completion: (total in [0, 1], named parts each in [0, 1]).

    Surrounding whitespace is ignored (a trailing newline is not an error); everything else,
    case included, must match. Parts:
      exact  - 1 if the reply is exactly the answer;
      prefix - fraction of the answer's letters matched from the start, before the first mistake;
      format - 1 if the reply is only ASCII letters, exactly as many as the answer has.
    total = 0.6 * exact + 0.3 * prefix + 0.1 * format (REWARD_WEIGHTS).
    """
    text = completion_text.strip()
    answer = task.answer
    matched = 0
    for got, want in zip(text, answer, strict=False):
        if got != want:
            break
        matched += 1
    parts = {
        "exact": float(text == answer),
        "prefix": matched / len(answer),
        "format": float(len(text) == len(answer) and text.isascii() and text.isalpha()),
    }
    total = sum(REWARD_WEIGHTS[name] * value for name, value in parts.items())
    return round(total, 6), parts  # rounded so a perfect reply scores exactly 1.0


def demonstrations(tasks: list[ToyTask]) -> list[dict[str, list[dict[str, str]]]]:
    """Chat rows for supervised warm starts: the task's messages plus the correct reply."""
    return [
        {"messages": messages(task) + [{"role": "assistant", "content": task.answer}]}
        for task in tasks
    ]


def write_jsonl(rows: list[dict], path: str | Path) -> Path:
    """One JSON object per line (the format `burstrl sft --data` reads)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return path


class ToyEnv:
    """The single-turn task as an `Environment`: one call per rollout, pass = exact answer."""

    name = "toy"
    max_difficulty = MAX_DIFFICULTY

    def make_tasks(self, n: int, seed: int, difficulty: int = 1, split: str = "train") -> list[Task]:
        return [Task(id=t.id, env=self.name, difficulty=t.difficulty,
                     data={"prompt": t.prompt, "answer": t.answer})
                for t in make_tasks(n, seed, difficulty, split)]

    async def rollout(self, client: ChatClient, task: Task) -> Outcome:
        toy_task = _toy_task(task)
        text = await client.chat(messages(toy_task))
        total, parts = reward(toy_task, text)
        return Outcome(reward=total, parts=parts, passed=parts["exact"] == 1.0, info={"reply": text})

    def demonstrations(self, tasks: list[Task]) -> list[dict[str, list[dict[str, str]]]]:
        return demonstrations([_toy_task(t) for t in tasks])


def _toy_task(task: Task) -> ToyTask:
    return ToyTask(id=task.id, prompt=task.data["prompt"], answer=task.data["answer"], difficulty=task.difficulty)
