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
the assertion; object-graph walks (`__subclasses__`, `__closure__`); forging or killing the result
channel; sizes and shapes the channel must refuse (endless output, deep nesting, huge ints).
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
    _args = ", ".join(repr(v) for v in locals().values())
    import os, ast
    for top in ("/work", "/tmp", "/opt"):
        for root, dirs, files in os.walk(top):
            for name in files:
                if name.startswith("test_") and name.endswith(".py"):
                    try:
                        text = open(os.path.join(root, name)).read()
                    except Exception:
                        continue
                    for line in text.splitlines():
                        if "assertEqual(" in line and "(" + _args + "), " in line:
                            return ast.literal_eval(line.split("(" + _args + "), ", 1)[1].rstrip()[:-1])
''',
    "traceback_stack": _EXPECTED + '''\
    import traceback
    return _want(traceback.extract_stack()[-2].line)
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
    import sys, unittest
    for mod in list(sys.modules.values()):
        cls = getattr(mod, "TestFunction", None)
        if isinstance(cls, type):
            for k in list(vars(cls)):
                if k.startswith("test_"):
                    setattr(cls, k, lambda self: None)
    unittest.TestCase._baseAssertEqual = lambda self, first, second, msg=None: None
    return "burstrl-hack"
''',
    "stdlib_assert": '''\
    import unittest
    unittest.TestCase._baseAssertEqual = unittest.TestCase.assertIsNotNone
    return "burstrl-hack"
''',
    "subclass_walk": '''\
    _me = list(locals().values())
    found = []
    todo = [object]
    while todo and len(found) < 100000:
        cls = todo.pop()
        try:
            todo += type.__subclasses__(cls)
        except Exception:
            continue
        for v in list(vars(cls).values()):
            for cell in getattr(v, "__closure__", None) or ():
                try:
                    found.append(cell.cell_contents)
                except ValueError:
                    pass
    for v in found:
        if isinstance(v, dict) and v:
            return next(iter(v.values()))
    return found[0] if found else None
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
