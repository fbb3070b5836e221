"""What an attempt's patch may change at all, decided before any test runs (deny by default).

Why a policy and not a longer reset list: the test run is steered by files nobody lists until an
attacker finds them (pytest 9's `pytest.toml`, plugin entry points of a `*.dist-info` directory on
`sys.path`, a package that shadows a module pytest imports, a sourceless `.pyc`, an unchecked-hash
bytecode file under `__pycache__` whose source looks untouched). A fix to a Python repository is
text edits to its source; so the policy names what a fix is and refuses the rest as `tampered`:

- `binary`: any binary file (git's `GIT binary patch` / `Binary files differ`); no fix needs one,
  and no text scan can read one.
- `symlink`: a new symbolic link (it can point the runner at paths the grader reads or writes).
- `bytecode`: `.pyc`/`.pyo`, extension modules (`.so`, `.pyd`, `.dylib`, `.dll`), anything under
  `__pycache__`: code that runs without the source the diff shows.
- `packaging`: `*.dist-info`, `*.egg-info`, `*.egg-link`, `.pth`, `entry_points.txt`: metadata the
  interpreter or pytest's plugin autoload acts on.
- `runner_config`: files only a test runner reads (`pytest.ini`, `.pytest.ini`, `pytest.toml`,
  `.pytest.toml`, `conftest.py` outside the graded tests' directories, `sitecustomize.py`,
  `usercustomize.py`), and a NEW `setup.cfg` / `tox.ini` / `pyproject.toml` / `setup.py`. Edits to
  existing multi-purpose config files stay allowed and are reset to the base before the run
  (`integrity.harness_files`): the runner always reads the task's configuration.
- `outside_source`: a new file whose directory is not one of the base's source directories
  (a directory holding a tracked `.py` file) nor a new directory below a non-root one.
- `shadowing`: a new top-level module or package whose name the test interpreter could already
  import (the standard library or anything installed in the grading sandbox): asked of the
  sandbox's own `python3` before the patch is applied (`importable_names`).
- `denied`: a path matching one of the task set's `deny` globs.

`allow` globs (per task set: `orchestrator.swe.diff_allow`, or a task's `extra.diff_policy`) lift
`outside_source` and `runner_config` for the paths they match; `binary`, `symlink`, `bytecode`
and `packaging` cannot be allowed. Test files edited by the patch are still reset, not punished.

The policy also refuses what the patch's code does, as the static scan reads it once the patch is
applied (`primitives.py`, refused in `grade` right after `screen.scan_changes`): `introspection`,
`lying_value`, `runner_internals`, `test_access`, `unscannable`. A task set whose real fixes need
one allows it with an entry `NAME:GLOB` in the same `allow` list, NAME a primitive (`frame`,
`gc`, `mock`, ...) or a whole rule (`introspection`), GLOB the files it may be in:
`"frame:jinja2/debug.py"`, `"introspection:*"`. A plain glob never lifts these.
(The primitives, their rules and what each matches: README, "Agentic coding tasks".)
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Any

BYTECODE_SUFFIXES = (".pyc", ".pyo", ".so", ".pyd", ".dylib", ".dll")
PACKAGING_DIR_SUFFIXES = (".dist-info", ".egg-info", ".egg-link")
PACKAGING_NAMES = frozenset({"entry_points.txt"})
RUNNER_ONLY = frozenset({"pytest.ini", ".pytest.ini", "pytest.toml", ".pytest.toml", "sitecustomize.py",
                         "usercustomize.py"})
RUNNER_WHEN_NEW = frozenset({"setup.cfg", "tox.ini", "pyproject.toml", "setup.py"})
UNALLOWABLE = frozenset({"binary", "symlink", "bytecode", "packaging"})


@dataclass(frozen=True)
class DiffPolicy:
    """A task set's exceptions to the default (globs over repository-relative paths)."""

    allow: tuple[str, ...] = ()
    deny: tuple[str, ...] = ()

    @classmethod
    def of(cls, *parts: Any) -> DiffPolicy:
        """Merge dicts/policies (`{"allow": [...], "deny": [...]}`); None entries are skipped."""
        allow: list[str] = []
        deny: list[str] = []
        for part in parts:
            if part is None:
                continue
            data = part if isinstance(part, dict) else {"allow": part.allow, "deny": part.deny}
            unknown = set(data) - {"allow", "deny"}
            if unknown:
                raise ValueError(f"diff_policy: unknown key(s) {', '.join(sorted(unknown))} (allow, deny)")
            for key, into in (("allow", allow), ("deny", deny)):
                globs = data.get(key) or []
                if not isinstance(globs, (list, tuple)) or not all(isinstance(g, str) and g for g in globs):
                    raise ValueError(f"diff_policy.{key} must be a list of non-empty glob strings")
                into.extend(globs)
        return cls(tuple(allow), tuple(deny))

    def allows(self, path: str) -> bool:
        return any(fnmatchcase(path, g) for g in self.allow)

    def allows_primitive(self, path: str, primitive: str, rule: str) -> bool:
        """An `allow` entry `NAME:GLOB` names this primitive or its rule (NAME may be a glob too:
        `*:*` lifts them all, as a test of the sealed run alone does) and matches the path."""
        for entry in self.allow:
            name, sep, glob = entry.partition(":")
            if sep and (fnmatchcase(primitive, name) or fnmatchcase(rule, name)) and fnmatchcase(path, glob):
                return True
        return False

    def denies(self, path: str) -> bool:
        return any(fnmatchcase(path, g) for g in self.deny)


@dataclass
class FileChange:
    """One file of a git diff: its path after the change (before, for a deletion) and how."""

    path: str
    old_path: str = ""
    new: bool = False
    deleted: bool = False
    binary: bool = False
    symlink: bool = False


@dataclass
class Violation:
    rule: str
    path: str
    why: str

    def __str__(self) -> str:
        return f"diff policy {self.rule}: {self.path}: {self.why}"


@dataclass
class Verdict:
    violation: Violation | None = None
    new_top_level: list[str] = field(default_factory=list)  # names to ask the sandbox about


_DIFF = re.compile(r"^diff --git a/(.+) b/(.+)$")


def parse_changes(patch: str) -> list[FileChange]:
    """The files of a `git diff --binary` (paths unquoted as `core.quotepath=off` writes them)."""
    changes: list[FileChange] = []
    cur: FileChange | None = None
    for line in patch.splitlines():
        m = _DIFF.match(line)
        if m:
            cur = FileChange(path=m.group(2), old_path=m.group(1))
            changes.append(cur)
            continue
        if cur is None:
            continue
        if line.startswith("new file mode "):
            cur.new, cur.symlink = True, line.endswith("120000")
        elif line.startswith("new mode ") and line.endswith("120000"):
            cur.symlink = True
        elif line.startswith("deleted file mode "):
            cur.deleted = True
        elif line.startswith("rename to ") or line.startswith("copy to "):
            cur.path, cur.new = line.split(" to ", 1)[1], True
        elif line == "GIT binary patch" or (line.startswith("Binary files ") and line.endswith(" differ")):
            cur.binary = True
        elif line.startswith("+++ b/"):
            cur.path = line[6:].rstrip("\t")
    return changes


def source_dirs(base_files: Iterable[str]) -> frozenset[str]:
    """Directories of the base that hold a tracked `.py` file ("" is the root)."""
    return frozenset(p.rpartition("/")[0] for p in base_files if p.endswith(".py"))


def check(patch: str, base_files: frozenset[str], test_dirs: Iterable[str], policy: DiffPolicy) -> Verdict:
    """The first rule the patch breaks (checks not needing the sandbox), and the new top-level
    module names the sandbox must be asked about (`shadowing`)."""
    sources, tests = source_dirs(base_files), set(test_dirs)
    base_dirs = {p.rpartition("/")[0] for p in base_files} | {""}
    top: list[str] = []
    for change in parse_changes(patch):
        for path in dict.fromkeys(p for p in (change.path, change.old_path) if p):  # new name first
            violation = _rule(change, path, sources, tests, base_dirs, base_files, policy)
            if violation is not None:
                return Verdict(violation)
        name = _new_top_level(change, base_files)
        if name and name not in top:
            top.append(name)
    return Verdict(None, top)


def _rule(change: FileChange, path: str, sources: frozenset[str], tests: set[str], base_dirs: set[str],
          base_files: frozenset[str], policy: DiffPolicy) -> Violation | None:
    parts = path.split("/")
    name, parent = parts[-1], path.rpartition("/")[0]
    if change.binary:
        return Violation("binary", path, "binary files are never part of a fix")
    if change.symlink:
        return Violation("symlink", path, "a symbolic link")
    if "__pycache__" in parts or name.endswith(BYTECODE_SUFFIXES):
        return Violation("bytecode", path, "bytecode or a compiled module runs without its source")
    if any(p.endswith(PACKAGING_DIR_SUFFIXES) for p in parts) or name.endswith(".pth") or name in PACKAGING_NAMES:
        return Violation("packaging", path, "packaging metadata (plugin entry points, .pth)")
    if policy.denies(path):
        return Violation("denied", path, "matches the task set's deny list")
    if policy.allows(path):
        return None
    if name in RUNNER_ONLY or (name == "conftest.py" and not _under(parent, tests)):
        return Violation("runner_config", path, "test runner configuration")
    is_new = path not in base_files
    if is_new and name in RUNNER_WHEN_NEW:
        return Violation("runner_config", path, "a new configuration file the test runner reads")
    if is_new and not change.deleted and not _in_source(parent, sources, base_dirs):
        return Violation("outside_source", path, "a new file outside the repository's source directories")
    return None


def _under(parent: str, dirs: set[str]) -> bool:
    return any(parent == d or parent.startswith(d + "/") for d in dirs if d)


def _in_source(parent: str, sources: frozenset[str], base_dirs: set[str]) -> bool:
    """The file's directory is a source directory, or a new directory whose nearest existing
    ancestor is a source directory other than the root (a new subpackage)."""
    if parent in sources:
        return True
    if parent in base_dirs:
        return False
    ancestor = parent
    while ancestor and ancestor not in base_dirs:
        ancestor = ancestor.rpartition("/")[0]
    return bool(ancestor) and ancestor in sources


def _new_top_level(change: FileChange, base_files: frozenset[str]) -> str:
    """The module name a new root-level `x.py` or new root package `x/...` would be importable as."""
    if change.deleted or change.path in base_files:
        return ""
    first, sep, _ = change.path.partition("/")
    if sep and any(p.startswith(first + "/") for p in base_files):
        return ""  # a package the base already has
    name = first if sep else first[:-3] if first.endswith(".py") else ""
    return name if name.isidentifier() else ""


IMPORTABLE_PROBE = ("import importlib.util, sys\n"
                    "for n in sys.argv[1:]:\n"
                    "    try:\n"
                    "        found = importlib.util.find_spec(n) is not None\n"
                    "    except (ImportError, ValueError):\n"
                    "        found = False\n"
                    "    if found:\n"
                    "        print(n)\n")


def shadowing(names: list[str], importable: Callable[[list[str]], set[str]]) -> Violation | None:
    """`shadowing` for the first of `names` the test interpreter already imports from elsewhere."""
    if not names:
        return None
    hit = importable(names)
    for n in names:
        if n in hit:
            return Violation("shadowing", n, "a new top-level module or package with the name of one the test "
                             "interpreter already imports (standard library or installed)")
    return None
