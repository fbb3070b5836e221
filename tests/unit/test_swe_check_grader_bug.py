"""`burstrl tasks check` never calls an honest gold patch tampered silently (issue 48): when the sealed
run refuses the gold patch (or the run without any patch) at code that is not the gold patch's, the
problem says it is a grader bug to report, with the seal's rule and where it fired, and the table
gives such a task its own status instead of FLAWED."""

from __future__ import annotations

from burstrl.envs.swe.check import GRADER_BUG, CheckResult, _sealed_tamper_problem, format_results
from burstrl.envs.swe.grade import GradeResult

GOLD = """diff --git a/boltons/strutils.py b/boltons/strutils.py
--- a/boltons/strutils.py
+++ b/boltons/strutils.py
@@ -227,2 +227,4 @@
         singular = word[:-2]
+    elif word.endswith('ss'):
+        return orig_word
     else:
"""
PLUGGY = ("sealed run forged_message: a seal message not sent by the seal's own reporting "
          "(from /work/.pydeps/pluggy/_execution.py:45)")


def _sealed_tampered(tampered: str) -> GradeResult:
    """A gold patch's result as `grade` leaves it when the seal refuses the run."""
    result = GradeResult(instance_id="boltons-1", apply_ok=True, sealed=True)
    result.tampered = tampered
    result.fail(f"tampered: {tampered}")
    return result


def test_a_sealed_tamper_outside_the_gold_patch_is_a_grader_bug_with_its_rule_and_place() -> None:
    gold = _sealed_tampered(PLUGGY)
    problem = _sealed_tamper_problem(GOLD, "with the gold patch", gold.tampered)
    assert problem.startswith(GRADER_BUG) and "report" in problem
    assert "rule forged_message at /work/.pydeps/pluggy/_execution.py:45" in problem
    assert PLUGGY in problem  # the seal's own words, whole


def test_a_sealed_tamper_in_the_gold_patchs_own_code_is_the_tasks_problem() -> None:
    """Where the seal names a file the gold patch changes, the fix itself reaches for a refused
    primitive: not a grader bug, and said plainly."""
    tampered = "sealed run frame_access: sys._getframe called by the patch's code (from /work/repo/boltons/strutils.py:230)"
    problem = _sealed_tamper_problem(GOLD, "with the gold patch", tampered)
    assert not problem.startswith(GRADER_BUG)
    assert "gold patch's own code" in problem and "rule frame_access at /work/repo/boltons/strutils.py:230" in problem


def test_a_sealed_tamper_without_any_patch_is_always_a_grader_bug() -> None:
    tampered = "sealed run runner_patched: the runner's _pytest.debugging.pytestPDB._pluginmanager changed (from ?)"
    problem = _sealed_tamper_problem("", "without any patch", tampered)
    assert problem.startswith(GRADER_BUG) and "without any patch" in problem and "rule runner_patched at ?" in problem


def test_the_table_gives_a_grader_bug_its_own_status() -> None:
    bug = CheckResult("real-1", ok=False, problems=[_sealed_tamper_problem(GOLD, "with the gold patch", PLUGGY)])
    flawed = CheckResult("toy-2", ok=False, problems=["FAIL_TO_PASS t passes at the base"])
    fine = CheckResult("toy-3", ok=True)
    lines = format_results([bug, flawed, fine]).splitlines()
    assert lines[1].split()[:3] == ["real-1", "GRADER", "BUG"]
    assert lines[3].split()[:2] == ["toy-2", "FLAWED"]
    assert lines[5].split()[:2] == ["toy-3", "ok"]
    assert lines[-1].startswith("1 ok, 2 flawed, 3 tasks; 1 of them by a grader bug")
    assert format_results([fine]).splitlines()[-1] == "1 ok, 0 flawed, 1 tasks"
