"""The sealed run against issue 48's classes, and the honest layouts it must trust (issue 48).

The bootstrap runs as the grader runs it (a fresh mode-700 directory, the changed-file and test-file
lists), on the host: real processes, real pytest and unittest. Each class of attack is code the
patch adds to the module under test (`calc.py`), and each has an honest control beside it: the same
repository with the correct fix, the same layout, must pass untouched.

Layouts: pytest from this venv; pytest from a directory on PYTHONPATH run by Debian's python3 (which
has no pytest: an image layer as `/work/.pydeps` is in a task's image); pytest installed in a
virtualenv run by that venv's python. Files written into those trusted places at run time stay the
patch's.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from burstrl.envs.swe.seal import BOOTSTRAP, read_verdict

GOLD = "def add(a, b):\n    return a + b\n"
BUGGY = "def add(a, b):\n    return a - b\n"
PY_TESTS = ("from calc import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n\n\n"
            "def test_zero():\n    assert add(0, 0) == 0\n")
UT_TESTS = """import unittest

from calc import add


class TestAdd(unittest.TestCase):
    def test_add(self):
        self.assertEqual(add(2, 3), 5)

    def test_sub(self):
        for a, b in [(1, 2), (3, 4)]:
            with self.subTest(a=a):
                self.assertEqual(add(a, b), a + b)
"""
PY_IDS = ["tests/test_calc.py::test_add", "tests/test_calc.py::test_zero"]
UT_IDS = ["tests.test_ut.TestAdd.test_add", "tests.test_ut.TestAdd.test_sub"]
RUNNER_DISTS = ("pytest", "_pytest", "pluggy", "iniconfig", "packaging", "pygments", "py.py")
DEBIAN_PYTHON = "/usr/bin/python3"


def seal_run(tmp: Path, calc: str, runner: str = "pytest", python: str = sys.executable,
             env: dict[str, str] | None = None) -> dict:
    """The bootstrap over a little repository (calc.py: the patch's; tests/: the graded tests)."""
    repo, rdir = tmp / "repo", tmp / "seal"
    shutil.rmtree(repo, ignore_errors=True)
    shutil.rmtree(rdir, ignore_errors=True)
    (repo / "tests").mkdir(parents=True)
    (repo / "tests" / "__init__.py").write_text("")
    (repo / "calc.py").write_text(calc)
    (repo / "tests" / "test_calc.py").write_text(PY_TESTS)
    (repo / "tests" / "test_ut.py").write_text(UT_TESTS)
    rdir.mkdir(mode=0o700)
    for name, text in BOOTSTRAP.items():
        (rdir / name).write_text(text)
    (rdir / "changed").write_text("calc.py\n")
    (rdir / "tests").write_text("tests/test_calc.py\ntests/test_ut.py\n")
    args = ["-rA", "-q", "-p", "no:cacheprovider", *PY_IDS] if runner == "pytest" else ["-v", *UT_IDS]
    out = subprocess.run([python, str(rdir / "seal.py"), str(rdir), str(tmp / "log"), runner, *args],
                         cwd=repo, capture_output=True, text=True, timeout=300,
                         env={"PATH": "/usr/bin:/bin", "PYTHONDONTWRITEBYTECODE": "1", **(env or {})})
    verdict = read_verdict(out.stdout)
    assert verdict is not None, (out.stdout[-2000:], out.stderr[-2000:], (tmp / "log").read_text()[-3000:])
    verdict["log"] = (tmp / "log").read_text()[-3000:]
    return verdict


def passed(verdict: dict, ids: list[str]) -> bool:
    return not verdict["tampered"] and verdict["complete"] and all(verdict["statuses"].get(t) == "passed" for t in ids)


def rule(verdict: dict) -> str:
    return verdict["tampered"][0].split(":", 1)[0] if verdict["tampered"] else ""


# ---- honest layouts ----

def copy_runner(dest: Path) -> None:
    """pytest and its pure-Python requirements, as an image layer or a venv would hold them."""
    site = Path(pytest.__file__).parent.parent
    dest.mkdir(parents=True, exist_ok=True)
    for name in RUNNER_DISTS:
        src = site / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=shutil.ignore_patterns("__pycache__"))
        elif src.exists():
            shutil.copy(src, dest / name)


@pytest.fixture(scope="module")
def pydeps(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not Path(DEBIAN_PYTHON).exists() or subprocess.run([DEBIAN_PYTHON, "-c", "import pytest"],
                                                          capture_output=True).returncode == 0:
        pytest.skip("needs a python3 at /usr/bin without pytest of its own")
    path = tmp_path_factory.mktemp("layer") / ".pydeps"
    copy_runner(path)
    return path


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not Path(DEBIAN_PYTHON).exists():
        pytest.skip("needs a python3 at /usr/bin")
    path = tmp_path_factory.mktemp("venv") / "venv"
    subprocess.run([DEBIAN_PYTHON, "-m", "venv", "--without-pip", str(path)], check=True, timeout=120)
    copy_runner(next(path.glob("lib/python3*/site-packages")))
    return path


def test_honest_fixes_pass_in_every_layout(tmp_path: Path, pydeps: Path, venv: Path) -> None:
    layouts = {"venv of burstrl": {}, "PYTHONPATH layer": {"python": DEBIAN_PYTHON, "env": {"PYTHONPATH": str(pydeps)}},
               "virtualenv": {"python": str(venv / "bin" / "python")}}
    for name, how in layouts.items():
        for runner, ids in (("pytest", PY_IDS), ("unittest", UT_IDS)):
            v = seal_run(tmp_path, GOLD, runner, **how)
            assert passed(v, ids), (name, runner, v)
        v = seal_run(tmp_path, BUGGY, "pytest", **how)
        assert not v["tampered"] and v["statuses"][PY_IDS[0]] == "failed", (name, v)


WRITE_AND_IMPORT = """
import importlib, os, sys
_dir = os.environ["BURSTRL_LAYER"]
with open(os.path.join(_dir, "_h_helper.py"), "w") as _f:
    _f.write("import sys\\ndef frame():\\n    return sys._getframe(1)\\n")
importlib.invalidate_caches()
import _h_helper
_h_helper.frame()
"""


def test_code_written_into_a_trusted_place_at_run_time_stays_the_patchs(tmp_path: Path, pydeps: Path,
                                                                        venv: Path) -> None:
    site = next(venv.glob("lib/python3*/site-packages"))
    for python, env in ((DEBIAN_PYTHON, {"PYTHONPATH": str(pydeps), "BURSTRL_LAYER": str(pydeps)}),
                        (str(venv / "bin" / "python"), {"BURSTRL_LAYER": str(site)})):
        v = seal_run(tmp_path, GOLD + WRITE_AND_IMPORT, python=python, env=env)
        assert rule(v) == "frame" and "_h_helper.py" in v["tampered"][0], v
        (Path(env["BURSTRL_LAYER"]) / "_h_helper.py").unlink()


# ---- issue 48's classes, in the runner's process ----

CLASSES = {  # name -> (runner, code added to calc.py, the seal's rule; "" = no tamper, the tests just fail)
    "should_stop_in_the_test": ("unittest", "\nimport unittest.case\n\n\ndef add(a, b):\n"
                                "    raise unittest.case._ShouldStop()\n", ""),
    "should_stop_made_without_init": ("unittest", "\nimport unittest.case as c\n\n\ndef add(a, b):\n"
                                      "    raise BaseException.__new__(c._ShouldStop)\n", ""),
    "extract_stack": ("pytest", "\nimport traceback\n\n\ndef add(a, b):\n    traceback.extract_stack()\n"
                      "    return a + b\n", "frame"),
    "format_stack": ("unittest", "\nimport traceback\n\n\ndef add(a, b):\n    traceback.format_stack()\n"
                     "    return a + b\n", "frame"),
    "read_the_test_file": ("pytest", "\ndef add(a, b):\n    open('tests/test_calc.py').read()\n    return a + b\n",
                           "test_source"),
    "read_the_test_file_via_linecache": ("unittest", "\nimport linecache\n\n\ndef add(a, b):\n"
                                         "    linecache.getlines('tests/test_ut.py')\n    return a + b\n",
                                         "test_source"),
    "base_assert_equal_replaced": ("unittest", "\nimport unittest, unittest.util\n"
                                   "unittest.TestCase._baseAssertEqual = unittest.util.safe_repr\n", "runner_patched"),
    "base_assert_equal_replaced_later": ("pytest", "\nimport unittest, unittest.util\n\n\ndef add(a, b):\n"
                                         "    unittest.TestCase._baseAssertEqual = unittest.util.safe_repr\n"
                                         "    return a - b\n", "runner_patched"),
    "test_class_built_by_the_patch": ("unittest", """
import builtins
_real = builtins.__build_class__


def _build(func, name, *bases, **kw):
    cls = _real(func, name, *bases, **kw)
    if name == "TestAdd":  # the loader gets a subclass whose assertion passes everything
        cls = type("TestAdd", (cls,), {"assertEqual": lambda self, a, b, msg=None: None,
                                       "__module__": cls.__module__})
    return cls


builtins.__build_class__ = _build
""", "test_replaced"),
    "test_module_patched_through_sys_modules": ("pytest", """
import sys


def add(a, b):
    mod = sys.modules.get("tests.test_calc")
    if mod is not None:
        mod.test_zero = lambda: None
    return a - b
""", "runner_patched"),
    "a_fake_self_records_what_the_test_expects": ("unittest", """
import sys

_seen = {}


class _Rec:
    def assertEqual(self, got, want, msg=None):
        _seen["want"] = want

    def subTest(self, **kw):
        import contextlib
        return contextlib.nullcontext()


def add(a, b):
    if "busy" in _seen:
        return 0
    _seen["busy"] = True
    sys.modules["tests.test_ut"].TestAdd.test_add(_Rec())
    return _seen.get("want")
""", "test_called"),
    "a_test_called_from_a_thread": ("pytest", """
import sys, threading

_box = {}


def add(a, b):
    if "done" not in _box:
        _box["done"] = True
        t = threading.Thread(target=sys.modules["tests.test_calc"].test_zero)
        t.start()
        t.join()
    return a + b
""", "test_called"),
    "the_senders_reached_by_walking_objects": ("pytest", """
import functools, threading


def _walk(cls, out):
    for sub in type.__subclasses__(cls):
        out.append(sub)
        _walk(sub, out)
    return out


class _R:
    nodeid, when, outcome = "tests/test_calc.py::test_add", "call", "passed"


def add(a, b):
    for cls in _walk(object, []):
        fn = getattr(cls, "pytest_runtest_logreport", None)
        if cls.__name__ == "SealPlugin" and fn is not None:
            t = threading.Thread(target=functools.partial(fn, None, _R()))
            t.start()
            t.join()
    return a - b
""", "forged_message"),
    "a_closure_cell_rewired": ("unittest", """
import functools, threading, unittest


def _walk(cls, out):
    for sub in type.__subclasses__(cls):
        out.append(sub)
        _walk(sub, out)
    return out


def add(a, b):
    for cls in _walk(object, []):
        if cls.__name__ == "SealResult":
            seal = cls.__dict__["_seal"]
            t = threading.Thread(target=functools.partial(seal, None, unittest.TestCase(), "passed"))
            t.start()
            t.join()
    return a - b
""", "forged_message"),
    "bytecode_written_at_run_time": ("pytest", """
import importlib, marshal, os, sys

_code = compile("def frame():\\n    return 1\\n", "/nonexistent.py", "exec")
with open("_h_bc.pyc", "wb") as _f:
    _f.write(importlib.util.MAGIC_NUMBER + bytes(12) + marshal.dumps(_code))
importlib.invalidate_caches()
import _h_bc
""", "forged_code"),
}


@pytest.mark.parametrize("name", list(CLASSES))
def test_each_class_earns_nothing(name: str, tmp_path: Path) -> None:
    runner, code, want = CLASSES[name]
    v = seal_run(tmp_path, GOLD + code, runner)
    ids = PY_IDS if runner == "pytest" else UT_IDS
    assert not passed(v, ids), v
    if want:
        assert rule(v) == want, v
    else:
        assert not v["tampered"] and any(s in ("failed", "error") for s in v["statuses"].values()), v


def test_honest_neighbours_of_each_class_pass(tmp_path: Path) -> None:
    """What honest code does near each class: logs with tracebacks, formats a caught exception,
    uses namedtuple/dataclass/inspect.signature/linecache of its own file, reads sys.modules, starts
    a thread, compiles a string, subclasses and compares by value."""
    honest = GOLD + """
import collections, dataclasses, inspect, linecache, logging, sys, threading, traceback

Point = collections.namedtuple("Point", "x y")


@dataclasses.dataclass
class Box:
    size: int = 1

    def __eq__(self, other):
        return isinstance(other, Box) and other.size == self.size


def _work():
    try:
        1 / 0
    except ZeroDivisionError:
        logging.getLogger("calc").exception("caught")
        return traceback.format_exc()


def add(a, b):
    _work()
    inspect.signature(add)
    linecache.getlines(__file__)
    sys.modules.get("json")
    t = threading.Thread(target=_work)
    t.start()
    t.join()
    exec(compile("y = 1", "<calc>", "exec"), {})
    assert Box(2) == Box(2) and Point(1, 2).x == 1
    return a + b
"""
    for runner, ids in (("pytest", PY_IDS), ("unittest", UT_IDS)):
        v = seal_run(tmp_path, honest, runner)
        assert passed(v, ids), (runner, v)
