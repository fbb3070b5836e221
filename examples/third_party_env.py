"""A third-party environment, outside the package: proof that adding one touches no library file.

Use it by its import path (the directory holding `examples/` must be on PYTHONPATH):

    burstrl eval --model DIR --env examples.third_party_env:EchoEnv --env-option words=2 --n 8

or in a run config:

    [orchestrator.envs]
    "examples.third_party_env:EchoEnv" = 1.0

    [orchestrator.env.echo]      # validated by EchoEnv.Options
    words = 2
    reward_exact = 1.0

The task: repeat the words of the prompt. It implements `burstrl.envs.base.Environment` (a
protocol: nothing to inherit) and owns its options model, which the registry validates from
`orchestrator.env.echo` (echo is the class's `name`).
"""

from __future__ import annotations

import random
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from burstrl.envs.base import ChatClient, Outcome, Task

WORDS = ("apple", "river", "stone", "cloud", "maple", "tiger", "lemon", "piano")


class EchoOptions(BaseModel):
    """The echo environment's options (unknown keys are errors, as in burstrl's own sections)."""

    model_config = ConfigDict(extra="forbid")

    words: int = Field(1, ge=1, le=8, description="Words per prompt at difficulty 1 (one more per level).")
    reward_exact: float = Field(1.0, ge=0, description="Reward of a reply that is exactly the words.")


class EchoEnv:
    """Say the words back: single turn, graded by exact match (and partial credit per word)."""

    name = "echo"
    max_difficulty = 3
    Options = EchoOptions

    def __init__(self, options: EchoOptions, run_dir: Path) -> None:
        self.options, self.run_dir = options, run_dir

    def make_tasks(self, n: int, seed: int, difficulty: int = 1, split: str = "train") -> list[Task]:
        """Seeded word lists; ids name split, difficulty, seed and index, so they never collide."""
        rng = random.Random(f"{split}-{difficulty}-{seed}")
        count = self.options.words + max(difficulty, 1) - 1
        return [Task(id=f"echo-{split}-d{difficulty}-s{seed}-{i:05d}", env=self.name, difficulty=difficulty,
                     data={"words": [rng.choice(WORDS) for _ in range(count)]}) for i in range(n)]

    async def rollout(self, client: ChatClient, task: Task) -> Outcome:
        reply = await client.chat(self._messages(task), max_tokens=16)
        return self.grade(task, reply)

    def grade(self, task: Task, reply: str) -> Outcome:
        want, got = task.data["words"], reply.split()
        exact = got == want
        partial = sum(a == b for a, b in zip(want, got, strict=False)) / len(want)
        reward = self.options.reward_exact if exact else 0.5 * partial
        return Outcome(reward=reward, parts={"exact": float(exact), "partial": partial}, passed=exact)

    def demonstrations(self, tasks: list[Task]) -> list[dict[str, list[dict[str, str]]]]:
        return [{"messages": [*self._messages(t), {"role": "assistant", "content": " ".join(t.data["words"])}]}
                for t in tasks]

    @staticmethod
    def _messages(task: Task) -> list[dict[str, str]]:
        return [{"role": "user", "content": "Repeat: " + " ".join(task.data["words"])}]
