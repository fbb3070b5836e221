"""Score definitions, reward kinds, JUnit parsing and patch-path parsing of the commit-only grader."""

from __future__ import annotations

import pytest

from burstrl.envs.swe.grade import GradeResult, dotted_id, parse_junit_xml, patch_paths, reward_of, score
from burstrl.envs.swe.task import SweTask
from burstrl.envs.swe.testrun import cap_log, grading_command


def make_task(f2p: list[str], p2p: list[str], test_cmd: str = "python3 -m unittest -v") -> SweTask:
    return SweTask(instance_id="t1", repo="/nowhere", base_commit="HEAD", problem_statement="fix it",
                   FAIL_TO_PASS=f2p, PASS_TO_PASS=p2p, test_cmd=test_cmd)


def graded(statuses: dict[str, str], f2p: list[str], p2p: list[str]) -> GradeResult:
    return score(GradeResult(instance_id="t1", apply_ok=True), make_task(f2p, p2p), statuses)


def test_all_pass_is_resolved() -> None:
    r = graded({"a": "passed", "b": "passed", "c": "passed"}, ["a", "b"], ["c"])
    assert r.resolved and r.f2p == 1.0 and r.strict == 1.0
    assert (r.f2p_passed, r.f2p_total, r.p2p_failed, r.p2p_total) == (2, 2, 0, 1)
    assert [reward_of(r, k) for k in ("binary", "f2p", "strict")] == [1.0, 1.0, 1.0]
    assert r.parts() == {"resolved": True, "f2p": 1.0, "strict": 1.0, "apply_ok": True, "tampered": False,
                       "reset_files": 0}


def test_partial_target_gives_partial_credit_but_not_resolved() -> None:
    r = graded({"a": "passed", "b": "failed", "c": "passed"}, ["a", "b"], ["c"])
    assert not r.resolved and r.f2p == 0.5 and r.strict == 0.5
    assert [reward_of(r, k) for k in ("binary", "f2p", "strict")] == [0.0, 0.5, 0.5]


def test_broken_existing_test_zeroes_strict_only() -> None:
    r = graded({"a": "passed", "b": "passed", "c": "error"}, ["a", "b"], ["c"])
    assert not r.resolved and r.f2p == 1.0 and r.strict == 0.0 and r.p2p_failed == 1


def test_missing_and_skipped_tests_count_as_failed() -> None:
    r = graded({"a": "passed", "c": "skipped"}, ["a", "b"], ["c"])
    assert r.f2p_passed == 1 and r.p2p_failed == 1 and not r.resolved
    assert r.statuses == {"a": "passed", "b": "missing", "c": "skipped"}


def test_duplicate_ids_count_once() -> None:
    r = graded({"a": "passed"}, ["a", "a"], [])
    assert (r.f2p_passed, r.f2p_total, r.resolved) == (1, 1, True)


def test_no_target_tests_is_vacuously_complete() -> None:
    r = graded({"c": "passed"}, [], ["c"])
    assert r.resolved and r.f2p == 1.0


def test_reward_of_rejects_infra_errors_and_unknown_kinds() -> None:
    with pytest.raises(ValueError, match="infra"):
        reward_of(GradeResult(instance_id="t1", infra_error="sandbox did not start"))
    with pytest.raises(ValueError, match="unknown reward kind"):
        reward_of(GradeResult(instance_id="t1"), "pass@1")


def test_failed_apply_scores_zero() -> None:
    r = GradeResult(instance_id="t1", apply_ok=False, apply_error="patch does not apply")
    assert [reward_of(r, k) for k in ("binary", "f2p", "strict")] == [0.0, 0.0, 0.0]


PYTEST_JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" errors="1" failures="1" skipped="1" tests="5">
  <testcase classname="tests.test_a.TestX" name="test_ok" time="0.001"/>
  <testcase classname="tests.test_a" name="test_fail[p/1]" time="0.001">
    <failure message="assert 1 == 2">trace</failure></testcase>
  <testcase classname="tests.test_a" name="test_skip" time="0"><skipped message="no"/></testcase>
  <testcase classname="tests.test_a" name="test_teardown" time="0.001"/>
  <testcase classname="tests.test_a" name="test_teardown" time="0.001"><error message="boom"/></testcase>
</testsuite></testsuites>
"""


def test_parse_junit_xml_statuses_and_worst_wins() -> None:
    assert parse_junit_xml(PYTEST_JUNIT) == {
        "tests.test_a.TestX.test_ok": "passed",
        "tests.test_a.test_fail[p/1]": "failed",
        "tests.test_a.test_skip": "skipped",
        "tests.test_a.test_teardown": "error",
    }


def test_junit_statuses_match_pytest_ids() -> None:
    statuses = parse_junit_xml(PYTEST_JUNIT)
    r = score(GradeResult(instance_id="t1"),
              make_task(["tests/test_a.py::TestX::test_ok", "tests/test_a.py::test_fail[p/1]"], []), statuses)
    assert r.statuses == {"tests/test_a.py::TestX::test_ok": "passed", "tests/test_a.py::test_fail[p/1]": "failed"}
    assert dotted_id("pkg/tests/test_b.py::test_c[x::y]") == "pkg.tests.test_b.test_c[x::y]"


def test_patch_paths_cover_edits_creations_deletions_renames() -> None:
    patch = """diff --git a/src/m.py b/src/m.py
index 1..2 100644
--- a/src/m.py
+++ b/src/m.py
@@ -1 +1 @@
-a
+b
diff --git a/tests/new_test.py b/tests/new_test.py
new file mode 100644
--- /dev/null
+++ b/tests/new_test.py
@@ -0,0 +1 @@
+x
diff --git a/old.py b/gone.py
similarity index 100%
rename from old.py
rename to gone.py
diff --git a/img.png b/img.png
index 1..2 100644
GIT binary patch
"""
    assert patch_paths(patch) == ["src/m.py", "tests/new_test.py", "old.py", "gone.py", "img.png"]


def test_test_command_appends_quoted_unique_ids() -> None:
    task = make_task(["tests.t.A.test_1", "tests/x.py::test_y[a b]"], ["tests.t.A.test_1", "tests.t.B.test_2"])
    assert grading_command(task) == ("python3 -m unittest -v tests.t.A.test_1 'tests/x.py::test_y[a b]' "
                                  "tests.t.B.test_2")


def test_cap_log_keeps_head_and_tail() -> None:
    text = "H" * 100 + "M" * 1000 + "T" * 100
    capped = cap_log(text, cap=200)
    assert capped.startswith("H" * 100) and capped.endswith("T" * 100) and "1000 chars elided" in capped
    assert cap_log("short") == "short"


def test_graded_test_files_are_found_from_ids() -> None:
    from burstrl.envs.swe.grade import graded_test_files

    base = frozenset({"tests/test_calc.py", "pkg/tests/test_b.py", "src/calc.py"})
    task = make_task(["tests.test_calc.TestAdd.test_add", "pkg/tests/test_b.py::test_c[x.y]"],
                     ["tests.test_calc.TestMul.test_mul", "missing.mod.test_z"])
    assert graded_test_files(task, base) == ["tests/test_calc.py", "pkg/tests/test_b.py"]


def test_junit_path_from_the_test_command() -> None:
    from burstrl.envs.swe.testrun import junit_path

    assert junit_path(make_task([], [], "python3 -m pytest -rA --junitxml=out/r.xml")) == "/work/repo/out/r.xml"
    assert junit_path(make_task([], [], "pytest --junit-xml /tmp/r.xml -q")) == "/tmp/r.xml"
    assert junit_path(make_task([], [])) == ""
