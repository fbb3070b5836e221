"""Toy multi-turn task: the user asks for one letter per turn, the model repeats each one.

Why this task: it exercises sessions. A rollout is several chat calls in one session, and every
call sends the whole conversation so far, the model's actual previous replies included, so the
replica's token continuity (previous prompt + sampled ids + new message tokens) and its session
KV cache are on the path of every rollout. Each turn is the single-letter toy prompt, under the
same system prompt, so the warm start on `toy` transfers and the tiny model can learn it; the
reward is dense (credit per turn), so a group of attempts rarely scores all the same.

Difficulty is the number of turns (1..MAX_DIFFICULTY). A turn's letter always differs from the
previous turn's, so "repeat your last reply" is never right by luck.
"""

from __future__ import annotations

from burstrl.envs.base import ChatClient, Outcome, Task
from burstrl.envs.toy import LETTERS, SYSTEM_PROMPT, task_rng

MAX_DIFFICULTY = 4
MAX_TOKENS = 4  # per call: a right reply is one token plus <|im_end|>
# total = sum(weight * part), in [0, 1]: getting letters right dominates; format rewards a bare letter.
REWARD_WEIGHTS = {"exact": 0.8, "format": 0.2}


def make_letters(n: int, seed: int, difficulty: int = 1, split: str = "train") -> list[list[str]]:
    """`n` letter sequences of `difficulty` turns; the same arguments always give the same letters."""
    rng = task_rng("burstrl-toy-multi", n, seed, difficulty, split, MAX_DIFFICULTY)
    sequences = []
    for _ in range(n):
        letters: list[str] = []
        for _ in range(difficulty):
            letters.append(rng.choice([c for c in LETTERS if not letters or c != letters[-1]]))
        sequences.append(letters)
    return sequences


def user_message(letter: str) -> dict[str, str]:
    """One turn's request, worded exactly as the single-turn toy prompt."""
    return {"role": "user", "content": f"Repeat the letter: {letter}"}


def grade(letters: list[str], replies: list[str]) -> tuple[float, dict[str, float]]:
    """(total in [0, 1], parts): the fraction of turns exactly right, and of bare-letter replies.

    Surrounding whitespace is ignored; case matters. total = 0.8 * exact + 0.2 * format.
    """
    if len(replies) != len(letters):
        raise ValueError(f"{len(replies)} replies for {len(letters)} turns")
    texts = [reply.strip() for reply in replies]
    parts = {
        "exact": sum(t == want for t, want in zip(texts, letters, strict=False)) / len(letters),
        "format": sum(len(t) == 1 and t.isascii() and t.isalpha() for t in texts) / len(letters),
    }
    total = sum(REWARD_WEIGHTS[name] * value for name, value in parts.items())
    return round(total, 6), parts  # rounded so a perfect rollout scores exactly 1.0


def conversation(letters: list[str], replies: list[str]) -> list[dict[str, str]]:
    """The chat after `replies` (one per turn so far), ending with the next request if any is left."""
    msgs = [{"role": "system", "content": SYSTEM_PROMPT}]
    for i, letter in enumerate(letters[: len(replies) + 1]):
        msgs.append(user_message(letter))
        if i < len(replies):
            msgs.append({"role": "assistant", "content": replies[i]})
    return msgs


class MultiToyEnv:
    """The multi-turn task as an `Environment`: one call per turn in one session, pass = all turns exact."""

    name = "toy_multi"
    max_difficulty = MAX_DIFFICULTY

    def make_tasks(self, n: int, seed: int, difficulty: int = 1, split: str = "train") -> list[Task]:
        """Ids name the split, difficulty, seed and index, so tasks from different calls never share one."""
        return [Task(id=f"toymt-{split}-d{difficulty}-s{seed}-{i:05d}", env=self.name,
                     difficulty=difficulty, data={"letters": letters})
                for i, letters in enumerate(make_letters(n, seed, difficulty, split))]

    async def rollout(self, client: ChatClient, task: Task) -> Outcome:
        """Ask for each letter in turn; each call carries the model's own previous replies verbatim."""
        letters = task.data["letters"]
        replies: list[str] = []
        for _ in letters:
            replies.append(await client.chat(conversation(letters, replies), max_tokens=MAX_TOKENS))
        total, parts = grade(letters, replies)
        return Outcome(reward=total, parts=parts, passed=parts["exact"] == 1.0, info={"replies": replies})

    def demonstrations(self, tasks: list[Task]) -> list[dict[str, list[dict[str, str]]]]:
        """The whole conversation with every reply correct."""
        return [{"messages": conversation(t.data["letters"], list(t.data["letters"]))} for t in tasks]
