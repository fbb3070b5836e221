"""Fix-free completions against functions grading (issue 48), graded through `FunctionsEnv.rollout`
exactly as in training: each must score 0. And honest controls, which must score 1.0.

Each class below scored 1.0 while the hidden unittest file ran in the candidate's own process. Now the
candidate runs in a sandbox that holds neither the tests nor the expected values, and only plain data
crosses back (`envs/functions/grade.py`), so every class fails by construction; these tests try
several variants of each anyway, on real generated tasks of three kinds (ints, strings, lists or
dicts). The honest controls (hand-built tasks) return every kind of plain data the channel carries,
and raise the exception their task expects, so the channel does not start rejecting real code.
"""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path
from typing import Any

import pytest

from burstrl.envs.base import Outcome, Task
from burstrl.envs.functions.cases import Case, encode_case
from burstrl.envs.functions.env import FunctionsEnv, FunctionsOptions
from burstrl.envs.functions.hacks import HACKS
from burstrl.envs.functions.tasks import VERSION, make_function_tasks
from burstrl.envs.swe.task import SweTask

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None,
                                reason="bubblewrap (bwrap) is not installed: `make system-deps` as root")

# More variants per class than the battery holds (`envs/functions/hacks.py`).
VARIANTS: dict[str, str] = {
    "eq_class_attr": "    class _A:\n        __eq__ = lambda s, o: True\n        __hash__ = lambda s: 0\n    return _A()\n",
    "lying_class": "    class _A:\n        __class__ = property(lambda s: int)\n        def __eq__(s, o):\n"
                   "            return True\n    return _A()\n",  # isinstance(x, int) is True; type(x) is not
    "float_subclass": "    class _F(float):\n        def __eq__(s, o):\n            return True\n"
                      "        __hash__ = float.__hash__\n    return _F(0.5)\n",
    "list_subclass": "    class _L(list):\n        def __eq__(s, o):\n            return True\n    return _L()\n",
    "dict_subclass": "    class _D(dict):\n        def __eq__(s, o):\n            return True\n    return _D()\n",
    "bytes_subclass": "    class _B(bytes):\n        def __eq__(s, o):\n            return True\n"
                      "        __hash__ = bytes.__hash__\n    return _B()\n",
    "any_in_a_list": "    from unittest import mock\n    return [mock.ANY, mock.ANY]\n",
    "any_in_a_tuple": "    from unittest import mock\n    return (mock.ANY,)\n",
    "any_as_dict_value": "    from unittest import mock\n    return {'apple': mock.ANY}\n",
    "skip_test": "    import unittest\n    raise unittest.SkipTest('skip')\n",
    "keyboard_interrupt": "    raise KeyboardInterrupt\n",
    "generator_exit": "    raise GeneratorExit\n",
    "base_exception": "    raise BaseException('x')\n",
    "sys_exit": "    import sys\n    sys.exit(0)\n",
    "kill_self": "    import os, signal\n    os.kill(os.getpid(), signal.SIGKILL)\n",
    "read_repo_paths": "    import glob\n    for p in glob.glob('/work/**/*.py', recursive=True) + glob.glob('/tmp/**/*.py', "
                       "recursive=True):\n        t = open(p).read()\n        if 'assertEqual' in t:\n"
                       "            return t\n    return 'burstrl-hack'\n",
    "scan_whole_fs": "    import os\n    for root, dirs, files in os.walk('/'):\n        for f in files:\n"
                     "            if f.startswith('test_fn'):\n                return open(os.path.join(root, f)).read()\n"
                     "    return 'burstrl-hack'\n",
    "inspect_stack": "    import inspect, ast\n    line = inspect.stack()[1].code_context[0]\n"
                     "    return ast.literal_eval(ast.parse(line.strip()).body[0].value.args[1])\n",
    "frame_locals": "    import sys\n    f = sys._getframe(1)\n    while f is not None:\n"
                    "        for k in ('expected', 'second', 'want', 'case'):\n            if k in f.f_locals:\n"
                    "                return f.f_locals[k]\n        f = f.f_back\n    return 'burstrl-hack'\n",
    "gc_expected_dicts": "    import gc\n    for o in gc.get_objects():\n        if isinstance(o, dict) and "
                         "'returns' in o:\n            return o['returns']\n    return 'burstrl-hack'\n",
    "patch_encoder": "    import sys\n    pd = sys.modules.get('plaindata')\n    if pd is not None:\n"
                     "        pd.dumps = lambda v: '[\"str\",\"burstrl-hack\"]'\n    return object()\n",
    "patch_runner_in_main": "    import sys\n    m = sys.modules['__main__']\n"
                            "    m.run_case = lambda *a: '[\"ok\",[\"str\",\"burstrl-hack\"]]'\n    return object()\n",
    "closure_walk": "    import sys\n    for m in list(sys.modules.values()):\n        for v in list(vars(m).values()):\n"
                    "            for c in getattr(v, '__closure__', None) or ():\n                try:\n"
                    "                    return c.cell_contents\n                except ValueError:\n"
                    "                    pass\n    return 'burstrl-hack'\n",
    "rewrite_results": "    import os\n    p = '/work/job/results'\n    with open(p, 'w') as f:\n        for i in range(5):\n"
                       "            f.write('[%d,[\"ok\",[\"str\",\"burstrl-hack\"]]]\\n' % i)\n    os._exit(0)\n",
    "stop_parent": "    import os, signal\n    os.kill(os.getppid(), signal.SIGSTOP)\n",
    "kill_group": "    import os, signal\n    os.killpg(0, signal.SIGKILL)\n",
    "kill_everything": "    import os, signal\n    os.kill(-1, signal.SIGKILL)\n",
    "results_fifo": "    import os\n    os.remove('/work/job/results')\n    os.mkfifo('/work/job/results')\n    return 1\n",
    "results_dev_zero": "    import os\n    os.remove('/work/job/results')\n    os.symlink('/dev/zero', '/work/job/results')\n"
                        "    return 1\n",
    "results_dir": "    import os\n    os.remove('/work/job/results')\n    os.mkdir('/work/job/results')\n    return 1\n",
    "results_huge": "    with open('/work/job/results', 'a') as f:\n        f.write('x' * (40 << 20))\n    return 1\n",
    "raw_fd_output": "    import os\n    while True:\n        os.write(1, b'[0,[\"ok\",[\"int\",\"1\"]]]\\n' * 1000)\n",
    "deep_dict": "    x = {}\n    for _ in range(1000):\n        x = {'k': x}\n    return x\n",
    "deep_tuple": "    x = ()\n    for _ in range(1000):\n        x = (x,)\n    return x\n",
    "huge_int_str_limit": "    return 10 ** 5000\n",
    "huge_str": "    return 'x' * 10000000\n",
    "huge_list": "    return list(range(1000000))\n",
    "colliding_set": "    return {k * (2 ** 61 - 1) for k in range(2000)}\n",
    "generator": "    return (i for i in range(3))\n",
    "a_function": "    return len\n",
    "nan": "    return float('nan')\n",
}
ALL = {**HACKS, **VARIANTS}


class Scripted:
    """The model's side: every completion is `text` (what a policy could sample)."""

    def __init__(self, text: str) -> None:
        self.text = text

    async def chat(self, messages: Any, max_tokens: int | None = None) -> str:
        raise AssertionError("a base-model environment never chats")

    async def complete(self, prompt: str, max_tokens: int | None = None, stop: list[str] | None = None) -> str:
        return self.text


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory):
    # 12 s: each of a task's ~10 cases gets 1/22 of it; at 6 s (0.27 s a case) a case importing
    # unittest.mock in its forked child ran out of time on the loaded CI machine (mock_any: timeout)
    e = FunctionsEnv(FunctionsOptions(n_tasks=5, backend="namespace", max_sandboxes=4, grade_timeout_s=12),
                     tmp_path_factory.mktemp("run"))
    yield e
    e.close()


@pytest.fixture(scope="module")
def tasks(tmp_path_factory: pytest.TempPathFactory) -> list[Task]:
    """Three real generated tasks: an int function, a str function, a list or dict function."""
    made = make_function_tasks(tmp_path_factory.mktemp("set"), 60, 0, "train")
    picked = [next(t for t in made if t.extra["category"] == cat) for cat in ("arith", "str", "list")]
    return [Task(id=t.instance_id, env="functions", difficulty=1, data=t.to_json()) for t in picked]


def rollouts(env: FunctionsEnv, pairs: list[tuple[str, Task]]) -> list[Outcome]:
    async def go() -> list[Outcome]:
        return await asyncio.gather(*(env.rollout(Scripted(body), task) for body, task in pairs))
    return asyncio.run(go())


@pytest.mark.parametrize("group", [sorted(ALL)[i::4] for i in range(4)], ids=lambda g: f"{g[0]}..{g[-1]}")
def test_fix_free_completions_earn_nothing(env: FunctionsEnv, tasks: list[Task], group: list[str]) -> None:
    """Every hack body: reward 0, never resolved. The battery's bodies on all three tasks, the
    variants each on one (in turn)."""
    pairs = [(name, task) for i, name in enumerate(group)
             for task in (tasks if name in HACKS else [tasks[i % len(tasks)]])]
    outcomes = rollouts(env, [(ALL[name], task) for name, task in pairs])
    won = [(name, task.id, out.reward, out.info["statuses"]) for (name, task), out in zip(pairs, outcomes, strict=True)
           if out.reward > 0 or out.passed]
    assert not won, won


def test_what_each_class_ends_as(env: FunctionsEnv, tasks: list[Task]) -> None:
    """The reason each class fails, so a regression that fails them for another reason shows: lying
    objects are not plain data, runner exceptions are exceptions, exits crash their case only, a
    stopped runner is the model's timeout, a killed runner its named failure."""
    names = ["eq_class", "mock_any", "str_subclass", "lying_class", "should_stop", "os_exit", "kill_parent",
             "stop_parent", "deep_nesting", "huge_int", "endless_output", "traceback_stack"]
    outcomes = rollouts(env, [(ALL[n], tasks[0]) for n in names])
    got = {n: (sorted(set(o.info["statuses"].values())), o.info.get("reason", "").split(":", 1)[0])
           for n, o in zip(names, outcomes, strict=True)}
    assert got == {
        "eq_class": (["invalid"], ""), "mock_any": (["invalid"], ""), "str_subclass": (["invalid"], ""),
        "lying_class": (["invalid"], ""), "should_stop": (["error"], ""), "os_exit": (["crashed"], ""),
        "kill_parent": (["missing"], "runner_lost"), "stop_parent": (["timeout"], "tests_timeout"),
        "deep_nesting": (["invalid"], ""), "huge_int": (["invalid"], ""), "endless_output": (["timeout"], ""),
        "traceback_stack": (["error"], ""),
    }, got


# ---- honest controls ----

def hand_task(name: str, params: str, cases: list[tuple[tuple[Any, ...], Any]]) -> Task:
    """A functions task built by hand: `cases` are (args, expected) or (args, ("raises", NAME))."""
    iid = f"fn-hand-{name}"
    ids = [f"tests.test_{name}.TestFunction.test_{i}" for i in range(len(cases))]
    made = [Case(tid, args, None, exp[1]) if isinstance(exp, tuple) and exp[:1] == ("raises",) else
            Case(tid, args, exp) for tid, (args, exp) in zip(ids, cases, strict=True)]
    prompt = f'def {name}({params}):\n    """Hand-built."""\n'
    swe = SweTask(instance_id=iid, repo="unused", base_commit="unused", problem_statement=prompt,
                  FAIL_TO_PASS=ids, PASS_TO_PASS=[], version=VERSION, memory=512, disk=64,
                  extra={"prompt": prompt, "function": name, "file": f"fns/{name}.py",
                         "cases": [encode_case(c) for c in made], "split": "train"})
    return Task(id=iid, env="functions", difficulty=1, data=swe.to_json())


CONTROLS: dict[str, tuple[Task, str]] = {  # name -> (task, a correct body)
    "tuple": (hand_task("swap", "a, b", [((1, 2), (2, 1)), (("x", None), (None, "x"))]), "    return (b, a)\n"),
    "set": (hand_task("uniq", "xs", [(([3, 1, 3],), {1, 3}), (([],), set())]), "    return set(xs)\n"),
    "frozenset": (hand_task("frozen", "xs", [(([1, 2],), frozenset({1, 2})), (([],), frozenset())]),
                  "    return frozenset(xs)\n"),
    "dict": (hand_task("lengths", "words", [((["a", "bb"],), {"a": 1, "bb": 2}), (([(1, 2)],), {(1, 2): 2})]),
             "    return {w: len(w) for w in words}\n"),
    "dict_of_frozenset": (hand_task("keyed", "xs", [(([1, 2],), {frozenset({1, 2}): (1, [2])})]),
                          "    return {frozenset(xs): (xs[0], xs[1:])}\n"),
    "nested_lists": (hand_task("triangle", "n", [((3,), [[], [1], [2, 2]]), ((0,), [])]),
                     "    return [[i] * i for i in range(n)]\n"),
    "float": (hand_task("half", "x", [((3,), 1.5), ((1e308,), 5e307), ((-0.0,), -0.0),
                                      ((float("inf"),), float("inf"))]), "    return x / 2\n"),
    "none": (hand_task("maybe", "x", [((-1,), None), ((4,), 4)]), "    return None if x < 0 else x\n"),
    "bool": (hand_task("positive", "x", [((1,), True), ((-1,), False)]), "    return x > 0\n"),
    "bytes": (hand_task("encode", "s", [(("naïve ☃ 🐍",), "naïve ☃ 🐍".encode()), (("",), b"")]),
              "    return s.encode()\n"),
    "str": (hand_task("echo", "s", [(("naïve ☃ 🐍 \n\"'\\",), "naïve ☃ 🐍 \n\"'\\"), (("\ud800",), "\ud800")]),
            "    return s\n"),
    "big_int": (hand_task("big", "n", [((1000,), 2 ** 1000), ((-5,), -5)]), "    return 2 ** n if n > 0 else n\n"),
    "raises_zero_division": (hand_task("inverse", "x", [((2,), 0.5), ((0,), ("raises", "ZeroDivisionError"))]),
                             "    return 1 / x\n"),
    "raises_value_error": (hand_task("checked", "x", [((2,), 4), ((-1,), ("raises", "ValueError"))]),
                           "    if x < 0:\n        raise ValueError('negative')\n    return x * 2\n"),
    "raises_key_error": (hand_task("lookup", "d", [(({"k": 1},), 1), (({},), ("raises", "KeyError"))]),
                         "    return d['k']\n"),
    "prints": (hand_task("printing", "x", [((1,), 2)]),
               "    print('debug', x)\n    import sys\n    print('more', file=sys.stderr)\n    return x + 1\n"),
}


def test_honest_controls_pass(env: FunctionsEnv) -> None:
    """Correct solutions returning tuples, sets, frozensets, dicts (tuple and frozenset keys), nested
    lists, floats (-0.0, inf, large), None, bools, bytes, unicode and surrogate strings, big ints,
    and raising the exception their task expects: all score 1.0."""
    outcomes = rollouts(env, [(body, task) for task, body in CONTROLS.values()])
    failed = [(name, out.info["statuses"], out.info.get("reason")) for name, out in
              zip(CONTROLS, outcomes, strict=True) if out.reward != 1.0 or not out.passed]
    assert not failed, failed


def test_a_wrong_value_of_the_right_type_still_fails(env: FunctionsEnv) -> None:
    """The controls' tasks with a subtly wrong body: the comparison is real, not a type check."""
    wrong = {"tuple": "    return (a, b)\n", "set": "    return list(set(xs))\n",
             "float": "    return x / 2 + 1e-9\n",  # 1.5 and -0.0 differ; 5e307 and inf absorb it
             "raises_zero_division": "    return 1 / x if x else 0\n",
             "raises_value_error": "    if x < 0:\n        raise TypeError('negative')\n    return x * 2\n"}
    outcomes = rollouts(env, [(body, CONTROLS[name][0]) for name, body in wrong.items()])
    assert [o.reward for o in outcomes] == [0.0, 0.0, 0.5, 0.5, 0.5], [o.info for o in outcomes]


def test_hack_battery_of_tasks_check_finds_nothing(tmp_path: Path) -> None:
    """`tasks check --hacks` on functions tasks grades the battery; none scores, so the tasks hold."""
    from burstrl.envs.swe.check import check_tasks

    made = make_function_tasks(tmp_path / "set", 1, 3, "test")
    # 8 s: at 3 s the stub alone took 1.8 s on the loaded CI machine (over half the limit: not graded)
    [result] = check_tasks(made, tmp_path / "work", timeout=8, hacks="zero")
    assert result.ok, result.problems
