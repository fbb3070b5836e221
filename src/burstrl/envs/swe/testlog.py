"""Per-test status from a test run's output: unittest `-v` and pytest `-rA` / `-v`.

Why parse text: the grader and `tasks check` run whatever `test_cmd` a task names inside a
sandbox and get its output back; the output is all they have. Statuses are "passed", "failed",
"error", "skipped", "xfailed" and "xpassed" (pytest's XFAIL / XPASS, unittest's expected
failure): not passes by themselves; the grader credits them only where the gold patch's run shows
the same outcome (`grade.score`), so a plugin that marks every test xfail earns nothing. Where two lines speak of one test (the `-v` line and the failure section, or
pytest's PASSED for the call and ERROR for its teardown) the worst status wins: the code under test
writes into the same output, and a line it prints must never turn the runner's FAILED into a pass
(see `integrity`).

unittest ids are `module.Class.method` (the form `python3 -m unittest` accepts back). Python 3.11+
prints `test_y (tests.test_mod.TestX.test_y) ... ok`, older versions `test_y (tests.test_mod.TestX)`;
both give `tests.test_mod.TestX.test_y`. pytest ids are `path::test[param]`. pytest's short
summary reports skips by location (`SKIPPED [1] path:12: reason`), not by id, so those are only
seen with `-v` (`path::test SKIPPED`).
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET

# Higher is worse: when one test id is reported twice, the worst wins.
SEVERITY = {"error": 4, "failed": 3, "skipped": 2, "xfailed": 2, "xpassed": 1, "passed": 0}
EXPECTED = frozenset({"xfailed", "xpassed"})  # outcomes a test's xfail marker produced

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
# unittest -v: "test_y (tests.test_mod.TestX.test_y) ... ok" (the docstring line may sit between).
_UT_HEAD = re.compile(r"^(\w+) \(([\w.]+)\)")
_UT_STATUS = {"ok": "passed", "FAIL": "failed", "ERROR": "error", "expected failure": "xfailed",
              "unexpected success": "failed"}
# unittest failure sections: "FAIL: test_y (tests.test_mod.TestX.test_y)" (+ " (i=1)" for subtests).
_UT_SECTION = re.compile(r"^(FAIL|ERROR): (\w+) \(([\w.]+)\)")
# pytest -rA summary: "PASSED path::test", "FAILED path::test - msg".
_PY_SUMMARY = re.compile(r"^(PASSED|FAILED|ERROR|XFAIL|XPASS|SKIPPED) (?![\[(])(\S.*?)(?: - .*)?$")
# pytest -v: "path::test PASSED [ 50%]".
_PY_VERBOSE = re.compile(r"^(\S+::\S.*?) (PASSED|FAILED|ERROR|XFAIL|XPASS|SKIPPED)\b")
_PY_STATUS = {"PASSED": "passed", "FAILED": "failed", "ERROR": "error", "XFAIL": "xfailed",
              "XPASS": "xpassed", "SKIPPED": "skipped"}


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


class _Worst(dict):
    """A dict where setting a key keeps the worse of the old and the new status."""

    def __setitem__(self, key: str, status: str) -> None:
        if SEVERITY[status] >= SEVERITY.get(self.get(key, "passed"), 0):
            super().__setitem__(key, status)


def parse_test_log(text: str) -> dict[str, str]:
    """Map each test id found in `text` to its status (see the module docstring; worst wins)."""
    out: dict[str, str] = _Worst()
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
    return dict(out)


def status_of(statuses: dict[str, str], test_id: str) -> str:
    """A test's status, "missing" when absent; a pytest id also matches its dotted JUnit form."""
    if test_id in statuses:
        return statuses[test_id]
    return statuses.get(dotted_id(test_id), "missing")


def dotted_id(test_id: str) -> str:
    """`tests/test_a.py::TestX::test_y[p/1]` -> `tests.test_a.TestX.test_y[p/1]`: the
    classname.name form JUnit reports use, so one lookup serves pytest and unittest ids."""
    head, bracket, params = test_id.partition("[")
    head = head.replace("::", ".").replace("/", ".").replace(".py.", ".")
    return head + bracket + params


def parse_junit_xml(text: str) -> dict[str, str]:
    """Per-test status from a JUnit XML report (pytest `--junitxml`, or any xunit writer).

    Keys are `classname.name` (pytest's classname is the dotted module path plus class), so they
    match unittest ids directly and pytest ids through `dotted_id`. An expected failure (pytest
    writes it as skipped of type `pytest.xfail`) is "xfailed", as in the log; JUnit has no
    unexpected-pass form (pytest writes XPASS as a pass), so `coarse` compares the two sources.
    """
    out: dict[str, str] = _Worst()
    for case in ET.fromstring(text).iter("testcase"):
        name = case.get("name", "")
        classname = case.get("classname", "")
        out[f"{classname}.{name}" if classname else name] = _junit_status(case)
    return dict(out)


def _junit_status(case: ET.Element) -> str:
    tags = {child.tag: child for child in case}
    if "error" in tags:
        return "error"
    if "failure" in tags:
        return "failed"
    if "skipped" in tags:
        return "xfailed" if tags["skipped"].get("type") == "pytest.xfail" else "skipped"
    return "passed"


def coarse(status: str) -> str:
    """A status as a report without xfail outcomes can state it: "xfailed"/"xpassed" -> "passed"."""
    return "passed" if status in EXPECTED else status
