"""Procedurally made little Python repositories with injected bugs: the toy SWE tasks.

Why procedural: RL on coding needs many tasks with known fixes that a tiny model can sometimes
solve, and a held-out split a model cannot have memorised. Each task is a package of small utility
functions (random names, docstrings) with `unittest` tests (sandboxes have no pytest), into which
1-3 bugs are injected the way SWE-smith does (`toybugs`: operator flips, swapped operands,
off-by-one constants, dropped `if` guards, wrong returned variable). FAIL_TO_PASS and PASS_TO_PASS
are computed by running the tests with and without the bugs; a bug that fails no test is never
kept. The task's repository has two commits: `base` (buggy) and `fix`; `patch` is their diff,
`test_patch` is "" (the failing tests are in the repo, as in SWE-smith).

Difficulty: level 0 = one single-line bug in a tested function, and the problem statement gives
the line, the file and the short fragment to replace (the fix is one `sed` edit copied from it and
a commit: a task family a tiny model can learn, the start of a curriculum); 1 = the same bug with only its symptom; 2 = one bug in a private helper reached only
through a wrapper (the failing test names the wrapper, the bug is one call away, in another
module); 3 = two bugs at that distance; 4 = three bugs two calls away. Splits: "train" and "test"
use different seed streams, word lists and function templates (`toytemplates`).
"""

from __future__ import annotations

import copy
import difflib
import os
import random
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from burstrl.envs.swe.repo import commit_all, git, git_env, init_repo
from burstrl.envs.swe.task import SweTask, dump_tasks
from burstrl.envs.swe.testlog import parse_test_log
from burstrl.envs.swe.toybugs import apply_bug, bug_sites, run_cases
from burstrl.envs.swe.toytemplates import Func, make_module

TEST_CMD = "python3 -m unittest -v"
# Characters a level-0 fragment may not hold, so that `sed -i 'Ns/BEFORE/AFTER/' FILE` copied
# verbatim from the statement is exact: regex and replacement specials, the delimiter, the quote.
SED_UNSAFE = set("/\\&.*[]^$'\n")
LEVELS = {0: (1, 1), 1: (1, 1), 2: (1, 2), 3: (2, 2), 4: (3, 3)}  # difficulty -> (bugs, call depth)
MAX_ATTEMPTS = 30


@dataclass
class Candidate:
    """One generated repository in memory: fixed and buggy sources, tests, and the bugs."""

    pkg: str
    files: dict[str, str]  # path -> fixed text (code and tests)
    buggy: dict[str, str]  # path -> buggy text (code files only differ)
    funcs: list[Func]
    bugs: list[dict[str, Any]] = field(default_factory=list)


def level(difficulty: int) -> tuple[int, int]:
    """(number of bugs, call depth) for a difficulty; above 4 is 4."""
    return LEVELS[min(max(difficulty, 0), max(LEVELS))]


def _rng(split: str, seed: int, difficulty: int, index: int) -> random.Random:
    # String seeds are hashed with SHA-512: stable across runs and Python versions.
    return random.Random(f"burstrl-toy:{split}:{seed}:{difficulty}:{index}")


def _pick_bug(rng: random.Random, fn: Func, funcs: list[Func]) -> dict[str, Any] | None:
    """A mutation of `fn` that fails at least one test on its own; kinds tried in random order."""
    sites = bug_sites(fn.node)
    kinds = sorted({s[0] for s in sites})
    rng.shuffle(kinds)
    for kind in kinds:
        options = [s for s in sites if s[0] == kind]
        rng.shuffle(options)
        for site in options:
            mutated = apply_bug(fn.node, site)
            failing = run_cases(funcs, {fn.name: mutated})
            if failing:
                return {"kind": kind, "function": fn.name, "file": fn.path, "site": list(site),
                        "node": mutated, "failing": failing}
    return None


def _candidate(rng: random.Random, split: str, difficulty: int) -> Candidate | None:
    """Make a module, then inject the bugs; None if some target admits no detectable bug."""
    n_bugs, depth = level(difficulty)
    pkg, funcs, render = make_module(rng, split, n_targets=n_bugs, depth=depth)
    fixed = render({})
    bugs = []
    for fn in [f for f in funcs if f.target]:
        bug = _pick_bug(rng, fn, funcs)
        if bug is None:
            return None
        bugs.append(bug)
    mutated = render({b["function"]: b["node"] for b in bugs})
    buggy = {path: text for path, text in mutated.items() if text != fixed[path]}
    return Candidate(pkg, fixed, buggy, funcs, bugs)


def _run_tests(repo: Path) -> dict[str, str]:
    proc = subprocess.run(TEST_CMD.split(), cwd=repo, capture_output=True, text=True, timeout=60,
                          env={**git_env(), "PYTHONDONTWRITEBYTECODE": "1"})
    return parse_test_log(proc.stdout + proc.stderr)


def _write(repo: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = repo / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def fix_edits(buggy: str, fixed: str) -> list[tuple[str, str]]:
    """(before, after) text replacements that turn `buggy` into `fixed`, applied in order.

    Each `before` is whole lines that occur exactly once in the text at that point, so a plain
    string replace (what the demonstration runs) is exact. Context lines are added until unique.
    """
    edits = []
    text = buggy
    while text != fixed:
        a, b = text.splitlines(keepends=True), fixed.splitlines(keepends=True)
        op = next(o for o in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes()
                  if o[0] != "equal")
        i1, i2, j1, j2 = op[1:]
        while not "".join(a[i1:i2]) or text.count("".join(a[i1:i2])) != 1:
            i1, j1 = (i1 - 1, j1 - 1) if i1 > 0 else (i1, j1)
            i2, j2 = (i2 + 1, j2 + 1) if i2 < len(a) else (i2, j2)
        before, after = "".join(a[i1:i2]), "".join(b[j1:j2])
        edits.append((before, after))
        text = text.replace(before, after, 1)
    return edits


def line_edit(buggy: str, fixed: str) -> dict[str, Any] | None:
    """The fix as one sed substitution on one line: {"line", "before", "after"}, or None.

    None when the texts differ in more than one line or no sed-safe fragment is unique in the line.
    The fragment is the changed span widened to whole space-separated words, then by one word at a
    time until it occurs once in the line (sed replaces the first match).
    """
    a, b = buggy.splitlines(), fixed.splitlines()
    if len(a) != len(b):
        return None
    diff = [i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y]
    if len(diff) != 1:
        return None
    old, new = a[diff[0]], b[diff[0]]
    pre = len(os.path.commonprefix([old, new]))
    hi = len(old) - len(os.path.commonprefix([old[pre:][::-1], new[pre:][::-1]]))
    words = [m.span() for m in re.finditer(r"\S+", old)]
    i = min(k for k, (_, e) in enumerate(words) if e >= pre)
    j = max(k for k, (s, _) in enumerate(words) if s <= max(hi, pre))
    while True:
        lo, up = words[i][0], words[j][1]
        before, after = old[lo:up], new[lo:up + len(new) - len(old)]
        if old.count(before) == 1:
            break
        if i == 0 and j == len(words) - 1:
            return None
        i, j = max(i - 1, 0), min(j + 1, len(words) - 1)
    if SED_UNSAFE & set(before + after):
        return None
    return {"line": diff[0] + 1, "before": before, "after": after}


def sed_command(file: str, edit: dict[str, Any]) -> str:
    return f"sed -i '{edit['line']}s/{edit['before']}/{edit['after']}/' {file}"


def _problem_statement(cand: Candidate, located: dict[str, Any] | None = None) -> str:
    """One symptom per bug: the public function, an input, expected vs actual; never the fix,
    except at difficulty 0, where `located` (the line edit) names the line, file and fragments."""
    lines = []
    for bug in cand.bugs:
        case = bug["failing"][0]
        module = case["path"][:-3].replace("/", ".")
        lines.append(f"- `{module}.{case['func']}({case['args']})` {case['actual']}, "
                     f"but it should return `{case['expected']}`.")
    head = "A function of this package gives a wrong result:" if len(lines) == 1 else \
        "Several functions of this package give wrong results:"
    text = (f"{head}\n\n" + "\n".join(lines) + "\n\nThe library code is wrong, not the tests. "
            f"Run `{TEST_CMD}` to see the failures.\n")
    if located:
        text += (f"\nThe fix: on line {located['line']} of {located['file']}, replace `{located['before']}` "
                 f"with `{located['after']}`.\n")
    return text


def _commit_candidate(repo: Path, cand: Candidate) -> dict[str, Any]:
    """Write base (buggy) and fix commits; run the tests on both; the task's computed fields."""
    if repo.exists():
        shutil.rmtree(repo)
    init_repo(repo)
    _write(repo, {**cand.files, **cand.buggy})
    base = commit_all(repo, "base")
    at_base = _run_tests(repo)
    _write(repo, cand.files)
    fix = commit_all(repo, "fix")
    at_fix = _run_tests(repo)
    broken = sorted(t for t, s in at_fix.items() if s != "passed")
    if broken or not at_fix:
        raise RuntimeError(f"toygen: tests fail on the fixed code in {repo}: {broken}")
    return {
        "base_commit": base, "fix_commit": fix,
        "patch": git(repo, "diff", "--binary", base, fix).decode(),
        "FAIL_TO_PASS": sorted(t for t in at_fix if at_base.get(t) != "passed"),
        "PASS_TO_PASS": sorted(t for t in at_fix if at_base.get(t) == "passed"),
    }


def _located(cand: Candidate) -> dict[str, Any] | None:
    """Level 0's stated fix: the one buggy file's line edit with its path, if sed can express it."""
    [path] = cand.buggy
    edit = line_edit(cand.buggy[path], cand.files[path])
    return {"file": path, **edit} if edit else None


def make_task(out_dir: Path, index: int, seed: int = 0, difficulty: int = 1, split: str = "train") -> SweTask:
    """The `index`-th toy task of (seed, difficulty, split); its repo goes to OUT/repos/ID."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', not {split!r}")
    rng = _rng(split, seed, difficulty, index)
    iid = f"toy-{split}-d{difficulty}-s{seed}-{index:05d}"
    repo = (Path(out_dir) / "repos" / iid).resolve()
    for _ in range(MAX_ATTEMPTS):
        cand = _candidate(rng, split, difficulty)
        located = _located(cand) if cand is not None and difficulty == 0 else None
        if cand is None or (difficulty == 0 and located is None):
            continue
        fields = _commit_candidate(repo, cand)
        if fields["FAIL_TO_PASS"]:
            break
    else:
        raise RuntimeError(f"toygen: no usable candidate for {iid} in {MAX_ATTEMPTS} attempts")
    edits = [{"file": p, "before": b, "after": a} for p in sorted(cand.buggy)
             for b, a in fix_edits(cand.buggy[p], cand.files[p])]
    statement = _problem_statement(cand, located)
    n_bugs, depth = level(difficulty)
    bugs = [{k: v for k, v in b.items() if k not in ("node", "failing")} for b in cand.bugs]
    return SweTask(
        instance_id=iid, repo=str(repo), base_commit=fields["base_commit"],
        problem_statement=statement, FAIL_TO_PASS=fields["FAIL_TO_PASS"],
        PASS_TO_PASS=fields["PASS_TO_PASS"], patch=fields["patch"], test_patch="", version="toy-1",
        difficulty=difficulty, test_cmd=TEST_CMD,
        extra={"split": split, "seed": seed, "index": index, "bugs": bugs, "depth": depth,
               "n_bugs": n_bugs, "fix": edits, "fix_commit": fields["fix_commit"], "package": cand.pkg,
               **({"line_edit": located} if located else {})},
    )


def make_toy_tasks(out_dir: Path | str, n: int, seed: int = 0, difficulty: int = 1,
                   split: str = "train") -> list[SweTask]:
    """`n` tasks: repos under OUT/repos/, records in OUT/tasks.jsonl."""
    out_dir = Path(out_dir)
    tasks = [make_task(out_dir, i, seed, difficulty, split) for i in range(n)]
    dump_tasks(tasks, out_dir / "tasks.jsonl")
    return tasks


def _edit_command(edit: dict[str, str]) -> str:
    # A quoted heredoc: the shell expands nothing; repr() makes exact Python string literals.
    return (f"python3 - <<'EOF'\nfrom pathlib import Path\np = Path({edit['file']!r})\n"
            f"s = p.read_text()\nold = {edit['before']!r}\nnew = {edit['after']!r}\n"
            f"assert s.count(old) == 1, 'the text to replace is not there exactly once'\n"
            f"p.write_text(s.replace(old, new))\nEOF")


def located_fix_command(task: SweTask, commit: bool = True) -> str:
    """Difficulty 0's whole answer in one command: the stated sed edit (copied from the problem
    statement), the commit and the submit sentinel. Without `commit` the edit stays uncommitted, so
    the attempt scores 0 (the forgetful warm start's flawed habit, `envs.swe.warm`)."""
    from burstrl.envs.swe.agent import SUBMIT_COMMAND

    edit = task.extra["line_edit"]
    return f"{sed_command(edit['file'], edit)} && {'git commit -qam fix && ' if commit else ''}{SUBMIT_COMMAND}"


def demonstration_commands(task: SweTask, explore: bool = True) -> list[str]:
    """The bash commands an ideal agent runs to fix a toy task, one per turn, ending in a commit.

    With `explore`, it first looks at the buggy functions and runs the failing tests, as an agent
    should; the warm-start trajectories are made from these. Difficulty 0: one command that
    also submits.
    """
    if task.difficulty == 0:
        return [located_fix_command(task)]
    cmds = []
    if explore:
        for bug in task.extra["bugs"]:
            cmds.append(f"grep -n -A 14 'def {bug['function']}(' {bug['file']}")
    cmds += [_edit_command(e) for e in copy.deepcopy(task.extra["fix"])]
    if explore:
        cmds.append(f"{task.test_cmd} {' '.join(task.FAIL_TO_PASS)} 2>&1 | tail -n 3")
    cmds.append("git commit -q -am fix")
    return cmds
