"""A verifiers v1 taskset package, multi-turn with a tool: add two numbers with the `calc_add` MCP tool.

The tool server is the taskset's (`Taskset.toolsets`): verifiers starts it once per serving
(`python -m vf_tool_v1.tool`, a subprocess that needs this directory on PYTHONPATH) and every
rollout shares it, instead of one server process per rollout (`Task.toolsets`). Rewards: the
reply's last number is the sum (1.0) and a tool was called (0.5). Written with verifiers' own
classes only; run it as `verifiers:vf-tool-v1` (see `vf_sum_v1`).
"""

import re

import verifiers.v1 as vf

from vf_tool_v1.tool import AddToolset


class AddData(vf.TaskData):
    answer: int


class AddTask(vf.Task[AddData]):
    @vf.reward
    async def correct(self, trace: vf.Trace) -> float:
        found = re.findall(r"-?\d+", trace.last_reply or "")
        return float(bool(found) and int(found[-1]) == self.data.answer)

    @vf.reward(weight=0.5)
    async def used_tool(self, trace: vf.Trace) -> float:
        return float(len(trace.tool_messages) > 0)


class AddConfig(vf.TasksetConfig):
    num_tasks: int = 4
    tools: vf.SharedToolsetConfig = vf.SharedToolsetConfig()


class AddTaskset(vf.Taskset[AddTask, AddConfig]):
    @classmethod
    def toolsets(cls, config: AddConfig) -> list[vf.Toolset]:
        return [AddToolset(config.tools)]

    def load(self):
        for i in range(self.config.num_tasks):
            a, b = 10 + i, 20 + i
            data = AddData(name=f"add-{i}", prompt=f"Use the add tool to add {a} and {b}, then reply with the sum.",
                           answer=a + b)
            yield AddTask(data, self.config.task)


__all__ = ["AddTaskset"]
