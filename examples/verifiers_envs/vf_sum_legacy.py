"""A legacy verifiers environment module (verifiers <= 0.3.1): `load_environment(**kwargs)`
returning a `vf.SingleTurnEnv` graded by a `vf.Rubric`: "What is a + b?", rewarded on the reply's
last number. Written with verifiers' own classes only. With this directory on PYTHONPATH:

    burstrl eval --model DIR --env verifiers:vf-sum-legacy --env-option args.num_tasks=8

The keyword arguments of `load_environment` are the options (`args`); an unknown one fails the check.
"""

import re

import verifiers as vf
from datasets import Dataset


def _rows(count: int, first: int) -> list[dict[str, str]]:
    return [{"question": f"What is {3 + i} + {4 + 2 * i}? Reply with the number.", "answer": str(7 + 3 * i)}
            for i in range(first, first + count)]


def correct(completion, answer, **kwargs) -> float:
    """1 when the reply's last number is the answer."""
    found = re.findall(r"-?\d+", str(completion[-1]["content"] or "") if completion else "")
    return float(bool(found) and found[-1] == answer)


def load_environment(num_tasks: int = 4, num_eval_tasks: int = 2, system_prompt: str = "Answer with a number.",
                     ) -> vf.Environment:
    return vf.SingleTurnEnv(dataset=Dataset.from_list(_rows(num_tasks, 0)),
                            eval_dataset=Dataset.from_list(_rows(num_eval_tasks, 100)),
                            system_prompt=system_prompt, rubric=vf.Rubric(funcs=[correct], weights=[1.0]))
