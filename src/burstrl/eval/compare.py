"""Paired comparison of two evaluations of the same tasks, with a bootstrap confidence interval.

Why paired and by task: tasks differ far more in difficulty than two checkpoints differ in skill,
so comparing overall means of two runs drowns the lift in task-to-task variance. Taking the
per-task difference first and resampling TASKS (not attempts) asks the right question: would the
lift hold on another draw of tasks like these?
"""

from __future__ import annotations

from typing import Any

import numpy as np

from burstrl.eval.passk import BASE_METRICS, pass_keys


def paired_bootstrap(
    a: dict[str, float],
    b: dict[str, float],
    iters: int = 10000,
    seed: int = 0,
    alpha: float = 0.05,
) -> dict[str, Any]:
    """Mean of a - b over the tasks both score, with a percentile bootstrap CI.

    The p-value is the bootstrap's sign test: the share of resampled mean differences on the far
    side of 0 (<= 0 for a positive lift, >= 0 for a negative one), doubled for two sides and capped
    at 1. It is an approximation good enough to say "significant or not", not an exact test.
    Tasks present in only one side are left out and counted, so a mismatch is visible.
    """
    shared = sorted(t for t in set(a) & set(b) if a[t] is not None and b[t] is not None)
    if not shared:
        raise ValueError("no task scored by both evaluations")
    diffs = np.array([float(a[t]) - float(b[t]) for t in shared])
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(diffs), size=(iters, len(diffs)))
    means = diffs[idx].mean(axis=1)
    lo, hi = np.quantile(means, [alpha / 2, 1 - alpha / 2])
    below, above = float(np.mean(means <= 0)), float(np.mean(means >= 0))
    return {
        "diff": float(diffs.mean()),
        "ci": [float(lo), float(hi)],
        "p_value": min(1.0, 2 * min(below, above)),
        "n_tasks": len(shared),
        "mean_a": float(np.mean([a[t] for t in shared])),
        "mean_b": float(np.mean([b[t] for t in shared])),
        "only_a": len(set(a) - set(b)),
        "only_b": len(set(b) - set(a)),
        "alpha": alpha,
        "iters": iters,
    }


def _summary_of(result: dict[str, Any]) -> dict[str, Any]:
    """Accept a results dict ({"summary": ...}) or a summary itself."""
    return result["summary"] if "summary" in result else result


def _kept_tasks(summary: dict[str, Any], dropped: set[str]) -> dict[str, dict[str, Any]]:
    return {tid: t for tid, t in summary["tasks"].items() if tid not in dropped and t.get("n", 0) > 0}


def default_metrics(tasks_a: dict[str, dict[str, Any]], tasks_b: dict[str, dict[str, Any]]) -> list[str]:
    """pass@1, f2p, strict, then every pass@k (k >= 2) that every task of both sides has.

    Without test grading (no task has f2p: toy environments) the mean reward replaces f2p and strict.
    """
    tests = any(t.get("f2p") is not None for t in list(tasks_a.values()) + list(tasks_b.values()))
    sets = [set(pass_keys(t)) for t in list(tasks_a.values()) + list(tasks_b.values())]
    common = set.intersection(*sets) if sets else set()
    extra = [k for k in sorted(common, key=lambda s: int(s[5:])) if k != "pass@1"]
    return (list(BASE_METRICS) if tests else ["pass@1", "reward"]) + extra


def compare_results(
    result_a: dict[str, Any],
    result_b: dict[str, Any],
    metrics: tuple[str, ...] | list[str] | None = None,
    iters: int = 10000,
    seed: int = 0,
    alpha: float = 0.05,
) -> dict[str, dict[str, Any]]:
    """Paired bootstrap of A - B for each metric, over tasks neither side excludes.

    A task flagged flawed by either evaluation is dropped from both, since a flawed task adds only
    noise to the difference. Metrics a side lacks for some task (e.g. pass@8 with 4 attempts) skip
    that task; a metric no task has on both sides is left out of the result.
    """
    sa, sb = _summary_of(result_a), _summary_of(result_b)
    dropped = set(sa.get("excluded", [])) | set(sb.get("excluded", []))
    tasks_a, tasks_b = _kept_tasks(sa, dropped), _kept_tasks(sb, dropped)
    out: dict[str, dict[str, Any]] = {}
    for metric in metrics or default_metrics(tasks_a, tasks_b):
        va = {tid: t[metric] for tid, t in tasks_a.items() if t.get(metric) is not None}
        vb = {tid: t[metric] for tid, t in tasks_b.items() if t.get(metric) is not None}
        if set(va) & set(vb):
            out[metric] = paired_bootstrap(va, vb, iters=iters, seed=seed, alpha=alpha)
    return out
