"""The diff policy (envs/swe/diffpolicy.py) on real `git diff --binary` output: what a fix may change."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from burstrl.envs.swe.diffpolicy import DiffPolicy, check, parse_changes, shadowing

BASE = {"calc.py": "def add(a, b):\n    return a - b\n", "pkg/__init__.py": "", "pkg/core.py": "X = 1\n",
        "tests/test_calc.py": "def test_add():\n    pass\n", "docs/index.rst": "Docs\n", "setup.cfg": "[metadata]\n"}


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True).stdout


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    repo = tmp_path_factory.mktemp("policy") / "repo"
    repo.mkdir()
    git(repo, "init", "-q")
    for path, text in BASE.items():
        (repo / path).parent.mkdir(parents=True, exist_ok=True)
        (repo / path).write_text(text)
    git(repo, "add", "-A")
    git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "base")
    return repo


def diff(repo: Path, files: dict[str, str | bytes | None], link: tuple[str, str] | None = None) -> str:
    """`git diff --binary` of writing (text or bytes) or deleting (None) `files`; the repo is restored."""
    for path, content in files.items():
        target = repo / path
        if content is None:
            target.unlink()
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(content) if isinstance(content, bytes) else target.write_text(content)
    if link:
        os.symlink(link[1], repo / link[0])
    git(repo, "add", "-A")
    out = git(repo, "-c", "core.quotepath=off", "diff", "--cached", "--binary", "--no-color")
    git(repo, "reset", "-q", "--hard")
    git(repo, "clean", "-fdqx")
    return out


DEFAULT = DiffPolicy()


def verdict(repo: Path, patch: str, policy: DiffPolicy = DEFAULT):
    return check(patch, frozenset(BASE), {"tests"}, policy)


HONEST = {
    "edit a module": {"calc.py": "def add(a, b):\n    return a + b\n"},
    "new module in a package": {"pkg/util.py": "Y = 2\n"},
    "new subpackage": {"pkg/sub/__init__.py": "", "pkg/sub/x.py": "Z = 3\n"},
    "new root module": {"calc_helpers.py": "def h():\n    return 1\n"},
    "edit docs": {"docs/index.rst": "Docs, fixed\n"},
    "edit setup.cfg (reset later, not refused)": {"setup.cfg": "[metadata]\nname = x\n"},
    "edit a test (reset later)": {"tests/test_calc.py": "def test_add():\n    assert 0\n"},
    "conftest in the tests dir (reset later)": {"tests/conftest.py": "X = 1\n"},
    "delete a module": {"pkg/core.py": None},
}


@pytest.mark.parametrize("name", list(HONEST))
def test_what_a_fix_does_is_allowed(repo: Path, name: str) -> None:
    v = verdict(repo, diff(repo, HONEST[name]))
    assert v.violation is None, v.violation


HACKS = {  # name -> (files, rule)
    "pytest.toml": ({"pytest.toml": '[pytest]\naddopts = ["-p", "calc_plugin"]\n'}, "runner_config"),
    ".pytest.toml": ({".pytest.toml": "[pytest]\n"}, "runner_config"),
    "pytest.ini in a package": ({"pkg/pytest.ini": "[pytest]\n"}, "runner_config"),
    "root conftest": ({"conftest.py": "import calc\n"}, "runner_config"),
    "new tox.ini": ({"tox.ini": "[pytest]\naddopts = -p calc_plugin\n"}, "runner_config"),
    "new pyproject": ({"pyproject.toml": "[tool.pytest.ini_options]\n"}, "runner_config"),
    "sitecustomize": ({"pkg/sitecustomize.py": "import os\n"}, "runner_config"),
    "dist-info entry points": ({"evil-1.0.dist-info/entry_points.txt": "[pytest11]\nevil = calc_plugin\n",
                                "evil-1.0.dist-info/METADATA": "Name: evil\n"}, "packaging"),
    "egg-info in a package": ({"pkg/x.egg-info/entry_points.txt": "[pytest11]\n"}, "packaging"),
    ".pth": ({"calc.pth": "import calc_plugin\n"}, "packaging"),
    "sourceless pyc": ({"calc_hack.pyc": b"\xa7\r\r\n\x00\x00\x00\x00" + bytes(range(256))}, "binary"),
    "pyc under __pycache__ as text": ({"pkg/__pycache__/core.cpython-311.pyc": "text\n"}, "bytecode"),
    "extension module": ({"pkg/fast.so": "not really\n"}, "bytecode"),
    "binary data file": ({"pkg/data.bin": b"\x00\x01\x02" * 100}, "binary"),
    "new top-level dir": ({"hack/__init__.py": "X = 1\n"}, "outside_source"),
    "new file in docs": ({"docs/plugin.py": "X = 1\n"}, "outside_source"),
}


@pytest.mark.parametrize("name", list(HACKS))
def test_what_steers_the_runner_is_refused_by_rule(repo: Path, name: str) -> None:
    files, rule = HACKS[name]
    v = verdict(repo, diff(repo, files))
    assert v.violation is not None and v.violation.rule == rule, v.violation


def test_a_new_symlink_is_refused(repo: Path) -> None:
    v = verdict(repo, diff(repo, {}, link=("pkg/report.xml", "/tmp/burstrl-grade/report.xml")))
    assert v.violation is not None and v.violation.rule == "symlink"


def test_new_top_level_names_go_to_the_sandbox_and_shadowing_is_refused(repo: Path) -> None:
    """A new root package is `outside_source` unless allowed; allowed (or a new root module), its
    name is asked of the sandbox's interpreter, and one it already imports is `shadowing`."""
    patch = diff(repo, {"tomllib/__init__.py": "X = 1\n", "calc_helpers.py": "Y = 1\n"})
    v = check(patch, frozenset(BASE), {"tests"}, DiffPolicy(allow=("tomllib/*",)))
    assert v.violation is None and sorted(v.new_top_level) == ["calc_helpers", "tomllib"]
    asked = []

    def importable(names):  # what the grading sandbox's python3 answers (here: the stdlib)
        asked.extend(names)
        return {"tomllib"}

    hit = shadowing(v.new_top_level, importable)
    assert hit is not None and hit.rule == "shadowing" and hit.path == "tomllib" and asked
    assert shadowing(["calc_helpers"], lambda names: set()) is None


def test_allow_and_deny_globs_and_what_cannot_be_allowed(repo: Path) -> None:
    docs = diff(repo, {"docs/plugin.py": "X = 1\n"})
    assert verdict(repo, docs, DiffPolicy(allow=("docs/*",))).violation is None
    edit = diff(repo, {"calc.py": "def add(a, b):\n    return a + b\n"})
    v = verdict(repo, edit, DiffPolicy(deny=("calc.py",)))
    assert v.violation is not None and v.violation.rule == "denied"
    blob = diff(repo, {"pkg/data.bin": b"\x00" * 64})
    assert verdict(repo, blob, DiffPolicy(allow=("pkg/*",))).violation.rule == "binary"
    assert DiffPolicy.of({"allow": ["a/*"]}, DiffPolicy(deny=("b",))) == DiffPolicy(("a/*",), ("b",))
    with pytest.raises(ValueError, match="unknown key"):
        DiffPolicy.of({"alow": ["x"]})
    with pytest.raises(ValueError, match="list of non-empty glob"):
        DiffPolicy.of({"allow": "x"})


def test_renames_are_judged_on_both_names(repo: Path) -> None:
    git(repo, "mv", "pkg/core.py", "pytest.toml")
    patch = git(repo, "-c", "core.quotepath=off", "diff", "--cached", "-M", "--binary")
    git(repo, "reset", "-q", "--hard")
    changes = parse_changes(patch)
    assert changes and changes[0].path == "pytest.toml" and changes[0].old_path == "pkg/core.py"
    assert verdict(repo, patch).violation.rule == "runner_config"


# ---- the static scan's policy-level findings (screen.refusal): refused, unless allowed by name ----

def test_a_policy_level_finding_is_refused_naming_the_rule_and_the_finding() -> None:
    from burstrl.envs.swe.screen import refusal

    found = ["pkg/calc.py: atexit", "pkg/calc.py: closure", "pkg/calc.py: frame", "pkg/util.py: mock"]
    violation, kept = refusal(found, DEFAULT)
    assert violation is not None and violation.rule == "introspection" and violation.path == "pkg/calc.py"
    text = str(violation)
    assert text.startswith("diff policy introspection: pkg/calc.py: closure: ") and "pkg/calc.py: frame" in text
    assert '"closure:<glob>"' in text  # how a task set allows it
    assert kept == found
    assert refusal(["pkg/calc.py: atexit"], DEFAULT) == (None, ["pkg/calc.py: atexit"])  # suspicious-level only
    assert refusal(["src/_pytest/python.py: frame"], DEFAULT)[0] is None  # the runner's own code: flagged only


def test_a_task_set_allows_a_primitive_or_a_rule_by_name_and_path() -> None:
    from burstrl.envs.swe.screen import refusal

    found = ["jinja2/debug.py: frame", "jinja2/debug.py: closure"]
    v, kept = refusal(found, DiffPolicy(allow=("frame:jinja2/debug.py",)))
    assert v is not None and v.rule == "introspection" and "closure" in str(v) and kept == found[1:]
    assert refusal(found, DiffPolicy(allow=("introspection:jinja2/*",))) == (None, [])
    assert refusal(found, DiffPolicy(allow=("introspection:other/*",)))[0] is not None  # another path
    assert refusal(found, DiffPolicy(allow=("jinja2/*", "*")))[0] is not None  # a plain glob never lifts them
    assert refusal(["a.py: mock"], DiffPolicy(allow=("lying_value:*",))) == (None, [])
    policy = DiffPolicy.of({"allow": ["gc:*"]})
    assert policy.allows_primitive("x/y.py", "gc", "introspection") and not policy.allows("x/y.py")
    assert refusal(found + ["a.py: mock"], DiffPolicy(allow=("*:*",))) == (None, [])  # the sealed run alone
