"""The sealed test run (issue 34): code under test cannot forge what the runner reports.

Two levels. Through the real grader in real sandboxes, on the fixture repositories of
test_reward_hacks.py, with the static scan only flagging (as `burstrl eval` grades) so that the seal
alone stands between each hack and a reward: issue 34's class 1 (code in the runner's process
rewriting what it reports) and forged messages on the results pipe. And the bootstrap run directly
(real processes, this venv's pytest) against the primitives a forgery needs, one named test each,
plus honest code that uses their harmless neighbours (logging, namedtuple, dataclasses, inspect,
multiprocessing's shared values, tracebacks) and must not trip it.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from burstrl.envs.swe.diffpolicy import DiffPolicy
from burstrl.envs.swe.grade import grade, reward_of
from burstrl.envs.swe.hacks import FAKE_RUN_EXIT, JUNIT_AT_EXIT, NONCE_FROM_FRAME, REPORT_WRAP, XFAIL_EVERYTHING
from burstrl.envs.swe.seal import BOOTSTRAP, TAG, judge, read_verdict, seal_off, sealed_command
from burstrl.envs.swe.task import SweTask
from burstrl.sandbox.pool import SandboxPool
from tests.security import test_reward_hacks as reward_hacks
from tests.security.test_reward_hacks import CALC, GOLD_CALC, PY_FAKE_RUN, patch_of

HONEST = GOLD_CALC + """
import collections
import dataclasses
import inspect
import logging
import multiprocessing
import traceback

logging.getLogger("calc").warning("loaded")
Point = collections.namedtuple("Point", "x y")


@dataclasses.dataclass
class Box:
    size: int = 1


Box()
inspect.signature(add)
multiprocessing.Value("i", 1)
try:
    1 / 0
except ZeroDivisionError:
    traceback.format_exc()
"""


@pytest.fixture(scope="module")
def pool():
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap (bwrap) is not installed: `make system-deps` as root")
    with SandboxPool("namespace", max_concurrent=6) as p:
        yield p


ut, py = reward_hacks.ut, reward_hacks.py  # the same fixture repositories (a pytest and a unittest task)


# ---- through the grader ----

def test_honest_patches_grade_sealed_as_before(ut: SweTask, py: SweTask, pool: SandboxPool) -> None:
    for task in (ut, py):
        gold = grade(task, task.patch, pool, timeout_s=60)
        assert gold.sealed and not gold.seal_off and gold.resolved and not gold.tampered, (gold.reason, gold.log[-1500:])
        honest = grade(task, patch_of(Path(task.repo), {"calc.py": HONEST}), pool, timeout_s=60)
        assert honest.sealed and honest.resolved and not honest.tampered, (honest.reason, honest.log[-1500:])
        partial = grade(task, "", pool, timeout_s=60)
        assert partial.sealed and not partial.resolved and not partial.reason and partial.p2p_failed == 0
        assert partial.statuses[task.PASS_TO_PASS[0]] == "passed" and partial.statuses[task.FAIL_TO_PASS[0]] == "failed"


CLASS_1 = {  # name -> (task, code appended to calc.py, the seal's rule; "" = not tampered, just no credit)
    "wrap_pytest_reports": ("py", REPORT_WRAP, "runner_patched"),
    "xfail_everything_via_gc": ("py", XFAIL_EVERYTHING, "gc"),
    "read_the_wrappers_frame": ("ut", NONCE_FROM_FRAME, "frame"),
    "rewrite_the_report_at_exit": ("py", JUNIT_AT_EXIT, ""),
    "fake_run_then_exit": ("py", FAKE_RUN_EXIT, ""),
    "write_results_on_every_pipe": ("py", PY_FAKE_RUN.removeprefix(CALC), "forged_message"),
    "patch_unittest_run": ("ut", "\nimport unittest\nunittest.TestCase.run = lambda self, result=None: None\n",
                           "runner_patched"),
}


@pytest.mark.parametrize("hack", list(CLASS_1))
def test_code_in_the_runners_process_cannot_forge_a_pass(hack: str, ut: SweTask, py: SweTask,
                                                         pool: SandboxPool) -> None:
    which, code, rule = CLASS_1[hack]
    task = {"ut": ut, "py": py}[which]
    # the diff policy's introspection rules lifted (`*:*`): the seal alone stands between hack and reward
    r = grade(task, patch_of(Path(task.repo), {"calc.py": CALC + "\n" + code}), pool, timeout_s=60,
              policy=DiffPolicy(allow=("*:*",)))
    assert r.sealed and not r.infra_error and not r.resolved, (r.reason, r.statuses, r.log[-1500:])
    assert [reward_of(r, k) for k in ("binary", "f2p", "strict")] == [0.0, 0.0, 0.0]
    if rule:
        assert r.reason.startswith(f"tampered: sealed run {rule}: "), (r.reason, r.log[-1500:])
    else:  # an exit handler never runs and a fake run is never read: the failing test just fails
        assert not r.tampered and "PASSED tests/test_calc.py::test_add" not in r.log.split("short test summary")[-1]


def test_a_task_can_turn_the_seal_off_and_the_runners_own_code_is_never_sealed(py: SweTask, pool: SandboxPool) -> None:
    r = grade(py, py.patch, pool, timeout_s=60, seal=False)
    assert r.resolved and not r.sealed and "turned off" in r.seal_off
    assert seal_off(py.test_cmd, ["_pytest/runner.py"], frozenset({"_pytest/runner.py"})).startswith(
        "the patch changes the test runner's own code")
    assert seal_off(py.test_cmd, ["pkg/_pytest/x.py"], frozenset()) == ""  # a new file cannot turn it off
    assert seal_off("cd sub && python3 -m pytest", [], frozenset()).startswith("the test command")
    assert seal_off("python3 -m pytest -n 4", [], frozenset()).startswith("the test command")


def test_the_sealed_command_and_verdict() -> None:
    assert sealed_command("A=1 python3 -m pytest -q", "/tmp/d", "/tmp/l") == \
        "A=1 python3 /tmp/d/seal.py /tmp/d /tmp/l pytest -q"
    assert sealed_command("python -m unittest -v", "/d", "/l") == "python /d/seal.py /d /l unittest -v"
    assert sealed_command("pytest -q", "/d", "/l") is None and sealed_command("python3 -m pytest -n2", "/d", "/l") is None
    line = TAG + json.dumps({"statuses": {"a.py::t": "passed"}, "tampered": ["gc: gc.get_objects (from x:1)"],
                             "complete": False})
    verdict = read_verdict("noise\n" + line + "\n")
    assert judge(verdict, ["a.py::t", "b.py::u"]) == (
        {"a.py::t": "passed", "b.py::u": "missing"}, "sealed run gc: gc.get_objects (from x:1)", False)
    assert read_verdict("burstrl-seal {not json") is None
    assert judge(None, ["t"]) == ({"t": "missing"}, "", False)


# ---- the bootstrap alone: each primitive a forgery needs ----

TESTS = "from calc import add, mul\n\n\ndef test_add():\n    assert add(2, 3) == 5\n\n\ndef test_mul():\n" \
        "    assert mul(2, 3) == 6\n"
IDS = ["tests/test_calc.py::test_add", "tests/test_calc.py::test_mul"]


def sealed(tmp: Path, calc: str, runner: str = "pytest") -> dict:
    """Run the bootstrap as the grader does (a fresh mode-700 directory, the changed-file list)."""
    repo, rdir = tmp / "repo", tmp / "seal"
    (repo / "tests").mkdir(parents=True)
    (repo / "calc.py").write_text(calc)
    (repo / "tests" / "test_calc.py").write_text(TESTS)
    rdir.mkdir(mode=0o700)
    for name, text in BOOTSTRAP.items():
        (rdir / name).write_text(text)
    (rdir / "changed").write_text("calc.py\n")
    (rdir / "tests").write_text("tests/test_calc.py\n")
    args = ["-rA", "-q", "-p", "no:cacheprovider", *IDS]
    out = subprocess.run([sys.executable, str(rdir / "seal.py"), str(rdir), str(tmp / "log"), runner, *args],
                         cwd=repo, capture_output=True, text=True, timeout=300,
                         env={"PATH": "/usr/bin:/bin", "PYTHONDONTWRITEBYTECODE": "1"})
    verdict = read_verdict(out.stdout)
    assert verdict is not None, (out.stdout[-2000:], out.stderr[-2000:])
    return verdict


PRIMITIVES = {  # name -> (code the patch adds to calc.py, the rule that must end the run)
    "proc_self_cmdline": ("open('/proc/self/cmdline').read()\n", "proc_self"),
    "proc_self_through_pathlib": ("import pathlib\npathlib.Path('/proc/self/environ').read_bytes()\n", "proc_self"),
    "proc_self_fds": ("import os\nos.listdir('/proc/self/fd')\n", "proc_self"),
    "ctypes_imported": ("import ctypes\n", "ctypes"),
    "ctypes_memory_read": ("import multiprocessing.sharedctypes as s\ns.ctypes.string_at(id(add), 8)\n", "ctypes"),
    "code_claiming_the_stdlib": ("import os\nexec(compile('x = 1', os.__file__, 'exec'))\n", "forged_code"),
    "code_object_rebuilt": ("import os\n(lambda: 0).__code__.replace(co_filename=os.__file__)\n", "forged_code"),
    "unmarshalled_code": ("import marshal\nmarshal.loads(marshal.dumps(1))\n", "forged_code"),
    "code_swapped": ("def _f():\n    pass\n\n\n_f.__code__ = (lambda: 1).__code__\n", "code_swap"),
    "runner_class_patched": ("import _pytest.python\n_pytest.python.Function.runtest = lambda self: None\n",
                             "runner_patched"),
    "seal_plugin_patched": ("import __main__\n__main__._pytest_plugin = None\n", "runner_patched"),
    "inspect_stack": ("import inspect\ninspect.stack()\n", "frame"),
    "traceback_frame": ("try:\n    1 / 0\nexcept ZeroDivisionError as e:\n    e.__traceback__.tb_frame\n", "frame"),
    "generator_frame": ("def _g():\n    yield 1\n\n\n_g().gi_frame\n", "frame"),
    "heap_referrers": ("import gc\ngc.get_referrers(add)\n", "gc"),
    "profile_through_threading": ("import threading\nthreading.setprofile(lambda *a: None)\n"
                                  "t = threading.Thread(target=print)\nt.start()\nt.join()\n", "tracing"),
    "trace_hook": ("import sys\nsys.settrace(None)\n", "tracing"),
    "another_audit_hook": ("import sys\nsys.addaudithook(lambda *a: None)\n", "audit_hook"),
}


@pytest.mark.parametrize("name", list(PRIMITIVES))
def test_a_forgerys_primitive_ends_the_run_as_tampered(name: str, tmp_path: Path) -> None:
    code, rule = PRIMITIVES[name]
    verdict = sealed(tmp_path, CALC + "\n" + code)
    assert verdict["hook"] and not verdict["complete"] and verdict["statuses"] == {}, verdict
    assert verdict["tampered"][0].startswith(rule + ": "), verdict
    assert rule == "runner_patched" or "calc.py" in verdict["tampered"][0], verdict  # where the primitive was used


def test_the_bootstrap_reports_honest_code_as_the_runner_saw_it(tmp_path: Path) -> None:
    verdict = sealed(tmp_path, HONEST.replace("a + b", "a - b"))
    assert verdict["complete"] and verdict["tampered"] == [] and verdict["exit"] == 1, verdict
    assert verdict["statuses"] == {IDS[0]: "failed", IDS[1]: "passed"}


def test_a_subprocess_cannot_read_the_test_process_memory_or_fds(py: SweTask, pool: SandboxPool) -> None:
    """Processes the tests start run without the hook; the test process is non-dumpable, so one of
    the same user cannot read its memory (where the key lives) or reopen its fds (the pipe)."""
    code = ("\nimport os, subprocess\n"
            "_mem = subprocess.run(['head', '-c', '64', '/proc/%d/mem' % os.getpid()], capture_output=True)\n"
            "_fds = subprocess.run(['ls', '/proc/%d/fd' % os.getpid()], capture_output=True)\n"
            "if _mem.returncode == 0 or _fds.returncode == 0:  # read: the target test fails\n"
            "    def add(a, b):\n        return 0\n")
    r = grade(py, patch_of(Path(py.repo), {"calc.py": GOLD_CALC + code}), pool, timeout_s=60)
    assert r.sealed and r.resolved and not r.tampered, (r.reason, r.statuses, r.log[-1500:])  # both were denied
