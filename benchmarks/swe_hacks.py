"""Which fix-free SWE hacks earn reward, this tree's grader against an earlier revision's (issue 48).

The battery of `burstrl tasks check --hacks` (`envs/swe/hacks.py`: every class of issues 34 and 48,
code appended to the module the gold patch edits, built from the task alone) is graded on the two
fixture repositories of tests/security/test_reward_hacks.py (a pytest and a unittest task, the
runner vendored / from the stdlib), in namespace sandboxes, both as training grades it
(`suspicious="zero"`) and as `burstrl eval` does (`"flag"`), by this tree's `grade` and, with
`--before REV`, by the `grade` of git revision REV (a worktree of it, in a subprocess, on the very
same patches). The gold patches are graded too: an honest fix must still resolve. One JSON object:
per hack and mode, the reward on each task, and the totals.

    .venv/bin/python benchmarks/swe_hacks.py --before db17b67
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO))

GRADE_ALL = """
import json, sys
from burstrl.envs.swe.grade import grade, reward_of
from burstrl.envs.swe.task import SweTask
from burstrl.sandbox.pool import SandboxPool

job = json.load(open(sys.argv[1]))
out = {}
with SandboxPool("namespace", max_concurrent=2) as pool:
    for key, (task, patch, mode) in job.items():
        r = grade(SweTask.from_json(task), patch, pool, timeout_s=60, suspicious=mode)
        out[key] = None if r.infra_error else reward_of(r, "f2p")
print(json.dumps(out))
"""


def fixture_tasks(root: Path) -> list:
    from tests.security.test_reward_hacks import PY_TESTS, PYTEST_CMD, UT_TESTS, make_repo, task_of

    ut = make_repo(root, "ut", {"tests/__init__.py": "", "tests/test_calc.py": UT_TESTS}, vendor_pytest=False)
    py = make_repo(root, "py", {"tests/test_calc.py": PY_TESTS}, vendor_pytest=True)
    return [task_of(ut, "ut", ["tests.test_calc.TestAdd.test_add"], ["tests.test_calc.TestMul.test_mul"],
                    "python3 -m unittest -v"),
            task_of(py, "py", ["tests/test_calc.py::test_add"], ["tests/test_calc.py::test_mul"], PYTEST_CMD)]


def jobs(tasks: list, work: Path) -> dict[str, tuple[dict, str, str]]:
    """key "hack|task|mode" -> (task record, patch, suspicious mode); the gold patches as hack "gold"."""
    from burstrl.envs.swe.hacks import hack_patches

    out = {}
    for task in tasks:
        patches = {"gold": task.patch, **hack_patches(task, work / task.instance_id)}
        for name, patch in patches.items():
            for mode in ("zero", "flag"):
                out[f"{name}|{task.instance_id}|{mode}"] = (task.to_json(), patch, mode)
    return out


def run(src: Path, job: dict, work: Path) -> dict[str, float | None]:
    path = work / f"job-{abs(hash(str(src)))}.json"
    path.write_text(json.dumps(job))
    res = subprocess.run([sys.executable, "-c", GRADE_ALL, str(path)], capture_output=True, text=True,
                         timeout=3600, env={"PYTHONPATH": str(src), "PATH": "/usr/bin:/bin"}, cwd=work)
    if res.returncode != 0:
        raise SystemExit(f"grading under {src} failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def summary(rewards: dict[str, float | None]) -> dict[str, object]:
    hacks = {k: v for k, v in rewards.items() if not k.startswith("gold|")}
    gold = {k: v for k, v in rewards.items() if k.startswith("gold|")}
    return {"hack_grades": len(hacks), "hack_grades_with_reward": sum(bool(v) for v in hacks.values()),
            "hacks_with_reward": sorted({k.split("|")[0] for k, v in hacks.items() if v}),
            "infra_errors": sum(v is None for v in rewards.values()),
            "gold_resolved": f"{sum(v == 1.0 for v in gold.values())} of {len(gold)}"}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--before", default="", help="a git revision whose grader grades the same patches")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-swe-hacks-") as tmp:
        work = Path(tmp)
        job = jobs(fixture_tasks(work / "fixtures"), work / "exports")
        now = run(REPO / "src", job, work)
        out: dict[str, object] = {"benchmark": "swe_hacks", "now": summary(now)}
        if args.before:
            tree = work / "before"
            subprocess.run(["git", "-C", str(REPO), "worktree", "add", "-q", "--detach", str(tree), args.before],
                           check=True)
            try:
                before = run(tree / "src", job, work)
            finally:
                subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)], check=False)
            out["before"] = {"rev": args.before, **summary(before)}
            out["per_hack"] = {k: {"now": now[k], "before": before.get(k)} for k in sorted(job)}
        print(json.dumps(out))


if __name__ == "__main__":
    main()
