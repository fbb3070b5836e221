"""Real SWE tasks from real upstream bug fixes, and the test-runner layouts real task sets use.

Why: the grader's seal was once proven only on toy repositories run by the sandbox image's own
pytest, and it then called every honest gold fix on real repositories `tampered` as soon as pytest
came from `PYTHONPATH` or a virtualenv (issue 48). These tasks are what a user builds: the older
release's sdist (source and tests) is the base commit, the newer release's diff restricted to one
bug fix named in its changelog is the gold `patch`, that fix's new tests are the `test_patch`.

Sdists come from PyPI through pip (`pip download --no-deps --no-binary :all:`) the first time and
are kept under `$BURSTRL_CACHE/sdists` (default `~/.cache/burstrl/sdists`), so later runs are
offline. `SdistUnavailable` says why one could not be had (tests skip with that reason).

The layouts (`LAYOUTS`; `pydeps_image`, `venv_image`) put pytest where task images put it:
- "pydeps": on `PYTHONPATH` from an image layer at `/work/.pydeps` (an image without
  `/usr/bin/python3`: the sandbox runs on the host's system dirs, and only the image's `/work` is
  used, seeded into the sandbox's own writable `/work`);
- "venv": in a virtualenv at `/opt/venv` on top of `burstrl image base` (an image WITH
  `/usr/bin/python3` is the sandbox's whole root, read-only; a layer outside `/work` on an image
  without a Python would not be mounted at all);
- "workvenv": a virtualenv in a layer at `/work/.venv` (writable, like "pydeps"): where a patch
  can write into the interpreter's own site-packages while the tests run.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

from burstrl.envs.swe.repo import commit_all, git, init_repo
from burstrl.envs.swe.task import SweTask

PYTEST = "python3 -m pytest -rA -q -p no:cacheprovider"
PYDEPS = "/work/.pydeps"
VENV = "/opt/venv"
WORK_VENV = "/work/.venv"
# layout -> (the interpreter of the test command, what it puts on PYTHONPATH)
LAYOUTS = {
    "pydeps": ("python3", PYDEPS),  # pytest from an image layer on PYTHONPATH, the host's python3
    "venv": (f"{VENV}/bin/python", ""),  # a virtualenv in the image's read-only root (on `image base`)
    "workvenv": (f"{WORK_VENV}/bin/python", ""),  # a virtualenv in an image layer under /work (writable)
}


class SdistUnavailable(RuntimeError):
    """An sdist that is neither cached nor downloadable here (no network, no pip)."""


@dataclass(frozen=True)
class Hunks:
    """The hunks of one file's diff between the two releases that belong to the fix: those whose
    text holds one of `include` (all hunks when empty) and none of `exclude`."""

    path: str
    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()

    def keeps(self, hunk: str) -> bool:
        return (not self.include or any(m in hunk for m in self.include)) and not any(m in hunk for m in self.exclude)


@dataclass(frozen=True)
class RealFix:
    """One upstream bug fix between two consecutive releases, as a task."""

    instance_id: str
    dist: str  # the PyPI name
    base: str  # the release with the bug
    fixed: str  # the next release, which fixes it
    changelog: str  # the fixed release's changelog entry for it
    source: tuple[Hunks, ...]  # library files: the gold patch
    tests: tuple[Hunks, ...]  # test files: the test patch
    FAIL_TO_PASS: tuple[str, ...]
    PASS_TO_PASS: tuple[str, ...]
    pythonpath: str = ""  # the repository's own import root when it is not the root ("src")


FIXES: tuple[RealFix, ...] = (
    RealFix(
        instance_id="more-itertools-11.1.0-numeric-range-reversed",
        dist="more-itertools", base="11.0.2", fixed="11.1.0",
        changelog="numeric_range was updated to fix its handling of empty ranges",
        source=(Hunks("more_itertools/more.py", include=("# Empty iterator",)),),
        tests=(Hunks("tests/test_more.py", include=("def test_empty_reversed",)),),
        FAIL_TO_PASS=("tests/test_more.py::NumericRangeTests::test_empty_reversed",),
        PASS_TO_PASS=tuple(f"tests/test_more.py::NumericRangeTests::{t}"
                           for t in ("test_basic", "test_reversed", "test_len", "test_get_item_by_slice", "test_pickle")),
    ),
    RealFix(
        instance_id="boltons-26.1.0-singularize-double-s",
        dist="boltons", base="26.0.0", fixed="26.1.0",
        changelog="Fixed strutils.singularize mangling words ending in 'ss'",
        source=(Hunks("boltons/strutils.py", include=("word.endswith('ss')",)),),
        tests=(Hunks("tests/test_strutils.py", include=("def test_singularize_double_s",)),),
        FAIL_TO_PASS=("tests/test_strutils.py::test_singularize_double_s",),
        PASS_TO_PASS=tuple(f"tests/test_strutils.py::{t}"
                           for t in ("test_asciify", "test_indent", "test_is_uuid", "test_bytes2human", "test_roundzip")),
    ),
    RealFix(
        instance_id="cachetools-7.3.1-lfu-copy",
        dist="cachetools", base="7.3.0", fixed="7.3.1",
        changelog="Fix deep-copying and pickling LFUCache instances with many different use counts; "
                  "fix shallow copies of caches sharing internal state with the original",
        source=(Hunks("src/cachetools/__init__.py", exclude=("__version__",)),),
        tests=(Hunks("tests/__init__.py"), Hunks("tests/test_lfu.py")),
        FAIL_TO_PASS=tuple(f"tests/test_lfu.py::LFUCacheTest::{t}"
                           for t in ("test_lfu_copy_use_counts", "test_copy")),
        PASS_TO_PASS=tuple(f"tests/test_lfu.py::LFUCacheTest::{t}"
                           for t in ("test_lfu", "test_lfu_tie", "test_pickle", "test_pickle_maxsize", "test_popitem")),
        pythonpath="src",
    ),
)


def cache_dir() -> Path:
    """Where sdists are kept: `$BURSTRL_CACHE/sdists`, else `~/.cache/burstrl/sdists`."""
    return Path(os.environ.get("BURSTRL_CACHE") or Path.home() / ".cache" / "burstrl") / "sdists"


def sdist(dist: str, version: str) -> Path:
    """The sdist tarball of `dist==version`: cached, else downloaded once with pip."""
    where = cache_dir() / f"{dist}-{version}"
    found = sorted(where.glob("*.tar.gz"))
    if found:
        return found[0]
    with tempfile.TemporaryDirectory(prefix="burstrl-sdist-") as tmp:
        proc = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                               "-d", tmp, f"{dist}=={version}"], capture_output=True, text=True, timeout=300)
        got = sorted(Path(tmp).glob("*.tar.gz"))
        if proc.returncode != 0 or not got:
            raise SdistUnavailable(f"pip could not download the sdist of {dist}=={version}: "
                                   f"{(proc.stderr or proc.stdout).strip()[-500:]}")
        where.mkdir(parents=True, exist_ok=True)
        part = where / (got[0].name + ".part")
        shutil.copyfile(got[0], part)
        os.replace(part, where / got[0].name)  # a killed copy never looks cached
    return where / got[0].name


def unpack(tarball: Path, dest: Path) -> Path:
    """The sdist's tree (its single top directory stripped) at `dest`, without packaging metadata
    (`*.egg-info`, `PKG-INFO`: build outputs, not source)."""
    with tempfile.TemporaryDirectory(prefix="burstrl-unpack-") as tmp, tarfile.open(tarball) as tar:
        tar.extractall(tmp, filter="data")
        (top,) = Path(tmp).iterdir()
        shutil.copytree(top, dest)
    for junk in [*dest.rglob("*.egg-info"), dest / "PKG-INFO"]:
        if junk.is_dir():
            shutil.rmtree(junk)
        elif junk.exists():
            junk.unlink()
    return dest


def _hunks(old: Path, new: Path, path: str) -> tuple[str, list[str]]:
    """(header, hunks) of the diff of one file between two trees, with a/ b/ paths."""
    proc = subprocess.run(["git", "diff", "--no-index", "--no-color", "--no-ext-diff", "--", str(old), str(new)],
                          capture_output=True, text=True)
    if proc.returncode not in (0, 1):
        raise RuntimeError(f"git diff of {path} failed: {proc.stderr.strip()}")
    parts = re.split(r"(?m)^(?=@@ )", proc.stdout)
    header = f"diff --git a/{path} b/{path}\n--- a/{path}\n+++ b/{path}\n"
    return header, parts[1:]


def fix_patch(repo: Path, old_tree: Path, new_tree: Path, files: tuple[Hunks, ...]) -> str:
    """The diff of `files` from the older release to the newer, restricted to the fix's hunks, as
    git writes it against `repo`'s HEAD (applied there, diffed, then the tree reset)."""
    pieces = []
    for spec in files:
        header, hunks = _hunks(old_tree / spec.path, new_tree / spec.path, spec.path)
        kept = [h for h in hunks if spec.keeps(h)]
        if not kept:
            raise RuntimeError(f"no hunk of {spec.path} matches {spec}")
        pieces.append(header + "".join(kept))
    git(repo, "apply", "--whitespace=nowarn", "-", input="".join(pieces).encode())
    patch = git(repo, "diff", "--no-color", "--no-ext-diff").decode()
    git(repo, "checkout", "-q", "--", ".")
    return patch


def build_task(fix: RealFix, root: Path) -> SweTask:
    """`fix` as a task whose repository (a git repo under `root`) is the older release's sdist;
    `test_cmd` is the plain host-independent `python3 -m pytest` (see `for_layout`)."""
    old = unpack(sdist(fix.dist, fix.base), root / f"{fix.instance_id}-old")
    new = unpack(sdist(fix.dist, fix.fixed), root / f"{fix.instance_id}-new")
    repo = root / fix.instance_id
    shutil.copytree(old, repo)
    init_repo(repo)
    base = commit_all(repo, f"{fix.dist} {fix.base}")
    return SweTask(
        instance_id=fix.instance_id, repo=str(repo), base_commit=base,
        problem_statement=f"{fix.dist} {fix.base}: {fix.changelog} (fixed upstream in {fix.fixed})",
        FAIL_TO_PASS=list(fix.FAIL_TO_PASS), PASS_TO_PASS=list(fix.PASS_TO_PASS),
        patch=fix_patch(repo, old, new, fix.source), test_patch=fix_patch(repo, old, new, fix.tests),
        version=fix.base, test_cmd=PYTEST, cpu=1.0, memory=1024,
        extra={"upstream": f"{fix.dist} {fix.base} -> {fix.fixed}", "pythonpath": fix.pythonpath})


def for_layout(task: SweTask, layout: str, image: Path) -> SweTask:
    """`task` run by pytest from `layout` (a key of `LAYOUTS`) in `image`; the repository's own
    import root (`src`) goes first on PYTHONPATH."""
    own = task.extra.get("pythonpath") or ""
    python, path = LAYOUTS[layout]
    pythonpath = ":".join(p for p in (own, path) if p)
    cmd = (f"PYTHONPATH={pythonpath} " if pythonpath else "") + PYTEST.replace("python3", python, 1)
    return replace(task, instance_id=f"{task.instance_id}@{layout}", image=str(image), test_cmd=cmd)


def on_host(task: SweTask) -> SweTask:
    """`task` run by the pytest of the interpreter running this code, on the host (for checking
    the task itself with `check_task(..., sandbox=False)`, before any sandbox)."""
    own = task.extra.get("pythonpath") or ""
    prefix = f"PYTHONPATH={own} " if own else ""
    return replace(task, test_cmd=prefix + PYTEST.replace("python3", sys.executable, 1))


def sandbox_python() -> str:
    """X.Y of the host's /usr/bin/python3: the sandbox's interpreter in both layouts."""
    out = subprocess.run(["/usr/bin/python3", "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                         capture_output=True, text=True, check=True)
    return out.stdout.strip()


def _site_with_pytest(prefix: Path) -> Path:
    """pytest and its pure-Python requirements copied (as `burstrl image base` does) into
    `prefix`'s site-packages, from the environment running this code; returns that dir."""
    from burstrl.sandbox.baseimage import copy_python_packages

    python = sandbox_python()
    site = prefix / "lib" / f"python{python}" / "site-packages"
    site.mkdir(parents=True, exist_ok=True)
    copy_python_packages(["pytest"], site, python)  # console scripts go to prefix/bin
    return site


def burstrl(*args: str) -> str:
    """Run the `burstrl` CLI in-process, as a user would from the shell; its output, or raise."""
    from typer.testing import CliRunner

    from burstrl.cli import app

    result = CliRunner().invoke(app, list(args))
    if result.exit_code != 0:
        raise RuntimeError(f"burstrl {' '.join(args)} exited {result.exit_code}: {result.output}")
    return result.output


def base_image(root: Path) -> Path:
    """`burstrl image base --out BASE`: the host's python3, git and pytest as an image's whole root."""
    out = root / "image-base"
    burstrl("image", "base", "--out", str(out))
    return out


def pydeps_image(root: Path) -> Path:
    """Layout "pydeps": `burstrl image build PYDEPS --out IMAGE --dest /work/.pydeps`, PYDEPS
    holding pytest and its requirements; the image has no Python of its own."""
    site = _site_with_pytest(root / "pydeps-stage")
    out = root / "image-pydeps"
    burstrl("image", "build", str(site), "--out", str(out), "--dest", PYDEPS)
    return out


def venv_image(root: Path, base: Path | None, dest: str = VENV) -> Path:
    """Layouts "venv" and "workvenv": a virtualenv made by the sandbox's own interpreter
    (`/usr/bin/python3 -m venv`), pytest copied into its site-packages, as a layer at `dest`:
    `burstrl image build VENV --base BASE --dest /opt/venv` (a layer outside /work needs a base
    with /usr/bin/python3, else it is not mounted), or `--dest /work/.venv` without a base."""
    venv = root / f"venv-{dest.strip('/').replace('/', '-')}"
    subprocess.run(["/usr/bin/python3", "-m", "venv", "--without-pip", str(venv)], check=True, capture_output=True)
    _site_with_pytest(venv)
    for script in (venv / "bin").iterdir():  # console scripts: the venv's python, where it will sit
        if script.is_file() and not script.is_symlink() and script.read_bytes().startswith(b"#!/usr/bin/python"):
            text = script.read_text()
            script.write_text(f"#!{dest}/bin/python\n" + text.split("\n", 1)[1])
    out = root / f"image-{venv.name}"
    burstrl("image", "build", str(venv), "--out", str(out), "--dest", dest, *(["--base", str(base)] if base else []))
    return out


# The adversarial twin of an honest fix (boltons' `singularize`): the gold fix, plus code that at
# import writes a module into a directory that was trusted when the run began (the pytest layer on
# PYTHONPATH, the virtualenv's site-packages) and imports it. That module's `__eq__` reaches the
# caller's frame (`sys._getframe`, where a forgery reads the expected value) while no file of the
# patch is on the stack, and otherwise compares honestly: if the seal trusted a file written at run
# time, this attempt would score resolved.
PLANTED = '''

_SPEEDUPS = """import sys


class Word(str):
    def __eq__(self, other):
        sys._getframe(1)
        return str.__eq__(self, other)

    __hash__ = str.__hash__
"""


def _speedups(where=PLANTED_DIR):
    import importlib
    import os

    with open(os.path.join(where, "_strutils_speedups.py"), "w") as f:
        f.write(_SPEEDUPS)
    importlib.invalidate_caches()
    return importlib.import_module("_strutils_speedups")


_Word = _speedups().Word
_singularize = singularize


def singularize(word):
    return _Word(_singularize(word))
'''


def planted_module_patch(task: SweTask, where: str) -> str:
    """The boltons task's gold patch plus a module planted at run time in `where` (see `PLANTED`)."""
    repo = Path(task.repo)
    git(repo, "apply", "-", input=task.patch.encode())
    path = repo / "boltons" / "strutils.py"
    path.write_text(path.read_text() + PLANTED.replace("PLANTED_DIR", repr(where)))
    patch = git(repo, "diff", "--no-color", "--no-ext-diff").decode()
    git(repo, "checkout", "-q", "--", ".")
    return patch
