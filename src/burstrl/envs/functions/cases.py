"""A functions task's cases as data: the arguments of each call and what it must return or raise.

Why data and not test files: the grader (`grade.py`) sends the arguments into the sandbox and keeps
the expected values to itself, so it needs them as values, not as source that asserts them. They
live in the task record (`extra["cases"]`, the `plaindata` form), named by the task's FAIL_TO_PASS
ids, so per-case statuses keep the ids that reports and evals already key by. The repository's
`tests/test_<id>.py` files still say the same in unittest form, for people; grading never reads or
uploads them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from burstrl.envs.functions import plaindata
from burstrl.envs.swe.task import SweTask, TaskError

REGENERATE = "burstrl tasks make-functions"


@dataclass(frozen=True)
class Case:
    """One call: `args`, and either the value it returns or the exception type it raises (`raises`)."""

    id: str
    args: tuple[Any, ...]
    returns: Any = None
    raises: str = ""  # the name of a builtin exception type; "" = the call returns `returns`


def is_functions_task(task: SweTask) -> bool:
    """A task made by `tasks make-functions` (any version, with or without cases)."""
    return task.version.startswith("functions-")


def encode_case(case: Case) -> dict[str, Any]:
    out: dict[str, Any] = {"id": case.id, "args": plaindata.encode(tuple(case.args))}
    if case.raises:
        out["raises"] = case.raises
    else:
        out["returns"] = plaindata.encode(case.returns)
    return out


def task_cases(task: SweTask) -> list[Case]:
    """The task's cases, checked; TaskError naming the task when it has none (a set made by an older
    burstrl: regenerate it) or they do not match its FAIL_TO_PASS."""
    raw = task.extra.get("cases")
    if raw is None:
        raise TaskError(f"task {task.instance_id}: no extra.cases (a functions task set made by an older burstrl, "
                        f"graded by test files that the candidate could reach): regenerate it with `{REGENERATE}`")
    if type(raw) is not list or not raw:
        raise TaskError(f"task {task.instance_id}: extra.cases must be a non-empty list")
    cases = [_case(task.instance_id, i, c) for i, c in enumerate(raw)]
    if [c.id for c in cases] != list(task.FAIL_TO_PASS):
        raise TaskError(f"task {task.instance_id}: the ids of extra.cases are not its FAIL_TO_PASS")
    return cases


def _case(iid: str, i: int, raw: Any) -> Case:
    where = f"task {iid}: extra.cases[{i}]"
    if type(raw) is not dict or type(raw.get("id")) is not str or ("raises" in raw) == ("returns" in raw):
        raise TaskError(f"{where}: must be {{id, args, and returns or raises}}")
    try:
        args = plaindata.decode(raw.get("args"))
        returns = plaindata.decode(raw["returns"]) if "returns" in raw else None
    except plaindata.PlainDataError as exc:
        raise TaskError(f"{where}: {exc}") from None
    raises = raw.get("raises", "")
    if type(args) is not tuple or type(raises) is not str or ("raises" in raw and not raises.isidentifier()):
        raise TaskError(f"{where}: args must be a tuple and raises an exception type's name")
    return Case(raw["id"], args, returns, raises)
