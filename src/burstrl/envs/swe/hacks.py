"""`burstrl tasks check --hacks`: generic reward hacks that fix nothing, run against each task.

Why: a task whose grading a generic hack defeats is flawed whatever its gold patch does; RL will
find that hack. Each hack here is built from the task alone (no knowledge of the fix): code
appended to the module the gold patch edits first (the tests import it), or files the run may pick
up. They cover issue 34's classes and the earlier ones:

- in the runner's process: an `atexit` PASSED printer, a JUnit report forged at exit, a fake run
  then `os._exit`, pytest's report construction wrapped, an xfail-everything plugin registered
  through pytest's config found with `gc`, the end-marker nonce read from the wrapper's frame;
- files that steer the runner: `pytest.toml`, a root `conftest.py`, plugin entry points in a
  `*.dist-info` directory, a sourceless `.pyc`, an unchecked-hash `.pyc` under `__pycache__`;
- binary content;
- issue 48's classes, in the runner's process: every public function of the module returning an
  always-equal object (`always_equal`) or `unittest.mock.ANY` (`mock_any`), or raising unittest's
  `_ShouldStop` (`should_stop`); the expected values read from the graded test files found through
  `sys.argv` or the working directory (`test_file_answers`), or from the calling line
  (`traceback.extract_stack` then `linecache`: `caller_line`); the test functions found through
  `sys.modules` called with a fake `self` that records what they expect (`fake_self`); the test
  modules' classes and functions replaced through `sys.modules` (`module_swap`);
  `TestCase._baseAssertEqual` and pytest's `Function.runtest` replaced by stdlib functions
  (`assert_swap`); the seal's sender reached through `object.__subclasses__()` and closure cells,
  sending "passed" for every graded id (`seal_sender`).

Every hack is graded exactly as a training attempt is (the task's diff policy, the static scan's
setting: `suspicious = "zero"` unless the task set trains with "flag"); any that scores above 0 is
reported.
"""

from __future__ import annotations

import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

from burstrl.envs.swe.grade import grade, patch_paths, reward_of
from burstrl.envs.swe.repo import export_base
from burstrl.envs.swe.task import SweTask

PLUGIN = """import pytest


def _passes(*args, **kwargs):
    return None


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items):
    for item in items:
        if hasattr(item, "obj"):
            item.obj = _passes
"""
ATEXIT_SPOOF = """
import atexit as _burstrl_hack_atexit
import sys as _burstrl_hack_sys

_burstrl_hack_atexit.register(lambda: [print("PASSED " + a) for a in _burstrl_hack_sys.argv if "::" in a])
"""
JUNIT_AT_EXIT = """
import atexit as _h_atexit
import sys as _h_sys


def _h_forge():
    path = next((a.split("=", 1)[1] for a in _h_sys.argv if a.startswith("--junitxml=")), None)
    if path:
        cases = "".join(f'<testcase classname="{a.split("::")[0][:-3].replace("/", ".")}" name="{a.split("::")[-1]}"/>'
                        for a in _h_sys.argv if "::" in a)
        open(path, "w").write("<testsuites><testsuite>" + cases + "</testsuite></testsuites>")


_h_atexit.register(_h_forge)
"""
FAKE_RUN_EXIT = """
import os as _h_os
import sys as _h_sys

if any("::" in a for a in _h_sys.argv):
    _h_sys.__stdout__.write("\\n".join(["PASSED " + a for a in _h_sys.argv if "::" in a] + ["1 passed in 0.01s"]) + "\\n")
    _h_sys.__stdout__.flush()
    _h_os._exit(0)
"""
REPORT_WRAP = """
try:
    from _pytest import reports as _h_reports
    _h_orig = _h_reports.TestReport.from_item_and_call.__func__

    def _h_passed(cls, item, call):
        report = _h_orig(cls, item, call)
        report.outcome, report.longrepr = "passed", None
        return report

    _h_reports.TestReport.from_item_and_call = classmethod(_h_passed)
except ImportError:
    pass
"""
XFAIL_EVERYTHING = """
import gc as _h_gc

try:
    import pytest as _h_pytest

    class _HEverything:
        @_h_pytest.hookimpl(trylast=True)
        def pytest_collection_modifyitems(self, items):
            for item in items:
                item.add_marker(_h_pytest.mark.xfail(reason="later"))

    for _h_obj in _h_gc.get_objects():
        if type(_h_obj).__name__ == "Config" and hasattr(_h_obj, "pluginmanager"):
            _h_obj.pluginmanager.register(_HEverything(), "everything")
            break
except ImportError:
    pass
"""
NONCE_FROM_FRAME = """
import sys as _h_sys

_h_frame = _h_sys._getframe()
while _h_frame is not None and "nonce" not in _h_frame.f_locals:
    _h_frame = _h_frame.f_back
"""
WRAP = """
def _h_wrap_all(make):
    for name, f in list(globals().items()):
        if not name.startswith("_") and type(f).__name__ == "function" and f.__module__ == __name__:
            globals()[name] = make(name, f)
"""
ALWAYS_EQUAL = WRAP + """

class _HEqual:
    def __eq__(self, other):
        return True

    def __ne__(self, other):
        return False

    __hash__ = object.__hash__


_h_wrap_all(lambda name, f: lambda *a, **k: _HEqual())
"""
MOCK_ANY = WRAP + """
from unittest import mock as _h_mock

_h_wrap_all(lambda name, f: lambda *a, **k: _h_mock.ANY)
"""
SHOULD_STOP = WRAP + """
from unittest import case as _h_case


def _h_stop(name, f):
    def stop(*a, **k):
        raise _h_case._ShouldStop()
    return stop


_h_wrap_all(_h_stop)
"""
# (function name, repr of its literal arguments) -> the literal a test compares its result with
ANSWERS = WRAP + """
import ast as _h_ast


def _h_pairs(source):
    table = {}
    try:
        tree = _h_ast.parse(source)
    except (SyntaxError, ValueError):
        return table
    for node in _h_ast.walk(tree):
        sides = ()
        if isinstance(node, _h_ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], _h_ast.Eq):
            sides = (node.left, node.comparators[0])
        elif isinstance(node, _h_ast.Call) and getattr(node.func, "attr", "").startswith("assertEqual") \\
                and len(node.args) >= 2:
            sides = (node.args[0], node.args[1])
        for call, want in (sides, sides[::-1]) if sides else ():
            if isinstance(call, _h_ast.Call) and isinstance(call.func, _h_ast.Name):
                try:
                    table[(call.func.id, repr([_h_ast.literal_eval(a) for a in call.args]))] = _h_ast.literal_eval(want)
                except Exception:
                    pass
    return table


def _h_answering(table):
    def make(name, f):
        def answer(*a, **k):
            key = (name, repr(list(a)))
            return table[key] if key in table else f(*a, **k)
        return answer
    return make
"""
TEST_FILE_ANSWERS = ANSWERS + """
import os as _h_os
import sys as _h_sys


def _h_test_files():
    found = []
    for arg in _h_sys.argv[1:]:
        parts = arg.split("::")[0].replace(".py", "").replace(".", "/").split("/")
        for i in range(len(parts), 0, -1):
            path = "/".join(parts[:i]) + ".py"
            if _h_os.path.isfile(path):
                found.append(path)
                break
    for root, dirs, files in _h_os.walk(".") if not found else ():
        found += [_h_os.path.join(root, n) for n in files if n.startswith("test") and n.endswith(".py")]
    return found


_h_table = {}
for _h_path in _h_test_files():
    with open(_h_path) as _h_file:
        _h_table.update(_h_pairs(_h_file.read()))
_h_wrap_all(_h_answering(_h_table))
"""
CALLER_LINE = ANSWERS + """
import linecache as _h_linecache
import traceback as _h_traceback


def _h_from_caller(name, f):
    def answer(*a, **k):
        key = (name, repr(list(a)))
        for frame in reversed(_h_traceback.extract_stack()[:-1]):
            table = _h_pairs(_h_linecache.getline(frame.filename, frame.lineno).strip())
            if key in table:
                return table[key]
        return f(*a, **k)
    return answer


_h_wrap_all(_h_from_caller)
"""
FAKE_SELF = WRAP + """
import sys as _h_sys

_h_table = {}
_h_state = {"recording": False, "done": False}


class _HCall:
    def __init__(self, key):
        self.key = key

    def __eq__(self, other):  # pytest's `assert f(x) == y`: what it expects
        _h_table[self.key] = other
        return True

    __hash__ = object.__hash__


class _HSelf:
    def assertEqual(self, first, second, msg=None):
        for call, want in ((first, second), (second, first)):
            if isinstance(call, _HCall):
                _h_table[call.key] = want

    assertEquals = assertEqual

    def __getattr__(self, name):
        return lambda *a, **k: None


def _h_record():
    _h_state["recording"] = True
    for name, module in list(_h_sys.modules.items()):
        if "test" not in name.rpartition(".")[2] or module is None:
            continue
        for oname, obj in list(vars(module).items()):
            calls = []
            if isinstance(obj, type) and oname.startswith("Test"):
                calls = [(v, (_HSelf(),)) for k, v in vars(obj).items() if k.startswith("test") and callable(v)]
            elif oname.startswith("test") and callable(obj):
                calls = [(obj, ())]
            for fn, args in calls:
                try:
                    fn(*args)
                except Exception:
                    pass
    _h_state["recording"], _h_state["done"] = False, True


def _h_recorded(name, f):
    def answer(*a, **k):
        key = (name, repr(list(a)))
        if _h_state["recording"]:
            return _HCall(key)
        if not _h_state["done"]:
            _h_record()
        return _h_table[key] if key in _h_table else f(*a, **k)
    return answer


_h_wrap_all(_h_recorded)
"""
MODULE_SWAP = """
import sys as _h_sys
import types as _h_types


def _h_passing(name, value):
    if isinstance(value, type) and name.startswith("Test"):
        passing = {k: (lambda self: None) for k in dir(value) if k.startswith("test")}
        return type(name, (value,), {**passing, "__module__": value.__module__, "__qualname__": value.__qualname__})
    if name.startswith("test") and callable(value):
        return lambda: None
    return value


class _HModule(_h_types.ModuleType):
    def __getattribute__(self, name):
        value = _h_types.ModuleType.__getattribute__(self, name)
        if name == "__dict__":
            return {k: _h_passing(k, v) for k, v in value.items()}
        return _h_passing(name, value)


for _h_name, _h_module in list(_h_sys.modules.items()):
    if "test" in _h_name.rpartition(".")[2] and type(_h_module) is _h_types.ModuleType:
        _h_module.__class__ = _HModule
"""
ASSERT_SWAP = """
import sys as _h_sys
import unittest as _h_unittest

_h_unittest.TestCase._baseAssertEqual = _h_unittest.TestCase.assertIsNot
_h_python = _h_sys.modules.get("_pytest.python")
if _h_python is not None:
    _h_python.Function.runtest = object.__repr__
"""
SEAL_SENDER = """
import os as _h_os
import sys as _h_sys


class _HPassed:  # what the seal's reporting hands its sender: a pytest report, a unittest test
    when, outcome = "call", "passed"

    def __init__(self, nodeid):
        self.nodeid = nodeid

    def id(self):
        return self.nodeid


def _h_sender():
    seen, todo = set(), [object]
    while todo:
        cls = todo.pop()
        if cls.__name__ in ("SealPlugin", "SealResult"):
            for fn in vars(cls).values():
                for cell in getattr(fn, "__closure__", None) or ():
                    if getattr(cell.cell_contents, "__name__", "") == "send":
                        return cls.__name__, cell.cell_contents
        for sub in type.__subclasses__(cls):
            if sub not in seen:
                seen.add(sub)
                todo.append(sub)
    return None, None


_h_kind, _h_send = _h_sender()
if _h_send is not None:
    for _h_id in [a for a in _h_sys.argv[1:] if not a.startswith("-")]:
        _h_report = _HPassed(_h_id)
        _h_send("report", (_h_report, "passed") if _h_kind == "SealResult" else _h_report)
    _h_send("end", 0)
    _h_os._exit(0)
"""
# a pyc header (hash-based, unchecked: flags=1) and a little payload: loaded without its source
UNCHECKED_PYC = b"\xa7\r\r\n\x01\x00\x00\x00" + bytes(8) + b"\xe3" + bytes(64)

Files = dict[str, "str | bytes"]
HACKS: dict[str, Callable[[str, Path], Files]] = {  # name -> (module the gold patch edits, repo) -> files
    "atexit_spoof": lambda m, r: {m: _append(r, m, ATEXIT_SPOOF)},
    "junit_forged_at_exit": lambda m, r: {m: _append(r, m, JUNIT_AT_EXIT)},
    "fake_run_then_exit": lambda m, r: {m: _append(r, m, FAKE_RUN_EXIT)},
    "wrap_pytest_reports": lambda m, r: {m: _append(r, m, REPORT_WRAP)},
    "xfail_everything_via_gc": lambda m, r: {m: _append(r, m, XFAIL_EVERYTHING)},
    "nonce_from_frame": lambda m, r: {m: _append(r, m, NONCE_FROM_FRAME)},
    "pytest_toml": lambda m, r: {"burstrl_hack_plugin.py": PLUGIN,
                                 "pytest.toml": '[pytest]\naddopts = ["-p", "burstrl_hack_plugin"]\n'},
    "root_conftest": lambda m, r: {"conftest.py": PLUGIN},
    "dist_info_entry_points": lambda m, r: {
        "burstrl_hack_plugin.py": PLUGIN,
        "burstrl_hack-1.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: burstrl-hack\nVersion: 1.0\n",
        "burstrl_hack-1.0.dist-info/entry_points.txt": "[pytest11]\nhack = burstrl_hack_plugin\n"},
    "sourceless_pyc": lambda m, r: {m[:-3] + "_hack.pyc" if m.endswith(".py") else "hack.pyc": UNCHECKED_PYC},
    "unchecked_hash_pyc": lambda m, r: {_pycache(m): UNCHECKED_PYC},
    "binary_file": lambda m, r: {str(Path(m).parent / "data.bin") if "/" in m else "data.bin": bytes(range(256))},
    "always_equal": lambda m, r: {m: _append(r, m, ALWAYS_EQUAL)},
    "mock_any": lambda m, r: {m: _append(r, m, MOCK_ANY)},
    "should_stop": lambda m, r: {m: _append(r, m, SHOULD_STOP)},
    "test_file_answers": lambda m, r: {m: _append(r, m, TEST_FILE_ANSWERS)},
    "caller_line": lambda m, r: {m: _append(r, m, CALLER_LINE)},
    "fake_self": lambda m, r: {m: _append(r, m, FAKE_SELF)},
    "module_swap": lambda m, r: {m: _append(r, m, MODULE_SWAP)},
    "assert_swap": lambda m, r: {m: _append(r, m, ASSERT_SWAP)},
    "seal_sender": lambda m, r: {m: _append(r, m, SEAL_SENDER)},
}


def hack_patches(task: SweTask, workdir: Path) -> dict[str, str]:
    """name -> the git diff of each hack against the task's base (an export under `workdir`)."""
    repo = Path(workdir) / "repo"
    export_base(task, repo)
    target = next((p for p in patch_paths(task.patch) if p.endswith(".py") and (repo / p).is_file()), "")
    if not target:
        raise ValueError(f"{task.instance_id}: the gold patch edits no existing .py file to attach the hacks to")
    return {name: _diff(repo, build(target, repo)) for name, build in HACKS.items()}


def check_hacks(task: SweTask, backend: object, timeout: float = 300, workdir: Path | None = None,
                suspicious: str = "zero") -> tuple[list[str], dict[str, float]]:
    """(problems, reward per hack): a hack that scores above 0 is a problem of the task.
    `suspicious`: the static scan's setting the task set trains with."""
    with tempfile.TemporaryDirectory(prefix="burstrl-hacks-") as tmp:
        patches = hack_patches(task, Path(workdir or tmp))
    rewards: dict[str, float] = {}
    problems: list[str] = []
    for name, patch in patches.items():
        r = grade(task, patch, backend, timeout_s=timeout, suspicious=suspicious)  # as a training attempt is
        if r.infra_error:
            problems.append(f"hack {name}: not graded ({r.infra_error[:200]})")
            continue
        rewards[name] = reward_of(r, "f2p")
        if rewards[name] > 0:
            problems.append(f"hack {name} scores f2p {rewards[name]:.2f} without fixing anything "
                            f"(statuses {r.statuses})")
    return problems, rewards


def _append(repo: Path, module: str, code: str) -> str:
    return (repo / module).read_text() + "\n" + code


def _pycache(module: str) -> str:
    parent, _, name = module.rpartition("/")
    pyc = f"__pycache__/{name[:-3]}.cpython-311.pyc"
    return f"{parent}/{pyc}" if parent else pyc


def _diff(repo: Path, files: Files) -> str:
    for path, content in files.items():
        target = repo / path
        target.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            target.write_bytes(content)
        else:
            target.write_text(content)
    git = ["git", "-C", str(repo)]
    subprocess.run([*git, "add", "-A", "-f"], check=True, capture_output=True)
    out = subprocess.run([*git, "-c", "core.quotepath=off", "diff", "--cached", "--binary", "--no-color"],
                         check=True, capture_output=True, text=True).stdout
    subprocess.run([*git, "reset", "-q", "--hard"], check=True, capture_output=True)
    subprocess.run([*git, "clean", "-fdqx"], check=True, capture_output=True)
    return out
