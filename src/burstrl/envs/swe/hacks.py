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
- binary content.

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
