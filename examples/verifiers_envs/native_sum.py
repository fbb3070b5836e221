"""The vf_sum task as a native burstrl environment: the baseline of the verifiers adapters' overhead.

It plays exactly what `vf_sum_legacy.py` plays (and `vf_sum_v1`, which has the same questions and
rule but no system prompt): the same rows ("What is a + b? Reply with the number.", the system
prompt "Answer with a number."), drawn the way `VerifiersEnv` draws a split's rows for a seed, one
`client.chat` call, and the same reward (1 when the reply's last number is the answer). So an
episode here differs from one through "verifiers:vf_sum_legacy" or "verifiers:vf_sum_v1" only by
what verifiers and the adapter add (`benchmarks/ecosystem_overhead.py`). No verifiers import: that
is part of what is measured.
"""

from __future__ import annotations

import re

from burstrl.envs.base import ChatClient, Outcome, Task
from burstrl.envs.ecosystem.vf_common import draw

SYSTEM_PROMPT = "Answer with a number."  # vf_sum_legacy's load_environment default


def rows(count: int, first: int) -> list[dict[str, str]]:
    """vf_sum_legacy's `_rows`: the questions and answers of its dataset (train from 0, eval from 100)."""
    return [{"question": f"What is {3 + i} + {4 + 2 * i}? Reply with the number.", "answer": str(7 + 3 * i)}
            for i in range(first, first + count)]


def correct(reply: str, answer: str) -> float:
    """1 when the reply's last number is the answer (vf_sum_legacy's `correct`)."""
    found = re.findall(r"-?\d+", reply)
    return float(bool(found) and found[-1] == answer)


class NativeSumEnv:
    name = "native_sum"
    max_difficulty = 1

    def __init__(self, num_tasks: int = 4, num_eval_tasks: int = 2, system_prompt: str | None = SYSTEM_PROMPT) -> None:
        self.rows = {"train": rows(num_tasks, 0), "test": rows(num_eval_tasks, 100)}
        self.system_prompt = system_prompt

    def make_tasks(self, n: int, seed: int, difficulty: int = 1, split: str = "train") -> list[Task]:
        pool = self.rows[split]
        return [Task(id=f"native-sum-{split}-s{seed}-{i:05d}-e{j}", env=self.name, difficulty=1, data=dict(pool[j]))
                for i, j in enumerate(draw(len(pool), n, seed, split))]

    async def rollout(self, client: ChatClient, task: Task) -> Outcome:
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        reply = await client.chat([*system, {"role": "user", "content": task.data["question"]}])
        reward = correct(reply, task.data["answer"])
        return Outcome(reward=reward, parts={"correct": reward}, passed=reward >= 0.5)

    def demonstrations(self, tasks: list[Task]) -> list[dict[str, list[dict[str, str]]]]:
        return []
