"""A legacy verifiers environment module, multi-turn with a tool: a `vf.ToolEnv` whose tool is a
plain Python function (`add`), graded by a `vf.Rubric` (the sum right: 1.0, a tool call made: 0.5).
Written with verifiers' own classes only; run it as `verifiers:vf-tool-legacy` (see `vf_sum_legacy`).
"""

import re

import verifiers as vf
from datasets import Dataset


def add(a: int, b: int) -> str:
    """Add two integers and return the sum."""
    return str(a + b)


def _content(message) -> str:
    return str((message.get("content") if isinstance(message, dict) else message.content) or "")


def _role(message) -> str:
    return message["role"] if isinstance(message, dict) else message.role


def correct(completion, answer, **kwargs) -> float:
    """1 when the last reply's last number is the sum."""
    found = re.findall(r"-?\d+", _content(completion[-1]) if completion else "")
    return float(bool(found) and found[-1] == answer)


def used_tool(completion, **kwargs) -> float:
    """1 when the model called a tool."""
    return float(any(_role(m) == "tool" for m in completion or []))


def load_environment(num_tasks: int = 4, max_turns: int = 4) -> vf.Environment:
    rows = [{"question": f"Use the add tool to add {10 + i} and {20 + i}, then reply with the sum.",
             "answer": str(30 + 2 * i)} for i in range(num_tasks)]
    return vf.ToolEnv(dataset=Dataset.from_list(rows), tools=[add], max_turns=max_turns,
                      rubric=vf.Rubric(funcs=[correct, used_tool], weights=[1.0, 0.5]))
