"""What a functions attempt costs to grade, and what it lets through: the old path (the SWE grader
running the hidden unittest file in the candidate's process, sealed) against the new one (the
candidate in a sandbox without tests or expected values, plain data back; issue 48).

In one run, on generated functions tasks (`tasks make-functions`, train split) in namespace
sandboxes, one grade at a time:
1. cost: each task's gold body and a wrong one (`return None`), graded both ways, interleaved task by
   task and round by round (the order alternates) so that machine noise hits both alike; the median
   seconds per attempt of each path and body, and new/old ratios;
2. hacks: every body of the battery (`envs/functions/hacks.py`: one per class the issue names, and
   the channel's own: forged lines, a killed runner, endless output, deep nesting, huge ints) on
   `--hack-tasks` tasks, both ways: how many (body, task) pairs earned reward, and which bodies;
3. honest: the gold body and the task's other correct body (`extra.variants`) of every task, both
   ways: how many resolved (some tasks expect an exception for some inputs).
The old path is exactly what `FunctionsEnv.rollout` did before: `envs/swe/grade.grade` on the
attempt's patch against the task repository (stubs and hidden tests), sealed, static scan "zero";
"old" is that grader as it is in this tree (the SWE seal keeps hardening: issue 48's other part),
and with `--before REV` also "before": the same call into the SWE grader of git revision REV (its
`src/` exported, run in a worker process that imports it), e.g. the commit the issue was found at.

    .venv/bin/python benchmarks/functions_grading.py            # 8 tasks x 3 rounds, hacks on 3 tasks
    .venv/bin/python benchmarks/functions_grading.py --quick    # 3 tasks x 1 round, hacks on 1 task
    .venv/bin/python benchmarks/functions_grading.py --before db17b67   # + the grader of that revision
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

WRONG = "    return None\n"
# The worker of `--before`: reads {"task", "patch", "timeout"} lines, grades each with the SWE grader
# it imports (the revision's), answers {"seconds", "reward", "resolved", "infra_error"} lines.
WORKER = """import json, sys, time
from burstrl.envs.swe.grade import grade, reward_of
from burstrl.envs.swe.task import SweTask
from burstrl.sandbox.pool import SandboxPool
pool = SandboxPool("namespace", max_concurrent=2)
for line in sys.stdin:
    job = json.loads(line)
    t0 = time.perf_counter()
    r = grade(SweTask.from_json(job["task"]), job["patch"], pool, timeout_s=job["timeout"], suspicious="zero")
    out = {"seconds": time.perf_counter() - t0, "reward": 0.0 if r.infra_error or r.model_error else reward_of(r, "f2p"),
           "resolved": r.resolved, "infra_error": r.infra_error}
    print(json.dumps(out), flush=True)
pool.close_all()
"""
Grader = Callable[[Any, str], tuple[float, float, bool]]  # (task, body) -> (seconds, reward, resolved)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tasks", type=int, default=8, help="tasks timed [8; quick 3]")
    p.add_argument("--rounds", type=int, default=3, help="grades of each body, each way [3; quick 1]")
    p.add_argument("--hack-tasks", type=int, default=3, help="tasks the hack battery runs on [3; quick 1]")
    p.add_argument("--timeout", type=float, default=20.0, help="an attempt's limit, every path [20 s]")
    p.add_argument("--before", default="", help="a git revision whose SWE grader is run beside (path 'before')")
    p.add_argument("--quick", action="store_true")
    args = p.parse_args()
    if args.quick:
        args.tasks, args.rounds, args.hack_tasks = 3, 1, 1

    from burstrl.envs.functions.hacks import HACKS
    from burstrl.envs.functions.tasks import make_function_tasks
    from burstrl.envs.swe.grade import base_tar
    from burstrl.sandbox.pool import SandboxPool

    out: dict[str, Any] = {"benchmark": "functions_grading", "tasks": args.tasks, "rounds": args.rounds,
                           "hack_tasks": args.hack_tasks, "timeout_s": args.timeout, "before": args.before}
    with tempfile.TemporaryDirectory(prefix="bench-fn-grading-") as tmp:
        tasks = make_function_tasks(Path(tmp) / "set", max(args.tasks, args.hack_tasks), seed=11, split="train")
        with SandboxPool("namespace", max_concurrent=2) as pool:
            paths: dict[str, Grader] = {"old": _old(pool, args.timeout), "new": _new(pool, args.timeout)}
            worker = _before_worker(args.before, Path(tmp)) if args.before else None
            if worker is not None:
                paths["before"] = _before(worker, args.timeout)
            try:
                base_tar(tasks[0])  # warm: the repository export (cached), the first sandboxes
                for grader in paths.values():
                    grader(tasks[0], gold_body(tasks[0]))
                out["seconds"] = _costs(tasks[: args.tasks], paths, args.rounds)
                out["hacks"] = _hacks(tasks[: args.hack_tasks], HACKS, paths)
                out["honest"] = _honest(tasks[: args.tasks], paths)
            finally:
                if worker is not None:
                    worker.stdin.close()  # type: ignore[union-attr]
                    worker.wait(timeout=60)
    print(json.dumps(out))


def _old(pool: Any, timeout: float) -> Grader:
    """The SWE grader of this tree on the attempt's patch, as `FunctionsEnv.rollout` called it before."""
    from burstrl.envs.swe.grade import grade, reward_of

    def run(task: Any, body: str) -> tuple[float, float, bool]:
        patch = old_patch(task, body)
        t0 = time.perf_counter()
        r = grade(task, patch, pool, timeout_s=timeout, suspicious="zero")
        seconds = time.perf_counter() - t0
        assert not r.infra_error, r.infra_error
        return seconds, 0.0 if r.model_error else reward_of(r, "f2p"), r.resolved
    return run


def _new(pool: Any, timeout: float) -> Grader:
    from burstrl.envs.functions.grade import grade, reward

    def run(task: Any, body: str) -> tuple[float, float, bool]:
        t0 = time.perf_counter()
        r = grade(task, task.extra["prompt"] + body, pool, timeout_s=timeout)
        seconds = time.perf_counter() - t0
        assert not r.infra_error, r.infra_error
        return seconds, reward(r), r.resolved
    return run


def _before_worker(rev: str, tmp: Path) -> subprocess.Popen[str]:
    """A process that imports burstrl as it was at `rev` (its `src/`, exported) and grades on request."""
    tree = tmp / f"before-{rev}"
    tree.mkdir()
    archive = subprocess.run(["git", "-C", str(REPO), "archive", rev, "src"], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    (tmp / "worker.py").write_text(WORKER)
    env = {**os.environ, "PYTHONPATH": str(tree / "src")}
    return subprocess.Popen([sys.executable, str(tmp / "worker.py")], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, env=env, cwd=tmp)


def _before(worker: subprocess.Popen[str], timeout: float) -> Grader:
    def run(task: Any, body: str) -> tuple[float, float, bool]:
        job = {"task": task.to_json(), "patch": old_patch(task, body), "timeout": timeout}
        worker.stdin.write(json.dumps(job) + "\n")  # type: ignore[union-attr]
        worker.stdin.flush()  # type: ignore[union-attr]
        got = json.loads(worker.stdout.readline())  # type: ignore[union-attr]
        assert not got["infra_error"], got["infra_error"]
        return got["seconds"], got["reward"], got["resolved"]
    return run


def old_patch(task: Any, body: str) -> str:
    from burstrl.envs.functions.grade import stub_source
    from burstrl.envs.functions.tasks import attempt_patch

    return attempt_patch(task.extra["file"], stub_source(task), task.extra["prompt"] + body)


def gold_body(task: Any) -> str:
    from burstrl.envs.functions.grade import stub_source
    from burstrl.envs.functions.tasks import apply_patch

    return apply_patch(stub_source(task), task.patch).removeprefix(task.extra["prompt"])


def _all(paths: dict[str, Grader], task: Any, body: str, turn: int = 0) -> dict[str, tuple[float, float, bool]]:
    """The body graded by every path, the order rotated by `turn` (noise hits each path alike)."""
    names = list(paths)
    names = names[turn % len(names):] + names[: turn % len(names)]
    return {name: paths[name](task, body) for name in names}


def _costs(tasks: list[Any], paths: dict[str, Grader], rounds: int) -> dict[str, Any]:
    """Median seconds per attempt, per path and body, interleaved; and each path against old."""
    times: dict[str, list[float]] = {f"{path}_{kind}": [] for path in paths for kind in ("gold", "wrong")}
    for rnd in range(rounds):
        for i, task in enumerate(tasks):
            for kind, body in (("gold", gold_body(task)), ("wrong", WRONG)):
                for path, (seconds, reward, _) in _all(paths, task, body, rnd + i).items():
                    assert reward == (1.0 if kind == "gold" else 0.0), (path, kind, task.instance_id, reward)
                    times[f"{path}_{kind}"].append(seconds)
    med = {key: round(statistics.median(v), 3) for key, v in times.items()}
    out: dict[str, Any] = {**{f"{key}_median": v for key, v in med.items()}, "n_each": len(times["old_gold"])}
    for path in paths:
        if path != "old":
            for kind in ("gold", "wrong"):
                out[f"{path}_vs_old_{kind}"] = round(med[f"{path}_{kind}"] / med[f"old_{kind}"], 3)
    return out


def _hacks(tasks: list[Any], hacks: dict[str, str], paths: dict[str, Grader]) -> dict[str, Any]:
    """(body, task) pairs that earned reward on each path, and the bodies that did."""
    won: dict[str, list[str]] = {path: [] for path in paths}
    for name, body in hacks.items():
        for task in tasks:
            for path, (_, reward, _) in _all(paths, task, body).items():
                if reward > 0:
                    won[path].append(name)
    out: dict[str, Any] = {"bodies": len(hacks), "pairs": len(hacks) * len(tasks)}
    for path, names in won.items():
        out[f"{path}_pairs_rewarded"] = len(names)
        out[f"{path}_bodies_rewarded"] = sorted(set(names))
    return out


def _honest(tasks: list[Any], paths: dict[str, Grader]) -> dict[str, Any]:
    """Gold and variant bodies of every task: how many resolve on each path."""
    from burstrl.envs.functions.grade import stub_source
    from burstrl.envs.functions.tasks import apply_patch

    bodies = [(t, gold_body(t)) for t in tasks]
    bodies += [(t, apply_patch(stub_source(t), v).removeprefix(t.extra["prompt"]))
               for t in tasks for v in t.extra.get("variants") or []]
    resolved = dict.fromkeys(paths, 0)
    for task, body in bodies:
        for path, (_, _, ok) in _all(paths, task, body).items():
            resolved[path] += ok
    raising = sum(any("raises" in c for c in t.extra["cases"]) for t in tasks)
    return {"bodies": len(bodies), "tasks_expecting_an_exception": raising,
            **{f"{path}_resolved": n for path, n in resolved.items()}}


if __name__ == "__main__":
    main()
