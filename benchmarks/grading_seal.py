"""What the sealed test run costs a graded attempt (issue 34), against the unsealed run it replaces.

In one run, on toy SWE tasks (`tasks make-toy`, difficulty 1: `python3 -m unittest` suites) in
namespace sandboxes, one grade at a time: each task's gold patch graded sealed (`grade(...)`, the
default) and unsealed (`grade(..., seal=False)`: the end-marker wrapper and log checks), the two
interleaved task by task and round by round so that machine noise hits both alike. Reported: the
median whole-grade time and the median test-command time (`test_seconds`: the runner alone, where
the seal's bootstrap, audit hook and collector live) of each, and their ratios. Both gradings must
agree (resolved, no tamper verdict), which is also what `tests/security` checks.

And the per-test cost on pytest, where the seal checks the runner's ~3,500 functions and classes at
every report: a generated file of `--many` trivial tests run on the host by this venv's pytest,
plainly (`python -m pytest`) and through the seal's bootstrap, interleaved, median of 3 each; with
`--before REV`, also through the bootstrap of git revision REV (`sealboot.py` as it was there: the
seal before a change, measured beside it).

    .venv/bin/python benchmarks/grading_seal.py            # 8 tasks x 3 rounds
    .venv/bin/python benchmarks/grading_seal.py --quick    # 3 tasks x 1 round
    .venv/bin/python benchmarks/grading_seal.py --before db17b67   # + the seal of that revision
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
    p.add_argument("--rounds", type=int, default=3, help="grades of each patch, each way [3; quick 1]")
    p.add_argument("--many", type=int, default=300, help="trivial pytest tests for the per-test cost [300]")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--before", default="", help="a git revision whose seal is timed beside this one (per test)")
    args = p.parse_args()
    if args.quick:
        args.tasks, args.rounds = 3, 1
    per_test = _pytest_per_test(args.many, _bootstrap_at(args.before) if args.before else None)

    from burstrl.envs.swe.grade import base_tar, grade
    from burstrl.envs.swe.toygen import make_toy_tasks
    from burstrl.sandbox.pool import SandboxPool

    rows: dict[str, list[tuple[float, float]]] = {"sealed": [], "unsealed": []}
    with tempfile.TemporaryDirectory(prefix="bench-seal-") as tmp:
        tasks = make_toy_tasks(Path(tmp) / "toy", args.tasks, seed=3, difficulty=1)
        with SandboxPool("namespace", max_concurrent=2) as pool:
            for task in tasks:  # warm: base export cached, first sandbox start
                base_tar(task)
            grade(tasks[0], tasks[0].patch, pool, timeout_s=120)
            for rnd in range(args.rounds):
                for i, task in enumerate(tasks):
                    order = ("sealed", "unsealed") if (rnd + i) % 2 == 0 else ("unsealed", "sealed")
                    for kind in order:
                        t0 = time.perf_counter()
                        r = grade(task, task.patch, pool, timeout_s=120, seal=kind == "sealed")
                        wall = time.perf_counter() - t0
                        assert r.resolved and not r.tampered and r.sealed == (kind == "sealed"), \
                            (kind, r.reason, r.infra_error, r.seal_off)
                        rows[kind].append((wall, r.test_seconds))
    out: dict[str, object] = {"benchmark": "grading_seal", "tasks": args.tasks, "rounds": args.rounds,
                              "pytest_many": per_test}
    for kind, vals in rows.items():
        out[kind] = {"grade_s_median": round(statistics.median(w for w, _ in vals), 3),
                     "tests_s_median": round(statistics.median(t for _, t in vals), 3), "n": len(vals)}
    sealed, unsealed = out["sealed"], out["unsealed"]
    out["grade_sealed_vs_unsealed"] = round(sealed["grade_s_median"] / unsealed["grade_s_median"], 3)
    out["tests_sealed_vs_unsealed"] = round(sealed["tests_s_median"] / unsealed["tests_s_median"], 3)
    print(json.dumps(out))


def _bootstrap_at(rev: str) -> dict[str, str]:
    """The seal's bootstrap files at git revision `rev` (one file before the trust rule was split out)."""
    import subprocess

    def show(name: str) -> str | None:
        r = subprocess.run(["git", "-C", str(REPO), "show", f"{rev}:src/burstrl/envs/swe/{name}"],
                           capture_output=True, text=True)
        return r.stdout if r.returncode == 0 else None

    files = {"seal.py": show("sealboot.py"), "sealhook.py": show("sealhook.py"), "sealtrust.py": show("sealtrust.py")}
    if files["seal.py"] is None:
        raise SystemExit(f"no sealboot.py at {rev}")
    return {k: v for k, v in files.items() if v is not None}


def _pytest_per_test(n: int, before: dict[str, str] | None) -> dict[str, float]:
    """Plain vs sealed pytest on `n` trivial tests, on the host: seconds (median of 3) and the
    sealed run's extra milliseconds per test (and the `before` bootstrap's, when given)."""
    import subprocess

    from burstrl.envs.swe.seal import BOOTSTRAP, read_verdict

    with tempfile.TemporaryDirectory(prefix="bench-seal-py-") as tmp:
        repo = Path(tmp) / "repo"
        repo.mkdir()
        (repo / "test_many.py").write_text("".join(f"def test_{i}():\n    assert {i} == {i}\n\n" for i in range(n)))
        boots = {"sealed": BOOTSTRAP, **({"sealed_before": before} if before else {})}
        dirs = {kind: Path(tmp) / kind for kind in boots}
        env = {"PATH": "/usr/bin:/bin", "PYTHONDONTWRITEBYTECODE": "1"}
        args = ["-q", "-p", "no:cacheprovider", "test_many.py"]
        kinds = ["plain", *boots]
        times: dict[str, list[float]] = {kind: [] for kind in kinds}
        for rnd in range(3):
            for kind in kinds[rnd % len(kinds):] + kinds[:rnd % len(kinds)]:
                cmd = [sys.executable, "-m", "pytest", *args]
                if kind != "plain":
                    rdir = dirs[kind]
                    if not rdir.exists():
                        rdir.mkdir(mode=0o700)
                        for name, text in boots[kind].items():
                            (rdir / name).write_text(text)
                    (rdir / "changed").write_text("")
                    (rdir / "tests").write_text("test_many.py\n")
                    cmd = [sys.executable, str(rdir / "seal.py"), str(rdir), str(Path(tmp) / "log"), "pytest", *args]
                t0 = time.perf_counter()
                res = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True, timeout=600)
                times[kind].append(time.perf_counter() - t0)
                if kind != "plain":
                    verdict = read_verdict(res.stdout)
                    assert verdict and verdict["complete"] and not verdict["tampered"] \
                        and len(verdict["statuses"]) == n, res.stdout[-500:]
    med = {kind: statistics.median(v) for kind, v in times.items()}
    out = {"tests": n, **{f"{kind}_s": round(v, 3) for kind, v in med.items()}}
    for kind in boots:
        out[f"{kind}_vs_plain"] = round(med[kind] / med["plain"], 3)
        out[f"{kind}_extra_ms_per_test"] = round((med[kind] - med["plain"]) / n * 1e3, 3)
    return out


if __name__ == "__main__":
    main()
