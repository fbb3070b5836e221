"""Functions grading's host side and runner (issue 48): result lines read strictly, cases compared
here, each case isolated in the runner, and task sets without cases refused with a clear message.
The runner runs as a plain subprocess here (`tasks check --host`'s path); the sandboxed path is in
tests/integration/test_functions_env.py and tests/security/test_functions_hacks.py."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from burstrl.envs.functions.cases import Case, encode_case, task_cases
from burstrl.envs.functions.check import check_function_task, run_on_host
from burstrl.envs.functions.env import FunctionsEnv, FunctionsOptions
from burstrl.envs.functions.grade import case_status, read_results, stub_source
from burstrl.envs.functions.tasks import VERSION, apply_patch, attempt_patch, make_function_tasks
from burstrl.envs.swe.task import SweTask, TaskError, dump_tasks


def hand_task(cases: list[Case], name: str = "f", params: str = "x") -> SweTask:
    prompt = f'def {name}({params}):\n    """Hand-built."""\n'
    return SweTask(instance_id="fn-hand", repo="unused", base_commit="unused", problem_statement=prompt,
                   FAIL_TO_PASS=[c.id for c in cases], PASS_TO_PASS=[], version=VERSION,
                   extra={"prompt": prompt, "function": name, "file": f"fns/{name}.py",
                          "cases": [encode_case(c) for c in cases]})


CASES = [Case("t0", (1,), 2), Case("t1", (-1,), None, "ValueError"), Case("t2", (5,), 10)]


def test_result_lines_are_read_strictly_and_never_raise() -> None:
    ok = '[0,["ok",["int","2"]]]\n[1,["raise","ValueError"]]\n[2,["timeout"]]\n'
    assert read_results(ok, 3) == ("", [["ok", 2], ["raise", "ValueError"], ["timeout"]])
    assert read_results('["import",["raise","SyntaxError"]]\n', 3) == ("SyntaxError", [None] * 3)
    dup = '[0,["ok",["int","2"]]]\n[0,["ok",["int","2"]]]\n'
    assert read_results(dup, 3)[1][0] == ["invalid", "more than one result"]
    assert read_results("[0,1]\n" * 5, 3)[1] == [["invalid", "more result lines than cases"]] * 3
    odd = '[true,["ok",["int","2"]]]\n[3,["ok",["int","2"]]]\n[-1,["timeout"]]\n[1,["ok",["int","01"]]]\n'
    assert read_results(odd, 3)[1] == [None, ["invalid", "an int that is not a bounded decimal string"], None]
    rng = random.Random(7)
    for _ in range(3000):  # hostile files: garbage, cut lines, huge lines
        text = "".join(rng.choice(['[0,["ok",', '["int","1"]]]', "\n", "[", "]", '"', "x" * rng.randint(0, 9),
                                   "[" * 500, "1" * 400, '[1,["exit",0]]\n']) for _ in range(rng.randint(0, 12)))
        _, entries = read_results(text, 3)
        assert len(entries) == 3
    _, entries = read_results('[0,["ok",["str","' + "x" * 300000 + '"]]]\n', 1)
    assert entries == [None]


@pytest.mark.parametrize(("case", "entry", "status"), [
    (CASES[0], ["ok", 2], "passed"), (CASES[0], ["ok", 2.0], "passed"), (CASES[0], ["ok", 3], "failed"),
    (CASES[0], ["raise", "ValueError"], "error"), (CASES[1], ["raise", "ValueError"], "passed"),
    (CASES[1], ["raise", "TypeError"], "failed"), (CASES[1], ["ok", None], "failed"), (CASES[0], None, "missing"),
    (CASES[0], ["timeout"], "timeout"), (CASES[0], ["crashed", "exit 0"], "crashed"),
    (CASES[0], ["invalid", "x"], "invalid"),
])
def test_each_case_is_compared_in_the_grader(case: Case, entry: Any, status: str) -> None:
    assert case_status(case, entry) == status


def test_the_runner_isolates_each_case(tmp_path: Path) -> None:
    """One call per forked child: an exception, an exit, a hang, output too large or not plain data
    fails that case only; the others keep their results."""
    cases = [Case(f"t{i}", (i,), i) for i in range(7)]
    body = ("    import os, sys\n    if x == 1:\n        raise SystemExit(0)\n    if x == 2:\n        os._exit(3)\n"
            "    if x == 3:\n        while True:\n            pass\n    if x == 4:\n        return 'y' * 10 ** 6\n"
            "    if x == 5:\n        return object()\n    print('noise')\n    return x\n")
    task = hand_task(cases)
    r = run_on_host(task, task.extra["prompt"] + body, timeout=4)
    assert list(r.statuses.values()) == ["passed", "error", "crashed", "timeout", "invalid", "invalid", "passed"]
    assert r.f2p == 2 / 7 and not r.resolved
    broken = run_on_host(task, task.extra["prompt"] + "    return (\n", timeout=4)
    assert broken.import_error == "SyntaxError" and set(broken.statuses.values()) == {"error"}


def test_patches_apply_back_to_the_module() -> None:
    stub = 'def f(x):\n    """Doc."""\n    raise NotImplementedError\n'
    for new in ('def f(x):\n    """Doc."""\n    return x\n', 'def f(x):\n    """Doc."""\n    if x:\n        return 1\n'
                "    return 0", 'def f(x):\n    """Doc."""\n    s = """\n\n"""\n    return s\n'):
        assert apply_patch(stub, attempt_patch("fns/f.py", stub, new)) == new
    with pytest.raises(ValueError):
        apply_patch(stub.replace("Doc", "Other"), attempt_patch("fns/f.py", stub, stub + "x\n"))


def test_tasks_carry_their_cases_and_some_expect_an_exception(tmp_path: Path) -> None:
    tasks = make_function_tasks(tmp_path / "set", 200, 0, "train")
    raising = 0
    for t in tasks:
        cases = task_cases(t)
        assert [c.id for c in cases] == t.FAIL_TO_PASS and t.version == VERSION
        raising += sum(bool(c.raises) for c in cases)
        assert apply_patch(stub_source(t), t.patch).startswith(t.extra["prompt"])
    assert raising > 0
    result = check_function_task(tasks[0], sandbox=False, timeout=10)
    assert result.ok, result.problems


def test_a_task_set_without_cases_names_the_command_that_remakes_it(tmp_path: Path) -> None:
    """A set made by an older burstrl (graded by its test files): a clear error, before any attempt."""
    tasks = make_function_tasks(tmp_path / "set", 3, 0, "train")
    for t in tasks:
        del t.extra["cases"]
        t.version = "functions-1"
    dump_tasks(tasks, tmp_path / "set" / "tasks.jsonl")
    env = FunctionsEnv(FunctionsOptions(tasks=str(tmp_path / "set")), tmp_path / "run")
    with pytest.raises(TaskError, match="burstrl tasks make-functions"):
        env.tasks("train")
    from burstrl.envs.swe.check import check_task

    result = check_task(tasks[0], tmp_path / "work", sandbox=False)
    assert not result.ok and "burstrl tasks make-functions" in result.problems[0]


def test_the_static_scan_option_is_gone_with_a_message() -> None:
    with pytest.raises(ValidationError, match="no longer an option.*remove the key"):
        FunctionsOptions(suspicious="zero")
    assert "suspicious" not in FunctionsOptions().model_dump()


def test_check_on_the_host_finds_a_wrong_expected_value(tmp_path: Path) -> None:
    [task] = make_function_tasks(tmp_path / "set", 1, 0, "train")
    raw = task.extra["cases"][0]
    raw.pop("raises", None)
    raw["returns"] = ["str", "not the answer"]
    result = check_function_task(task, sandbox=False, timeout=10)
    assert not result.ok and f"FAIL_TO_PASS {task.FAIL_TO_PASS[0]} is failed with the gold patch" in result.problems
    assert json.dumps(result.at_gold)
