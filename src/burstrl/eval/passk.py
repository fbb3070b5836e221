"""Pass@k and per-task / overall scores of an evaluation, from one record per attempt.

Why records and not running totals: an evaluation is K attempts on each of N tasks, graded one by
one, possibly retried; keeping every attempt (with its log path) lets the summary be recomputed
later with another exclude list or other k, and lets `--compare` pair tasks across two runs.

Infra failures (sandbox died, image missing, grader timeout: `infra_error` set) are not the
model's fault and are retried by the runner, so they are counted apart and EXCLUDED from n: a task
with 8 good attempts and 2 infra failures has n = 8. Apply failures (the agent's patch does not
apply) ARE the model's fault: they count in n as unresolved attempts with score 0.

Records of environments not graded by tests (toy, toy_multi) have no f2p / strict: those
metrics are None in the summary, and `parts` holds the mean of each named part of the reward.

Reward hacking is counted, not hidden: `tampered` (the grader caught forged test results),
`reset_files` (attempts whose patch touched tests or test configuration, reset before grading)
and `reasons` (named model failures by kind: `tampered`, `tests_timeout`, `sandbox_lost`, ...).
A policy that starts gaming the grader shows up in these columns before it shows anywhere else.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Iterable

BASE_METRICS = ("pass@1", "f2p", "strict")


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased estimate of P(at least one of k attempts resolves), from c resolved of n.

    Chen et al. 2021: 1 - C(n-c, k) / C(n, k). The binomials overflow floats for large n, so it is
    computed as the product 1 - prod_{i=n-c+1..n} (1 - k/i). When n - c < k every k-subset holds a
    resolved attempt, so the estimate is exactly 1.
    """
    if not 0 <= c <= n:
        raise ValueError(f"need 0 <= c <= n, got n={n} c={c}")
    if not 1 <= k <= n:
        raise ValueError(f"need 1 <= k <= n, got n={n} k={k}")
    if n - c < k:
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


@dataclass
class AttemptRecord:
    """One graded attempt on one task: what `burstrl eval` writes, one per attempt."""

    task_id: str
    attempt: int
    resolved: bool = False
    f2p: float | None = None  # share of target tests passed: environments graded by tests only (swe)
    strict: float | None = None
    apply_ok: bool = True
    infra_error: str | None = None
    reason: str = ""  # "kind: why" of a named model failure (tampered, tests_timeout, sandbox_lost, ...)
    reward: float = 0.0
    log_path: str = ""
    duration_s: float = 0.0
    parts: dict[str, float] = field(default_factory=dict)  # the reward's named parts (Outcome.parts)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def is_infra_failure(self) -> bool:
        return bool(self.infra_error)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> AttemptRecord:
        """Build from a JSON dict; unknown keys go to `extra` so newer files still load."""
        known = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in data.items() if k in known}
        unknown = {k: v for k, v in data.items() if k not in known}
        record = cls(**kwargs)
        record.extra = {**record.extra, **unknown}
        return record


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def summarize_task(records: list[AttemptRecord], ks: Iterable[int] | None = None) -> dict[str, Any]:
    """Scores of one task: n and c count only non-infra attempts; pass@k for each k <= n."""
    good = [r for r in records if not r.is_infra_failure]
    n, c = len(good), sum(1 for r in good if r.resolved)
    wanted = range(1, n + 1) if ks is None else sorted(k for k in set(ks) if 1 <= k <= n)
    task: dict[str, Any] = {"n": n, "c": c}
    for k in wanted:
        task[f"pass@{k}"] = pass_at_k(n, c, k)
    if n and "pass@1" not in task:
        task["pass@1"] = c / n  # pass@1 is always reported: it is the headline
    task["f2p"] = _mean([float(r.f2p) for r in good if r.f2p is not None])  # None: not graded by tests
    task["strict"] = _mean([float(r.strict) for r in good if r.strict is not None])
    task["reward"] = _mean([float(r.reward) for r in good])
    names = sorted({name for r in good for name in r.parts})
    task["parts"] = {name: _mean([float(r.parts[name]) for r in good if name in r.parts]) for name in names}
    task["apply_failures"] = sum(1 for r in good if not r.apply_ok)
    task["infra_failures"] = len(records) - n
    kinds = [reason_kind(r) for r in good]
    task["tampered"] = sum(1 for k in kinds if k.split("/", 1)[0] == "tampered")
    task["reset_files"] = sum(1 for r in good if r.extra.get("reset_files"))
    task["reasons"] = {k: kinds.count(k) for k in sorted(set(kinds) - {""})}
    flagged = [sorted({f.rsplit(": ", 1)[-1] for f in r.extra.get("suspicious") or []}) for r in good]
    task["suspicious"] = {rule: sum(rule in f for f in flagged) for rule in sorted({x for f in flagged for x in f})}
    return task


def reason_kind(record: AttemptRecord) -> str:
    """The kind of a named model failure ("tampered" of "tampered: ..."), "" for none; a patch the
    diff policy or the sealed run refused is "tampered/<rule>" and one the static scan zeroed "suspicious/<rule>"
    (per rule, so a policy that starts probing shows)."""
    reason = record.reason or str(record.extra.get("reason") or "")
    if not reason:
        return ""
    kind, _, rest = reason.partition(":")
    kind = kind.strip()
    m = re.match(r"\s*(?:diff policy|sealed run) (\w+):", rest)
    if kind == "tampered" and m:
        return f"tampered/{m.group(1)}"
    if kind == "suspicious" and rest.strip():  # "suspicious: path: rule, path: rule": the first rule
        return f"suspicious/{rest.split(',', 1)[0].rsplit(': ', 1)[-1].strip()}"
    return kind


def pass_keys(task: dict[str, Any]) -> list[str]:
    """The task's pass@k keys, sorted by k."""
    ks = sorted(int(key[5:]) for key in task if key.startswith("pass@"))
    return [f"pass@{k}" for k in ks]


def summarize_overall(tasks: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Means over tasks (each task weighs the same, whatever its n).

    Tasks with no valid attempt (all infra failures) cannot be scored; they are counted in
    `tasks_without_attempts` and left out of the means. Overall pass@k is reported only for k that
    every scored task has (k <= the smallest n), so each pass@k averages the same set of tasks.
    """
    scored = {tid: t for tid, t in tasks.items() if t["n"] > 0}
    common = set.intersection(*(set(pass_keys(t)) for t in scored.values())) if scored else set()
    overall: dict[str, Any] = {
        "n_tasks": len(scored),
        "tasks_without_attempts": len(tasks) - len(scored),
        "attempts": sum(t["n"] for t in tasks.values()),
        "resolved": sum(t["c"] for t in tasks.values()),
    }
    for key in sorted(common, key=lambda s: int(s[5:])):
        overall[key] = _mean([t[key] for t in scored.values()])
    for key in ("f2p", "strict", "reward"):
        overall[key] = _mean([t[key] for t in scored.values() if t.get(key) is not None])
    names = sorted({name for t in scored.values() for name in t.get("parts", {})})
    overall["parts"] = {name: _mean([t["parts"][name] for t in scored.values() if name in t.get("parts", {})])
                        for name in names}
    overall["apply_failures"] = sum(t["apply_failures"] for t in tasks.values())
    overall["infra_failures"] = sum(t["infra_failures"] for t in tasks.values())
    overall["tampered"] = sum(t.get("tampered", 0) for t in tasks.values())
    overall["reset_files"] = sum(t.get("reset_files", 0) for t in tasks.values())
    reasons: dict[str, int] = {}
    for t in tasks.values():
        for kind, count in t.get("reasons", {}).items():
            reasons[kind] = reasons.get(kind, 0) + count
    overall["reasons"] = dict(sorted(reasons.items()))
    suspicious: dict[str, int] = {}  # attempts whose changed code the static scan flagged, per rule
    for t in tasks.values():
        for rule, count in t.get("suspicious", {}).items():
            suspicious[rule] = suspicious.get(rule, 0) + count
    overall["suspicious"] = dict(sorted(suspicious.items()))
    return overall


def summarize(
    records: Iterable[AttemptRecord | dict[str, Any]],
    ks: Iterable[int] | None = None,
    exclude: Iterable[str] | None = None,
) -> dict[str, Any]:
    """Per-task and overall scores; `exclude` drops flawed task ids from the headline.

    Returns {"tasks": {task_id: {...}}, "overall": scores without the excluded tasks (the
    headline), "overall_all": scores over every task, "excluded": the excluded ids that were
    present, "ks": the k asked for or None}. Excluded tasks stay in "tasks" (flagged
    "excluded": true) so the report can show both views.
    """
    by_task: dict[str, list[AttemptRecord]] = {}
    for r in records:
        rec = r if isinstance(r, AttemptRecord) else AttemptRecord.from_dict(r)
        by_task.setdefault(rec.task_id, []).append(rec)
    ks_list = sorted(set(ks)) if ks is not None else None
    dropped = set(exclude or ())
    tasks = {}
    for tid in sorted(by_task):
        tasks[tid] = summarize_task(by_task[tid], ks_list)
        tasks[tid]["excluded"] = tid in dropped
    kept = {tid: t for tid, t in tasks.items() if not t["excluded"]}
    return {
        "tasks": tasks,
        "overall": summarize_overall(kept),
        "overall_all": summarize_overall(tasks),
        "excluded": sorted(dropped & set(tasks)),
        "ks": ks_list,
    }


def read_exclude_file(path: str) -> set[str]:
    """Task ids from an exclude file: one per line, blank lines and `#` comments ignored."""
    ids = set()
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.split("#", 1)[0].strip()
            if line:
                ids.add(line)
    return ids
