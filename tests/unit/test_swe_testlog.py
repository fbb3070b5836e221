"""parse_test_log on real-shaped unittest -v and pytest -rA / -v output."""

from burstrl.envs.swe.testlog import parse_test_log

UNITTEST_311 = """\
test_basic (tests.test_core.TestClipPebble.test_basic) ... ok
test_edges (tests.test_core.TestClipPebble.test_edges) ... FAIL
test_boom (tests.test_core.TestClipPebble.test_boom) ... ERROR
test_later (tests.test_core.TestClipPebble.test_later) ... skipped 'not today'
test_known (tests.test_core.TestClipPebble.test_known) ... expected failure
test_lucky (tests.test_core.TestClipPebble.test_lucky) ... unexpected success
test_doc (tests.test_core.TestDoc.test_doc)
The first line of a docstring. ... ok
test_noisy (tests.test_core.TestDoc.test_noisy) ... printed by the test
ok

======================================================================
ERROR: test_boom (tests.test_core.TestClipPebble.test_boom)
----------------------------------------------------------------------
Traceback (most recent call last):
ZeroDivisionError: division by zero

======================================================================
FAIL: test_edges (tests.test_core.TestClipPebble.test_edges)
----------------------------------------------------------------------
AssertionError: False != True

----------------------------------------------------------------------
Ran 9 tests in 0.001s

FAILED (failures=1, errors=1, skipped=1, expected failures=1, unexpected successes=1)
"""


def test_unittest_311_format() -> None:
    got = parse_test_log(UNITTEST_311)
    p = "tests.test_core.TestClipPebble."
    assert got == {
        p + "test_basic": "passed", p + "test_edges": "failed", p + "test_boom": "error",
        p + "test_later": "skipped", p + "test_known": "xfailed", p + "test_lucky": "failed",
        "tests.test_core.TestDoc.test_doc": "passed", "tests.test_core.TestDoc.test_noisy": "passed",
    }


def test_unittest_older_format_names_the_class_only() -> None:
    text = ("test_a (tests.test_m.TestX) ... ok\ntest_b (tests.test_m.TestX) ... FAIL\n\n"
            "FAIL: test_b (tests.test_m.TestX)\n")
    assert parse_test_log(text) == {"tests.test_m.TestX.test_a": "passed", "tests.test_m.TestX.test_b": "failed"}


def test_unittest_failure_sections_alone_and_subtests() -> None:
    text = ("ERROR: test_mod (unittest.loader._FailedTest.test_mod)\n"
            "FAIL: test_sub (tests.test_m.TestX.test_sub) (i=2)\n")
    assert parse_test_log(text) == {"unittest.loader._FailedTest.test_mod": "error",
                                    "tests.test_m.TestX.test_sub": "failed"}


PYTEST_RA = """\
..FsE                                                                    [100%]
==================================== ERRORS ====================================
___________________________ ERROR at setup of test_e ___________________________
=========================== short test summary info ============================
PASSED tests/test_a.py::test_ok
PASSED tests/test_a.py::test_param[a - b]
FAILED tests/test_a.py::test_bad - AssertionError: assert 1 == 2
SKIPPED [1] tests/test_a.py:12: not today
ERROR tests/test_a.py::test_e - RuntimeError: fixture broke
XFAIL tests/test_a.py::test_known - reason: later
ERROR tests/test_b.py - ImportError: no module
==== 1 failed, 2 passed, 1 skipped, 1 xfailed, 2 errors in 0.05s ====
"""


def test_pytest_ra_summary() -> None:
    assert parse_test_log(PYTEST_RA) == {
        "tests/test_a.py::test_ok": "passed",
        "tests/test_a.py::test_param[a": "passed",  # " - " splits the message off, as SWE-bench does
        "tests/test_a.py::test_bad": "failed",
        "tests/test_a.py::test_e": "error",
        "tests/test_a.py::test_known": "xfailed",
        "tests/test_b.py": "error",
    }


def test_pytest_verbose_lines_and_colors() -> None:
    text = ("tests/test_a.py::test_ok PASSED                                   [ 33%]\n"
            "tests/test_a.py::test_skip SKIPPED (no reason)                    [ 66%]\n"
            "\x1b[31mtests/test_a.py::test_bad[1-2] FAILED\x1b[0m                [100%]\n")
    assert parse_test_log(text) == {"tests/test_a.py::test_ok": "passed", "tests/test_a.py::test_skip": "skipped",
                                    "tests/test_a.py::test_bad[1-2]": "failed"}


def test_empty_and_unrelated_text() -> None:
    assert parse_test_log("") == {}
    assert parse_test_log("Traceback (most recent call last):\n  boom\nRan 0 tests\n") == {}
