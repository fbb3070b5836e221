"""Per-test status from a test run's output: unittest `-v` and pytest `-rA` / `-v`.

Why parse text: the grader and `tasks check` run whatever `test_cmd` a task names inside a
sandbox and get its output back; the output is all they have. Statuses are "passed", "failed",
"error" or "skipped". Where two lines speak of one test (the `-v` line and the failure section),
the later wins; both agree in practice.

unittest ids are `module.Class.method` (the form `python3 -m unittest` accepts back). Python 3.11+
prints `test_y (tests.test_mod.TestX.test_y) ... ok`, older versions `test_y (tests.test_mod.TestX)`;
both give `tests.test_mod.TestX.test_y`. pytest ids are `path::test[param]`. pytest's short
summary reports skips by location (`SKIPPED [1] path:12: reason`), not by id, so those are only
seen with `-v` (`path::test SKIPPED`).
"""

from __future__ import annotations

import re

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
# unittest -v: "test_y (tests.test_mod.TestX.test_y) ... ok" (the docstring line may sit between).
_UT_HEAD = re.compile(r"^(\w+) \(([\w.]+)\)")
_UT_STATUS = {"ok": "passed", "FAIL": "failed", "ERROR": "error", "expected failure": "passed",
              "unexpected success": "failed"}
# unittest failure sections: "FAIL: test_y (tests.test_mod.TestX.test_y)" (+ " (i=1)" for subtests).
_UT_SECTION = re.compile(r"^(FAIL|ERROR): (\w+) \(([\w.]+)\)")
# pytest -rA summary: "PASSED path::test", "FAILED path::test - msg".
_PY_SUMMARY = re.compile(r"^(PASSED|FAILED|ERROR|XFAIL|XPASS|SKIPPED) (?![\[(])(\S.*?)(?: - .*)?$")
# pytest -v: "path::test PASSED [ 50%]".
_PY_VERBOSE = re.compile(r"^(\S+::\S.*?) (PASSED|FAILED|ERROR|XFAIL|XPASS|SKIPPED)\b")
_PY_STATUS = {"PASSED": "passed", "FAILED": "failed", "ERROR": "error", "XFAIL": "passed",
              "XPASS": "passed", "SKIPPED": "skipped"}


def _unittest_id(name: str, where: str) -> str:
    return where if where.endswith("." + name) else f"{where}.{name}"


def _unittest_status(rest: str) -> str | None:
    """The status at the end of a `... STATUS` tail, or None if the tail holds something else."""
    rest = rest.strip()
    if rest in _UT_STATUS:
        return _UT_STATUS[rest]
    if rest.startswith("skipped"):
        return "skipped"
    for word, status in _UT_STATUS.items():  # printed output may precede the status on the line
        if rest.endswith(" " + word) and word != "ok":
            return status
    return None


def parse_test_log(text: str) -> dict[str, str]:
    """Map each test id found in `text` to "passed", "failed", "error" or "skipped"."""
    out: dict[str, str] = {}
    pending: str | None = None  # a unittest test whose status has not been printed yet
    for raw in _ANSI.sub("", text).splitlines():
        line = raw.rstrip()
        if m := _UT_SECTION.match(line):
            out[_unittest_id(m.group(2), m.group(3))] = _UT_STATUS[m.group(1)]
            pending = None
            continue
        if m := _UT_HEAD.match(line):
            pending = _unittest_id(m.group(1), m.group(2))
            line = line[m.end():]
        if pending is not None:
            tail = line.split(" ... ", 1)[1] if " ... " in line else line
            status = _unittest_status(tail)
            if status is not None:
                out[pending] = status
                pending = None
            continue
        if m := _PY_SUMMARY.match(line):
            out[m.group(2).strip()] = _PY_STATUS[m.group(1)]
        elif m := _PY_VERBOSE.match(line):
            out[m.group(1)] = _PY_STATUS[m.group(2)]
    return out
