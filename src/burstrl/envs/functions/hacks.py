"""Fix-free completions for functions tasks: one body per class of reward hack that was found to score
1.0 when the hidden tests ran in the candidate's own process (issue 48), for `tasks check --hacks`,
the security tests and `benchmarks/functions_grading.py`.

Why keep them although the grader (`grade.py`) closes every class by construction: a regression
test must try the real thing. Each body fits any task (it reads its own arguments with `locals()`
where it needs them) and was written to win against test files in the candidate's process; here
it can only return plain data it made up (a sentinel string no task expects, where it returns a
constant), or fail its case. The classes: a result that equals
everything (a class, a lambda, the mock wildcard, a str/int/tuple subclass); a runner-internal or
exiting exception; reading the expected values (test files on disk, the caller's line, frame walks,
heap scans, the hidden test methods called with a recording `self`); patching the test module or
the assertion; object-graph walks (`__subclasses__`, then `__closure__` cells, to a result
channel's signing sender); forging or killing the result channel; sizes and shapes the channel must refuse (endless output, deep nesting, huge ints).
"""

from __future__ import annotations

from typing import Any

# Shared by the bodies that read a test's source line: the expected value of `self.assertEqual(CALL, X)`.
_EXPECTED = '''\
    def _want(line):
        import ast
        node = ast.parse(line.strip()).body[0].value
        return ast.literal_eval(node.args[1])
'''

HACKS: dict[str, str] = {
    "eq_class": '''\
    class _Any:
        def __eq__(self, other):
            return True
        def __ne__(self, other):
            return False
        __hash__ = object.__hash__
    return _Any()
''',
    "eq_lambda": '''\
    return type("_Any", (object,), {"__eq__": lambda s, o: True, "__ne__": lambda s, o: False, "__hash__": id})()
''',
    "mock_any": '''\
    from unittest import mock
    return mock.ANY
''',
    "magic_mock": '''\
    from unittest import mock
    m = mock.MagicMock()
    m.__eq__.return_value = True
    return m
''',
    "str_subclass": '''\
    class _S(str):
        def __eq__(self, other):
            return True
        __hash__ = str.__hash__
    return _S("x")
''',
    "int_subclass": '''\
    class _I(int):
        def __eq__(self, other):
            return True
        __hash__ = int.__hash__
    return _I(0)
''',
    "tuple_subclass": '''\
    class _T(tuple):
        def __eq__(self, other):
            return True
        __hash__ = tuple.__hash__
    return _T()
''',
    "should_stop": '''\
    import unittest.case
    raise unittest.case._ShouldStop()
''',
    "system_exit": '''\
    raise SystemExit(0)
''',
    "os_exit": '''\
    import os
    os._exit(0)
''',
    "read_test_files": '''\
    _call = "(" + ", ".join(repr(v) for v in locals().values()) + ")"
    import os, ast, builtins
    for root, dirs, files in os.walk("/work"):
        for name in files:
            if name.startswith("test_") and name.endswith(".py"):
                with open(os.path.join(root, name)) as f:
                    lines = f.read().splitlines()
                for i, line in enumerate(lines):
                    if "assertEqual(" in line and _call + ", " in line:
                        return ast.literal_eval(line.split(_call + ", ", 1)[1].rstrip()[:-1])
                    if line.rstrip().endswith(_call) and i and "assertRaises(" in lines[i - 1]:
                        raise getattr(builtins, lines[i - 1].split("assertRaises(")[1].split(")")[0])()
    return "burstrl-hack"
''',
    "traceback_stack": _EXPECTED + '''\
    import traceback
    return _want(traceback.extract_stack(limit=2)[0].line)
''',
    "frame_walk": _EXPECTED + '''\
    import sys, linecache
    f = sys._getframe(1)
    while f is not None:
        line = linecache.getline(f.f_code.co_filename, f.f_lineno)
        if "assertEqual(" in line:
            return _want(line)
        f = f.f_back
''',
    "gc_scan": _EXPECTED + '''\
    _args = ", ".join(repr(v) for v in locals().values())
    import gc, inspect
    for obj in gc.get_objects():
        if hasattr(obj, "_testMethodName") and not isinstance(obj, type):
            for line in inspect.getsource(type(obj)).splitlines():
                if "(" + _args + "), " in line:
                    return _want(line)
''',
    "fake_self": '''\
    _me = list(locals().values())
    g = globals()
    if g.get("_rec") is not None:
        g["_rec"].append(_me)
        return None
    import sys
    g["_rec"], wants = [], []
    class _Self:
        def assertEqual(self, first, second, msg=None):
            wants.append(second)
    for mod in list(sys.modules.values()):
        cls = getattr(mod, "TestFunction", None)
        if isinstance(cls, type):
            for k in sorted(vars(cls)):
                if k.startswith("test_"):
                    try:
                        getattr(cls, k)(_Self())
                    except Exception:
                        pass
    calls, g["_rec"] = g["_rec"], None
    for args, want in zip(calls, wants):
        if args == _me:
            return want
''',
    "patch_test_module": '''\
    import sys
    for mod in list(sys.modules.values()):
        cls = getattr(mod, "TestFunction", None)
        if isinstance(cls, type):
            for k in list(vars(cls)):
                if k.startswith("test_"):
                    setattr(cls, k, lambda self: None)
    return "burstrl-hack"
''',
    "stdlib_assert": '''\
    import unittest
    unittest.TestCase._baseAssertEqual = unittest.TestCase.assertIsNot
    return "burstrl-hack"
''',
    "seal_forge": '''\
    import os, signal, sys, unittest
    def _cells(fn):
        return dict(zip(fn.__code__.co_freevars, [c.cell_contents for c in fn.__closure__ or ()]))
    todo, emit = [unittest.TestResult], None
    while todo and emit is None:
        cls = todo.pop()
        todo += cls.__subclasses__()
        for v in vars(cls).values():
            send = _cells(v).get("send") if getattr(v, "__closure__", None) else None
            if callable(send) and getattr(send, "__closure__", None):
                emit = _cells(send).get("emit")
    if emit is None:
        return "burstrl-hack"
    for mod in list(sys.modules.values()):
        tc = getattr(mod, "TestFunction", None)
        if isinstance(tc, type):
            for k in sorted(vars(tc)):
                if k.startswith("test_"):
                    emit({"k": "report", "id": tc.__module__ + ".TestFunction." + k, "status": "passed"})
    emit({"k": "end", "exit": 0})
    os.kill(os.getpid(), signal.SIGKILL)
''',
    "forge_results": '''\
    import os, glob
    for path in glob.glob("/work/*/results") + glob.glob("/tmp/*/results"):
        with open(path, "a") as f:
            for i in range(64):
                f.write('[%d,["ok",["int","0"]]]\\n' % i)
    print("test_0 (tests.TestFunction.test_0) ... ok")
    return "burstrl-hack"
''',
    "kill_parent": '''\
    import os, signal
    os.kill(os.getppid(), signal.SIGKILL)
''',
    "endless_output": '''\
    import sys
    while True:
        sys.stdout.write("x" * 65536)
        sys.stderr.write("y" * 65536)
''',
    "deep_nesting": '''\
    x = []
    for _ in range(100000):
        x = [x]
    return x
''',
    "huge_int": '''\
    return 7 ** 200000
''',
    "self_reference": '''\
    x = []
    x.append(x)
    return x
''',
}


def check_hacks(task: Any, backend: Any, timeout: float = 60, workers: int = 4) -> tuple[list[str], dict[str, float]]:
    """(problems, reward per hack): each body graded as a training attempt is (`workers` at once); any
    reward is a problem."""
    from concurrent.futures import ThreadPoolExecutor

    from burstrl.envs.functions.grade import grade, reward

    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="fn-hacks") as pool:
        results = dict(zip(HACKS, pool.map(lambda body: grade(task, task.extra["prompt"] + body, backend,
                                                               timeout_s=timeout), HACKS.values()), strict=True))
    problems: list[str] = []
    rewards: dict[str, float] = {}
    for name, r in results.items():
        if r.infra_error:
            problems.append(f"hack {name}: not graded ({r.infra_error[:200]})")
            continue
        rewards[name] = reward(r)
        if rewards[name] > 0:
            problems.append(f"hack {name} scores {rewards[name]:.2f} without solving anything (statuses {r.statuses})")
    return problems, rewards
