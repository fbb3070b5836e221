"""Output of `burstrl eval`: a results JSON, a markdown report and a PNG plot.

Why three files: the JSON is the source of truth (one record per attempt with its log path, the
summary, the config) that `--compare` and later reports read back; the markdown is what a person
reads or pastes into docs/benchmarks.md; the PNG shows the pass@k curve and, across checkpoints,
the training curve.

A results dict holds: "records" (AttemptRecord dicts), "summary" (from `passk.summarize`),
"config" (free-form: env, model, tasks, attempts, ...), optionally "comparison" (from
`compare.compare_results`, this run as A), "compare_label" (what B was) and "curve" (a list of
{"step", "pass@1", "f2p", "strict"}, one per evaluated checkpoint).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable

from burstrl.eval.compare import compare_results
from burstrl.eval.passk import AttemptRecord, pass_keys, summarize
from burstrl.eval.report import _cell, _fmt

RESULTS_FILE = "results.json"
MARKDOWN_FILE = "report.md"
PNG_FILE = "report.png"
CURVE_METRICS = ("pass@1", "f2p", "strict", "reward")
TEST_KEYS = ("f2p", "strict", "apply_failures")  # only for environments graded by tests (swe)


def make_results(
    records: Iterable[AttemptRecord | dict[str, Any]],
    config: dict[str, Any] | None = None,
    ks: Iterable[int] | None = None,
    exclude: Iterable[str] | None = None,
    baseline: dict[str, Any] | None = None,
    baseline_label: str = "baseline",
    curve: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """Assemble a results dict: records, summary, config, and the comparison with a baseline."""
    rows = [r.to_dict() if isinstance(r, AttemptRecord) else dict(r) for r in records]
    results: dict[str, Any] = {
        "config": dict(config or {}),
        "records": rows,
        "summary": summarize(rows, ks=ks, exclude=exclude),
    }
    if baseline is not None:
        results["comparison"] = compare_results(results, baseline)
        results["compare_label"] = baseline_label
    if curve:
        results["curve"] = list(curve)
    return results


def load_results(path: Path | str) -> dict[str, Any]:
    """A results JSON written by `write_eval_report` (or a directory holding one)."""
    path = Path(path)
    if path.is_dir():
        path = path / RESULTS_FILE
    data = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(data, dict) or "records" not in data:
        raise ValueError(f"{path}: not an eval results file (no 'records')")
    return data


def load_records(path: Path | str) -> list[AttemptRecord]:
    """The attempt records of a previous evaluation, e.g. the base model's for `--compare`."""
    return [AttemptRecord.from_dict(r) for r in load_results(path)["records"]]


# ----- markdown ----------------------------------------------------------------------------


def graded_by_tests(summary: dict[str, Any]) -> bool:
    """Whether the records carry test scores (f2p, strict): swe's do, toy environments' do not."""
    return any(t.get("f2p") is not None for t in summary["tasks"].values())


def _overall_keys(overall: dict[str, Any], tests: bool = True) -> list[str]:
    keys = pass_keys(overall) + ["f2p", "strict", "reward", "n_tasks", "attempts", "resolved",
                                 "apply_failures", "infra_failures", "tampered", "reset_files",
                                 "tasks_without_attempts"]
    return keys if tests else [k for k in keys if k not in TEST_KEYS]


def _overall_markdown(summary: dict[str, Any]) -> list[str]:
    """One column without the excluded tasks and, when some were excluded, one with them."""
    kept, full = summary["overall"], summary["overall_all"]
    both = bool(summary.get("excluded"))
    header = "| metric | without excluded | all tasks |" if both else "| metric | value |"
    rows = [header, "|---|---|---|" if both else "|---|---|"]
    for key in _overall_keys(full if both else kept, graded_by_tests(summary)):
        cells = [_fmt(kept.get(key))] + ([_fmt(full.get(key))] if both else [])
        rows.append(f"| {key} | " + " | ".join(cells) + " |")
    for name in (full if both else kept).get("parts") or {}:  # the reward's named parts, mean over tasks
        cells = [_fmt((kept.get("parts") or {}).get(name))] + ([_fmt(full["parts"].get(name))] if both else [])
        rows.append(f"| part: {_cell(name)} | " + " | ".join(cells) + " |")
    return rows


def _task_markdown(summary: dict[str, Any]) -> list[str]:
    tasks = summary["tasks"]
    if not tasks:
        return ["No tasks."]
    keys = sorted({k for t in tasks.values() for k in pass_keys(t)}, key=lambda s: int(s[5:]))
    tests = graded_by_tests(summary)
    cols = ["n", "c"] + keys + (["f2p", "strict", "apply fail"] if tests else ["reward"])
    cols += ["infra fail", "tampered", "reset files"]
    rows = ["| task | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for tid, t in tasks.items():
        name = f"{_cell(tid)} (excluded)" if t.get("excluded") else _cell(tid)
        cells = [t["n"], t["c"]] + [t.get(k) for k in keys]
        cells += [t.get("f2p"), t.get("strict"), t["apply_failures"]] if tests else [t.get("reward")]
        cells += [t["infra_failures"], t.get("tampered", 0), t.get("reset_files", 0)]
        rows.append(f"| {name} | " + " | ".join(_fmt(c) for c in cells) + " |")
    return rows


def _reasons_markdown(results: dict[str, Any], limit: int = 10) -> list[str]:
    """Named model failures by kind, then the first few reasons verbatim (what a person checks
    when `tampered` or `reset_files` is not 0: is the policy gaming the grader?)."""
    kinds = results["summary"]["overall_all"].get("reasons") or {}
    flagged = results["summary"]["overall_all"].get("suspicious") or {}
    rows = ["| reason | attempts |", "|---|---|"] + [f"| {_cell(k)} | {v} |" for k, v in kinds.items()]
    rows += [f"| flagged by the static scan: {_cell(k)} | {v} |" for k, v in flagged.items()]
    examples = []
    for r in results.get("records", []):
        reason = r.get("reason") or (r.get("extra") or {}).get("reason")
        reset = (r.get("extra") or {}).get("reset_files")
        if reason or reset:
            text = reason or f"reset before grading: {', '.join(reset)}"
            examples.append(f"- {_cell(r.get('task_id'))} #{r.get('attempt')}: {_cell(str(text)[:300])}")
    return rows + ([""] + examples[:limit] if examples else [])


def _comparison_markdown(comparison: dict[str, Any], label: str) -> list[str]:
    rows = [f"A = this evaluation, B = {_cell(label)}; paired over shared tasks, bootstrap over tasks.", "",
            "| metric | A | B | A - B | CI | p | tasks |", "|---|---|---|---|---|---|---|"]
    for metric, c in comparison.items():
        lo, hi = c["ci"]
        level = round(100 * (1 - c.get("alpha", 0.05)))
        rows.append(f"| {metric} | {_fmt(c['mean_a'])} | {_fmt(c['mean_b'])} | {c['diff']:+.3f} "
                    f"| {level}% [{lo:+.3f}, {hi:+.3f}] | {_fmt(c['p_value'])} | {c['n_tasks']} |")
    return rows


def _curve_metrics(curve: list[dict[str, Any]]) -> list[str]:
    """The curve's metrics that some point has (no f2p / strict without test grading)."""
    return [k for k in CURVE_METRICS if any(p.get(k) is not None for p in curve)]


def _curve_markdown(curve: list[dict[str, Any]]) -> list[str]:
    metrics = _curve_metrics(curve)
    rows = ["| step | " + " | ".join(metrics) + " |", "|---" * (len(metrics) + 1) + "|"]
    for point in curve:
        rows.append(f"| {point.get('step')} | " + " | ".join(_fmt(point.get(k)) for k in metrics) + " |")
    return rows


def render_eval_markdown(results: dict[str, Any], png_name: str) -> str:
    """The report: config, overall scores, comparison, checkpoint curve, per-task scores, plot."""
    summary = results["summary"]
    env = (results.get("config") or {}).get("env")
    lines = [f"# Evaluation report: {_cell(env)}" if env else "# Evaluation report", ""]
    for key, value in (results.get("config") or {}).items():
        lines.append(f"- {_cell(key)}: `{_cell(value)}`")
    lines += ["", "## Overall", "",
              "Means over tasks. Infra failures are retried and not counted in n"
              + ("; apply failures count as unresolved." if graded_by_tests(summary) else
                 "; resolved = the environment's pass (Outcome.passed); `part:` rows are the reward's parts."), ""]
    if summary.get("excluded"):
        lines += [f"Excluded (flawed) tasks: {', '.join(_cell(t) for t in summary['excluded'])}", ""]
    lines += _overall_markdown(summary)
    overall = summary["overall_all"]
    if overall.get("reasons") or overall.get("reset_files") or overall.get("suspicious"):
        lines += ["", "## Failure reasons and reward integrity", "",
                  "`tampered`: the grader caught forged test results or the diff policy refused the patch "
                  "(`tampered/<rule>`; reward 0). `suspicious`: the static scan found a forgery's primitives "
                  "in the changed code (per rule; reward 0 when training). `reset files`: the patch touched "
                  "tests or test configuration, reset before grading.", ""]
        lines += _reasons_markdown(results)
    if results.get("comparison"):
        lines += ["", "## Comparison", ""]
        lines += _comparison_markdown(results["comparison"], results.get("compare_label", "baseline"))
    if results.get("curve"):
        lines += ["", "## Checkpoints", ""] + _curve_markdown(results["curve"])
    lines += ["", "## Per task", ""] + _task_markdown(summary)
    lines += ["", "## Plot", "", f"![evaluation]({png_name})", ""]
    return "\n".join(lines)


# ----- plot --------------------------------------------------------------------------------


def _k_series(scores: dict[str, Any]) -> tuple[list[int], list[float]]:
    keys = [k for k in pass_keys(scores) if scores.get(k) is not None]
    return [int(k[5:]) for k in keys], [float(scores[k]) for k in keys]


def _plot_passk(ax, results: dict[str, Any]) -> None:
    """pass@k over k: this run, the all-tasks view if tasks were excluded, and the baseline."""
    from matplotlib.ticker import MaxNLocator

    summary = results["summary"]
    ax.plot(*_k_series(summary["overall"]), "o-", label="this evaluation")
    if summary.get("excluded"):
        ax.plot(*_k_series(summary["overall_all"]), "s:", alpha=0.7, label="incl. excluded tasks")
    comparison = results.get("comparison") or {}
    base = {m: c["mean_b"] for m, c in comparison.items() if m.startswith("pass@")}
    if base:
        ax.plot(*_k_series(base), "^--", label=results.get("compare_label", "baseline"))
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("k (attempts)")
    ax.set_ylabel("pass@k")
    ax.set_ylim(-0.02, 1.02)


def _plot_curve(ax, curve: list[dict[str, Any]]) -> None:
    for key in _curve_metrics(curve):
        pts = [(float(p["step"]), float(p[key])) for p in curve if p.get(key) is not None and "step" in p]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", ms=3, label=key)
    ax.set_xlabel("checkpoint step")
    ax.set_ylabel("score")
    ax.set_ylim(-0.02, 1.02)


def render_eval_plot(results: dict[str, Any], path: Path) -> None:
    """Save the PNG with a bare Agg Figure (no pyplot global state, as in `report`)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    curve = results.get("curve") or []
    panels = 2 if curve else 1
    fig = Figure(figsize=(6 * panels, 4), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, panels, squeeze=False)[0]
    _plot_passk(axes[0], results)
    if curve:
        _plot_curve(axes[1], curve)
    for ax in axes:
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="lower right", fontsize=8)
    env = (results.get("config") or {}).get("env")
    fig.suptitle(f"burstrl eval: {env}" if env else "burstrl eval")
    fig.savefig(path, dpi=100)


def write_eval_report(results: dict[str, Any], out_dir: Path | str) -> tuple[Path, Path, Path]:
    """Write results.json, report.md and report.png under out_dir; return their paths.

    A results dict without "summary" gets one computed from its records (no exclusions).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    results = dict(results)
    results["records"] = [r.to_dict() if isinstance(r, AttemptRecord) else r for r in results.get("records", [])]
    if "summary" not in results:
        results["summary"] = summarize(results["records"])
    json_path, md_path, png_path = out / RESULTS_FILE, out / MARKDOWN_FILE, out / PNG_FILE
    json_path.write_text(json.dumps(results, indent=1, default=str) + "\n", encoding="utf-8")
    md_path.write_text(render_eval_markdown(results, png_path.name), encoding="utf-8")
    render_eval_plot(results, png_path)
    return json_path, md_path, png_path
