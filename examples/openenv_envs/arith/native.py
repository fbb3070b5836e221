"""The arithmetic game as a native burstrl environment: the baseline of the adapter's overhead.

It plays exactly what the OpenEnv server plays, with the adapter's own prompts and reply parsing
(`user_turn`, `parse_reply`), the observation fields the server sends and the same reward, so an
episode here differs from one through "openenv:<url>" only by what the adapter adds: the socket,
the server and its JSON frames (`benchmarks/ecosystem_overhead.py`).
"""

from __future__ import annotations

from typing import Any

from burstrl.envs.base import ChatClient, Outcome, Task
from burstrl.envs.ecosystem.openenv_env import SYSTEM_PROMPT, ReplyError, parse_reply, reset_seed, user_turn
from examples.openenv_envs.arith import game

# What the server's GET /schema says of ArithAction (the native env has no server to ask).
ACTION_SCHEMA: dict[str, Any] = {
    "additionalProperties": False, "title": "ArithAction", "type": "object", "required": ["answer"],
    "properties": {"metadata": {"additionalProperties": True, "type": "object", "title": "Metadata"},
                   "answer": {"description": "The sum, as one integer.", "title": "Answer", "type": "integer"}},
}


def observation(a: int, b: int, hint: str, tries_left: int) -> dict[str, Any]:
    """The observation fields the server sends (openenv keeps `metadata` among them)."""
    return {"metadata": {}, "question": game.question(a, b), "hint": hint, "tries_left": tries_left}


class NativeArithEnv:
    name = "arith_native"
    max_difficulty = 1

    def make_tasks(self, n: int, seed: int, difficulty: int = 1, split: str = "train") -> list[Task]:
        return [Task(id=f"arith-{split}-s{seed}-{i:05d}", env=self.name, difficulty=difficulty,
                     data={"seed": reset_seed(split, seed, i)}) for i in range(n)]

    async def rollout(self, client: ChatClient, task: Task) -> Outcome:
        a, b = game.problem(task.data["seed"])
        messages = [{"role": "system", "content": SYSTEM_PROMPT},
                    {"role": "user", "content": user_turn(observation(a, b, "", game.MAX_TRIES), ACTION_SCHEMA)}]
        rewards: list[float] = []
        for tries in range(1, game.MAX_TRIES + 1):
            reply = await client.chat(messages)
            messages.append({"role": "assistant", "content": reply})
            try:
                answer = parse_reply(reply, ACTION_SCHEMA).get("answer")
                if isinstance(answer, bool) or not isinstance(answer, int):
                    raise ReplyError("answer is not an integer")
            except ReplyError as exc:
                return Outcome(reward=0.0, parts={"env_reward": sum(rewards), "valid": 0.0}, info={"reason": str(exc)})
            rewards.append(float(answer == a + b))
            if rewards[-1] == 1.0 or tries == game.MAX_TRIES:
                break
            messages.append({"role": "user", "content": user_turn(
                observation(a, b, game.hint(answer, a, b), game.MAX_TRIES - tries), ACTION_SCHEMA)})
        total = sum(rewards)
        return Outcome(reward=total, parts={"env_reward": total, "valid": 1.0}, passed=total >= 1.0,
                       info={"steps": len(rewards), "rewards": rewards})

    def demonstrations(self, tasks: list[Task]) -> list[dict[str, list[dict[str, str]]]]:
        return []
