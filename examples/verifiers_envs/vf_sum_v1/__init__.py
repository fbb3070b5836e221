"""A verifiers v1 taskset package, single turn: "What is a + b?", rewarded on the reply's last number.

Written with verifiers' own classes only (nothing from burstrl). With this directory on PYTHONPATH:

    burstrl eval --model DIR --env verifiers:vf-sum-v1 --env-option args.num_tasks=8

or in a run config:

    [orchestrator.envs]
    "verifiers:vf-sum-v1" = 1.0

    [orchestrator.env."verifiers:vf-sum-v1"]
    args = {num_tasks = 8}    # this taskset's config (SumConfig); an unknown key fails the check
"""

import re

import verifiers.v1 as vf


class SumData(vf.TaskData):
    answer: int


class SumTask(vf.Task[SumData]):
    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        found = re.findall(r"-?\d+", trace.last_reply or "")
        return float(bool(found) and int(found[-1]) == self.data.answer)

    @vf.metric
    async def reply_chars(self, trace: vf.Trace) -> float:
        return float(len(trace.last_reply or ""))


class SumConfig(vf.TasksetConfig):
    num_tasks: int = 4


class SumTaskset(vf.Taskset[SumTask, SumConfig]):
    def load(self):
        for i in range(self.config.num_tasks):
            a, b = 3 + i, 4 + 2 * i
            data = SumData(name=f"sum-{i}", prompt=f"What is {a} + {b}? Reply with the number.", answer=a + b)
            yield SumTask(data, self.config.task)


__all__ = ["SumTaskset"]
