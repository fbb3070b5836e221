"""The functions task set: distinct problems from the templates, as `SweTask` records whose cases
are data (`extra["cases"]`: arguments and expected results, `cases.py`), graded by `grade.py` with
the candidate in a sandbox that holds neither tests nor expected values.

The records keep SWE-bench's shape, so `tasks check`, evals and reports treat them like any task:
FAIL_TO_PASS names the cases, the gold patch turns the stub into the reference, `extra.variants`
holds patches of other correct bodies. The repository beside them (one commit) has `fns/<id>.py`,
each task's stub (the prompt and `raise NotImplementedError`), and `tests/test_<id>.py`, the same
cases as unittest tests for people to read and run; grading never reads or uploads it (it holds
every task's expected values). `extra` also keeps the prompt, the function's name, the split, the
template and the category.

Splits: "train" draws templates not held out, with constants from the training ranges; "test"
draws held-out templates (any constants) and the templates that take a constant, with constants from
the held-out ranges (a template without a constant is training's only: its test problems would be
training's).
"""

from __future__ import annotations

import difflib
import hashlib
import random
from pathlib import Path

from burstrl.envs.functions.cases import Case, encode_case
from burstrl.envs.functions.templates import TEMPLATES, FunctionTemplate, Problem, Raises, make_problem
from burstrl.envs.swe.repo import commit_all, init_repo
from burstrl.envs.swe.task import SweTask, dump_tasks

TEST_CMD = "python3 -m unittest -v"
VERSION = "functions-2"  # functions-1: no extra.cases (graded by the test files)
CATEGORY = {t.key: t.category for t in TEMPLATES}
SPLITS = ("train", "test")


def make_problems(n: int, seed: int, split: str) -> list[Problem]:
    """`n` distinct problems of `split` (ValueError if the templates cannot give that many)."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    rng = random.Random(f"burstrl-functions:{split}:{seed}")
    out: list[Problem] = []
    seen: set[tuple[str, tuple[str, ...], str]] = set()
    misses = 0
    while len(out) < n and misses < 2000:  # 2000 draws in a row that repeat: the templates are exhausted
        if split == "train":
            t, test_consts = rng.choice([t for t in TEMPLATES if not t.held_out]), False
        else:  # a template training never saw, or one it saw with a constant it never saw
            t = rng.choice([t for t in TEMPLATES if t.held_out or takes_constant(t)])
            test_consts = not t.held_out or rng.random() < 0.5
        p = make_problem(t, rng, test_consts)
        key = (p.name, p.args, p.body)
        if key in seen or not p.cases:
            misses += 1
            continue
        misses = 0
        seen.add(key)
        out.append(p)
    if len(out) < n:
        raise ValueError(f"only {len(out)} distinct {split} problems from the templates, {n} asked")
    return out


def takes_constant(t: FunctionTemplate) -> bool:
    """Whether the template's problems carry a constant (a number, letter or key) in their body."""
    return any(f"{{{name}}}" in t.body for name in ("c", "ch", "k"))


def make_function_tasks(out_dir: Path | str, n: int, seed: int = 0, split: str = "train") -> list[SweTask]:
    """`n` tasks of `split`: the repository at OUT/repo (one commit), the records in OUT/tasks.jsonl."""
    out_dir = Path(out_dir)
    problems = make_problems(n, seed, split)
    ids = [f"fn-{split}-s{seed}-{i:04d}" for i in range(len(problems))]
    repo = (out_dir / "repo").resolve()
    init_repo(repo)
    files = {"fns/__init__.py": "", "tests/__init__.py": ""}
    for iid, p in zip(ids, problems, strict=True):
        files[stub_path(iid)] = stub(p)
        files[f"tests/test_{_module(iid)}.py"] = hidden_tests(iid, p)
    for path, text in files.items():
        (repo / path).parent.mkdir(parents=True, exist_ok=True)
        (repo / path).write_text(text)
    base = commit_all(repo, "functions: stubs and hidden tests")
    tasks = [_task(iid, p, str(repo), base, seed, split) for iid, p in zip(ids, problems, strict=True)]
    dump_tasks(tasks, out_dir / "tasks.jsonl")
    return tasks


def stub_path(iid: str) -> str:
    return f"fns/{_module(iid)}.py"


def stub(p: Problem) -> str:
    return f"{p.prompt}    raise NotImplementedError\n"


def hidden_tests(iid: str, p: Problem) -> str:
    """The cases as unittest tests (one method per case, importing the task's function): for people;
    grading uses `extra.cases`."""
    lines = ["import unittest", "", f"from fns.{_module(iid)} import {p.name}", "", "", "class TestFunction(unittest.TestCase):"]
    for i, (args, expected) in enumerate(p.cases):
        call = f"{p.name}({', '.join(repr(a) for a in args)})"
        if isinstance(expected, Raises):
            lines += [f"    def test_{i}(self):", f"        with self.assertRaises({expected.name}):",
                      f"            {call}", ""]
        else:
            lines += [f"    def test_{i}(self):", f"        self.assertEqual({call}, {expected!r})", ""]
    return "\n".join(lines).rstrip() + "\n"


def problem_cases(iid: str, p: Problem) -> list[Case]:
    """The problem's cases as data, named by the task's FAIL_TO_PASS ids."""
    return [Case(tid, tuple(args), None, expected.name) if isinstance(expected, Raises) else Case(tid, tuple(args), expected)
            for tid, (args, expected) in zip(graded_ids(iid, p), p.cases, strict=True)]


def graded_ids(iid: str, p: Problem) -> list[str]:
    return [f"tests.test_{_module(iid)}.TestFunction.test_{i}" for i in range(len(p.cases))]


def attempt_patch(path: str, old: str, new: str) -> str:
    """A unified diff (git apply's input) that turns file `path` from `old` into `new`.

    Lines are split at "\\n" only, as git does (str.splitlines also splits at \\x0b, \\x1c, ...: a
    completion holding those would give a patch that no longer applies)."""
    def lines(text: str) -> list[str]:
        parts = text.split("\n")
        return [line + "\n" for line in parts[:-1]] + ([parts[-1]] if parts[-1] else [])

    diff = difflib.unified_diff(lines(old), lines(new), f"a/{path}", f"b/{path}", n=3)
    out = []
    for line in diff:
        out.append(line if line.endswith("\n") else line + "\n\\ No newline at end of file\n")
    return f"diff --git a/{path} b/{path}\n" + "".join(out) if out else ""


def apply_patch(old: str, patch: str) -> str:
    """`old` with the one-file unified diff `patch` applied (the inverse of `attempt_patch`, for the
    gold patch and `extra.variants`: grading takes the module's text, not a patch). ValueError if it
    does not apply to `old` exactly (no fuzz)."""
    src = _split_lines(old)
    out: list[str] = []
    pos = 0
    for start, body in _hunks(patch):
        if start < pos or start > len(src):
            raise ValueError(f"a hunk at line {start + 1} does not fit the file")
        out += src[pos:start]
        pos = start
        for op, text in body:
            if op in " -":
                if pos >= len(src) or src[pos] != text:
                    raise ValueError(f"the patch does not match line {pos + 1}")
                pos += 1
            if op in " +":
                out.append(text)
    return "".join(out + src[pos:])


def _split_lines(text: str) -> list[str]:
    parts = text.split("\n")
    return [line + "\n" for line in parts[:-1]] + ([parts[-1]] if parts[-1] else [])


def _hunks(patch: str) -> list[tuple[int, list[tuple[str, str]]]]:
    """(0-based start in the old file, [(op, line)]) per hunk; a "\\ No newline" marker takes the
    newline off the line before it."""
    hunks: list[tuple[int, list[tuple[str, str]]]] = []
    for line in _split_lines(patch):
        if line.startswith("@@"):
            old = line.split()[1].lstrip("-").split(",")
            start = int(old[0]) - 1 if len(old) == 1 or int(old[1]) > 0 else int(old[0])
            hunks.append((start, []))
        elif hunks and line[:1] in (" ", "-", "+") and not line.startswith(("--- ", "+++ ")):
            hunks[-1][1].append((line[0], line[1:]))
        elif hunks and line.startswith("\\") and hunks[-1][1]:
            op, text = hunks[-1][1][-1]
            hunks[-1][1][-1] = (op, text.removesuffix("\n"))
    return hunks


def _task(iid: str, p: Problem, repo: str, base: str, seed: int, split: str) -> SweTask:
    path = stub_path(iid)
    return SweTask(
        instance_id=iid, repo=repo, base_commit=base, problem_statement=p.prompt,
        FAIL_TO_PASS=graded_ids(iid, p), PASS_TO_PASS=[], patch=attempt_patch(path, stub(p), p.solution),
        version=VERSION, difficulty=1, test_cmd=TEST_CMD, memory=512, disk=256,
        extra={"split": split, "seed": seed, "template": p.template, "category": CATEGORY[p.template],
               "prompt": p.prompt, "file": path, "function": p.name,
               "cases": [encode_case(c) for c in problem_cases(iid, p)],
               "variants": [attempt_patch(path, stub(p), p.variant_solution)] if p.variant else [],
               "stub_sha": hashlib.sha256(stub(p).encode()).hexdigest()[:16]},
    )


def _module(iid: str) -> str:
    return iid.replace("-", "_")
