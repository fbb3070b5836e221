"""What screening a patch costs a graded attempt (issue 34): the diff policy and the static scan.

In one run, on toy SWE tasks (`tasks make-toy`, difficulty 1) in namespace sandboxes, one at a time:
- each task's gold patch graded (`grade`), the time of the whole grade and, inside it, of the two
  screening steps, timed by wrapping them: `policy_violation` (parsing the diff, the rules and,
  when the patch adds a new top-level module, one `python3 -I` probe in the grading sandbox) and
  `scan_changes` (each changed .py file read back from the sandbox and parsed, with its base);
- the same gold patch plus a new root module (`<task>_notes.py`, allowed by the task set's policy:
  toy repositories keep their code in a package), which makes the policy ask the sandbox's
  interpreter (the shadowing probe): the worst case an honest patch can cost;
- `diffpolicy.check` alone on every gold patch, many times: the pure rules' cost.

The reference is the same grade with the screening's measured time taken out, which is what
grading cost before it (the rest of `grade` is unchanged); both come from the same calls.

    .venv/bin/python benchmarks/grading_policy.py            # 8 tasks x 3 rounds
    .venv/bin/python benchmarks/grading_policy.py --quick    # 3 tasks x 1 round
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tasks", type=int, default=8, help="toy tasks [8; quick 3]")
    p.add_argument("--rounds", type=int, default=3, help="grades of each patch [3; quick 1]")
    p.add_argument("--quick", action="store_true")
    args = p.parse_args()
    if args.quick:
        args.tasks, args.rounds = 3, 1

    from burstrl.envs.swe import diffpolicy
    from burstrl.envs.swe import grade as grade_mod
    from burstrl.envs.swe.diffpolicy import DiffPolicy
    from burstrl.envs.swe.grade import base_tar, grade
    from burstrl.envs.swe.toygen import make_toy_tasks
    from burstrl.sandbox.pool import SandboxPool

    spent: list[float] = []

    def timed(real):  # instrumentation: the screening steps' own time inside each grade
        def call(*a, **kw):
            t0 = time.perf_counter()
            try:
                return real(*a, **kw)
            finally:
                spent.append(time.perf_counter() - t0)
        return call

    grade_mod.policy_violation = timed(grade_mod.policy_violation)
    grade_mod.scan_changes = timed(grade_mod.scan_changes)
    with tempfile.TemporaryDirectory(prefix="bench-policy-") as tmp:
        tasks = make_toy_tasks(Path(tmp) / "toy", args.tasks, seed=3, difficulty=1)
        rows: dict[str, list[tuple[float, float]]] = {"gold": [], "gold+new_module": []}
        with SandboxPool("namespace", max_concurrent=2) as pool:
            for task in tasks:  # warm: base export cached, first sandbox start
                base_tar(task)
            grade(tasks[0], tasks[0].patch, pool, timeout_s=120)
            for _ in range(args.rounds):
                for task in tasks:
                    name = f"{task.instance_id.replace('-', '_')}_notes"
                    extra = _with_new_module(task.patch, name)
                    allow = DiffPolicy(allow=(f"{name}.py",))  # toy repos have no root module: allowed here
                    for kind, patch, policy in (("gold", task.patch, None), ("gold+new_module", extra, allow)):
                        spent.clear()
                        t0 = time.perf_counter()
                        r = grade(task, patch, pool, timeout_s=120, policy=policy)
                        wall = time.perf_counter() - t0
                        assert r.resolved and not r.tampered, (kind, r.reason, r.infra_error)
                        rows[kind].append((wall, sum(spent)))
        files = [frozenset(base_tar(task)[2]) for task in tasks]
        t0 = time.perf_counter()
        n = 0
        for _ in range(200):
            for task, base_files in zip(tasks, files, strict=True):
                diffpolicy.check(task.patch, base_files, {"tests"}, DiffPolicy())
                n += 1
        pure_us = (time.perf_counter() - t0) / n * 1e6
    out = {"benchmark": "grading_policy", "tasks": args.tasks, "rounds": args.rounds,
           "rules_only_us_per_patch": round(pure_us, 1)}
    for kind, vals in rows.items():
        walls, pol = [w for w, _ in vals], [s for _, s in vals]
        out[kind] = {"grade_s_median": round(statistics.median(walls), 3),
                     "policy_s_median": round(statistics.median(pol), 4),
                     "without_policy_s_median": round(statistics.median(w - s for w, s in vals), 3),
                     "with_vs_without": round(statistics.median(walls) / statistics.median(w - s for w, s in vals), 4),
                     "n": len(vals)}
    print(json.dumps(out))


def _with_new_module(patch: str, name: str) -> str:
    """`patch` plus a new root-level module `name.py` (a git diff of a new file)."""
    add = (f"diff --git a/{name}.py b/{name}.py\nnew file mode 100644\n--- /dev/null\n+++ b/{name}.py\n"
           "@@ -0,0 +1 @@\n+NOTES = 'written by the fix'\n")
    return patch + ("" if patch.endswith("\n") else "\n") + add


if __name__ == "__main__":
    main()
