"""Run reports: a dashboard PNG, a markdown summary and headline figures from a run directory.

Why a separate reader: the run's processes only append JSON lines (cheap, crash-safe), so every
question about a run — did reward go up, did the trainer starve, how much did losing a replica
cost — is answered here, after the fact or while the run is still going. The readers therefore
tolerate what a live run looks like: missing or empty files, a torn last line, old metric lines
without a `time`.
"""

from __future__ import annotations

import json
import sqlite3
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

METRICS_FILE = "metrics.jsonl"
ORCHESTRATOR_FILE = "orchestrator.jsonl"
FLEET_FILE = "fleet.jsonl"
RUN_FILES = (METRICS_FILE, ORCHESTRATOR_FILE, FLEET_FILE)
OUTAGE_EVENTS = ("replica_killed", "replica_died")
NEIGHBOURS = 2  # steps on each side of an outage step whose median is the baseline


@dataclass
class RunData:
    """Everything the run's logs say, as parsed dicts, in file order."""

    run_dir: Path
    metrics: list[dict[str, Any]] = field(default_factory=list)
    orchestrator: list[dict[str, Any]] = field(default_factory=list)
    samples: list[dict[str, Any]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)

    @property
    def t0(self) -> float | None:
        """The run's first timestamp in any file: the origin of every time axis."""
        times = _all_times(self)
        return min(times) if times else None

    @property
    def duration_s(self) -> float:
        times = _all_times(self)
        return max(times) - min(times) if times else 0.0


def _all_times(run: RunData) -> list[float]:
    times = [m["time"] for m in run.metrics if "time" in m]
    times += [r["t"] for r in run.orchestrator + run.samples + run.events if "t" in r]
    return [float(t) for t in times]


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Parse a JSON-lines file; a missing file is empty and a torn *last* line is skipped.

    Only the last line may be torn (a writer was mid-append); a bad line elsewhere means a corrupt
    file, which is reported rather than silently dropped.
    """
    if not path.is_file():
        return []
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    rows: list[dict[str, Any]] = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            if i == len(lines) - 1:
                break
            raise ValueError(f"{path}:{i + 1}: not a JSON line") from None
        if isinstance(row, dict):
            rows.append(row)
    return rows


def load_run(run_dir: Path | str) -> RunData:
    """Read a run directory; FileNotFoundError if it is missing or holds none of the log files."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"{run_dir}: no such run directory")
    if not any((run_dir / name).is_file() for name in RUN_FILES):
        raise FileNotFoundError(f"{run_dir}: none of {', '.join(RUN_FILES)} found (not a run directory?)")
    fleet = read_jsonl(run_dir / FLEET_FILE)
    return RunData(
        run_dir=run_dir,
        metrics=read_jsonl(run_dir / METRICS_FILE),
        orchestrator=read_jsonl(run_dir / ORCHESTRATOR_FILE),
        samples=[r for r in fleet if r.get("kind") == "sample"],
        events=[r for r in fleet if r.get("kind") == "event"],
    )


# ----- figures -----------------------------------------------------------------------------


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _values(rows: list[dict[str, Any]], key: str) -> list[float]:
    return [float(r[key]) for r in rows if r.get(key) is not None]


def _last(rows: list[dict[str, Any]], key: str) -> Any:
    for row in reversed(rows):
        if row.get(key) is not None:
            return row[key]
    return None


def utilisation(metrics: list[dict[str, Any]]) -> float | None:
    """Share of the trainer's step time spent computing (the rest is waiting, saving, publishing)."""
    rows = [m for m in metrics if m.get("compute_s") is not None and m.get("step_s") is not None]
    total = sum(float(m["step_s"]) for m in rows)
    return sum(float(m["compute_s"]) for m in rows) / total if total > 0 else None


def outage_steps(metrics: list[dict[str, Any]], events: list[dict[str, Any]]) -> list[tuple[int, float]]:
    """(index into metrics, ratio) for each step during which a replica was killed or died.

    A step's `time` is logged when it ends, so the step spanning an outage at time T is the first
    step whose time is >= T. Its ratio is its step_s over the median step_s of up to NEIGHBOURS
    steps on each side, excluding other outage steps, so one slow step is compared with normal ones.
    """
    timed = [i for i, m in enumerate(metrics) if m.get("time") is not None and m.get("step_s") is not None]
    hits: set[int] = set()
    for event in events:
        if event.get("event") in OUTAGE_EVENTS and event.get("t") is not None:
            hit = next((i for i in timed if float(metrics[i]["time"]) >= float(event["t"])), None)
            if hit is not None:
                hits.add(hit)
    result = []
    for hit in sorted(hits):
        pos = timed.index(hit)
        around = timed[max(0, pos - NEIGHBOURS):pos] + timed[pos + 1:pos + 1 + NEIGHBOURS]
        base = [float(metrics[i]["step_s"]) for i in around if i not in hits]
        if base and statistics.median(base) > 0:
            result.append((hit, float(metrics[hit]["step_s"]) / statistics.median(base)))
    return result


def _event_rows(run: RunData) -> list[dict[str, Any]]:
    t0 = run.t0 or 0.0
    return [
        {"t_s": float(e["t"]) - t0 if e.get("t") is not None else None, "event": e.get("event", ""),
         "replica": e.get("replica", ""), "pool": e.get("pool", ""), "detail": e.get("detail", "")}
        for e in run.events
    ]


def summary(run_dir: Path | str) -> dict[str, Any]:
    """The headline figures of a run, for tests, benchmarks and the markdown summary."""
    return _summary(load_run(run_dir))


def _summary(run: RunData) -> dict[str, Any]:
    rewards = _values(run.metrics, "reward_mean")
    step_times = _values(run.metrics, "step_s")
    outages = outage_steps(run.metrics, run.events)
    return {
        "run_dir": str(run.run_dir),
        "steps": len(run.metrics),
        "last_step": _last(run.metrics, "step"),
        "duration_s": run.duration_s,
        "reward_first": rewards[0] if rewards else None,
        "reward_last5": _mean(rewards[-5:]),
        "staleness_mean": _mean(_values(run.metrics, "staleness_mean")),
        # the trainer's recomputed vs the replicas' captured logprobs, per step before its update
        "ratio_mean": _mean(_values(run.metrics, "ratio_mean")),
        "ratio_max": max(_values(run.metrics, "ratio_max"), default=None),
        "ratio_outside_frac": _mean(_values(run.metrics, "ratio_outside_frac")),
        "ratio_outside_frac_max": max(_values(run.metrics, "ratio_outside_frac"), default=None),
        "utilisation": utilisation(run.metrics),
        "step_s_median": statistics.median(step_times) if step_times else None,
        "rollouts_done": _last(run.orchestrator, "rollouts_done"),
        "attempts_requeued": _last(run.orchestrator, "attempts_requeued"),
        "replica_events": _event_rows(run),
        "outage_steps": [run.metrics[i].get("step", i) for i, _ in outages],
        "outage_ratio": max(ratio for _, ratio in outages) if outages else None,
        "failure_reasons": failure_reasons(run.run_dir / "store.sqlite"),
    }


def failure_reasons(store: Path, limit: int = 10) -> dict[str, Any]:
    """Failed rollouts by reason kind and the latest reasons, read-only from a (maybe live) store.

    Why in the run report: `tampered` or `tests_timeout` climbing during training is a policy
    learning to game the grader; the reward curve alone would show it as progress."""
    if not store.exists():
        return {"kinds": {}, "latest": []}
    try:
        db = sqlite3.connect(f"file:{store}?mode=ro", uri=True, timeout=5)
        try:
            if "reason" not in {r[1] for r in db.execute("PRAGMA table_info(rollouts)")}:
                return {"kinds": {}, "latest": []}  # a store from before reasons were kept
            rows = db.execute("SELECT reason FROM rollouts WHERE reason IS NOT NULL ORDER BY created DESC").fetchall()
        finally:
            db.close()
    except sqlite3.Error:
        return {"kinds": {}, "latest": []}
    kinds: dict[str, int] = {}
    for (reason,) in rows:
        kind = reason.split(":", 1)[0].strip()
        kinds[kind] = kinds.get(kind, 0) + 1
    return {"kinds": dict(sorted(kinds.items())), "latest": [r for (r,) in rows[:limit]]}


# ----- markdown ----------------------------------------------------------------------------


def _fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def render_markdown(figures: dict[str, Any], png_name: str) -> str:
    """The summary as markdown: headline figures, the fleet's events, and the dashboard."""
    lines = [
        "# Run report",
        "",
        f"Run directory: `{figures['run_dir']}`",
        "",
        "| figure | value |",
        "|---|---|",
        f"| steps | {figures['steps']} |",
        f"| duration | {_fmt(figures['duration_s'], 1)} s |",
        f"| reward, first step | {_fmt(figures['reward_first'])} |",
        f"| reward, mean of last 5 steps | {_fmt(figures['reward_last5'])} |",
        f"| staleness, mean | {_fmt(figures['staleness_mean'], 2)} |",
        f"| importance ratio (recomputed / captured), mean of steps; max | {_fmt(figures.get('ratio_mean'), 4)}; "
        f"{_fmt(figures.get('ratio_max'), 3)} |",
        f"| tokens with ratio outside [0.8, 1.25], mean of steps; worst step "
        f"| {_fmt(figures.get('ratio_outside_frac'), 4)}; {_fmt(figures.get('ratio_outside_frac_max'), 4)} |",
        f"| trainer utilisation (compute / step time) | {_fmt(figures['utilisation'], 2)} |",
        f"| step time, median | {_fmt(figures['step_s_median'], 2)} s |",
        f"| outage ratio (step spanning a replica loss / median of neighbours) "
        f"| {_fmt(figures['outage_ratio'], 2)} |",
        f"| rollouts done | {_fmt(figures['rollouts_done'])} |",
        f"| attempts requeued | {_fmt(figures['attempts_requeued'])} |",
        "",
        "## Fleet events",
        "",
    ]
    lines += _events_markdown(figures["replica_events"])
    reasons = figures.get("failure_reasons") or {}
    if reasons.get("kinds"):
        lines += ["", "## Failed attempts by reason", "",
                  "From the store's `rollouts.reason` (reward 0; `tampered`: forged test results).", "",
                  "| reason | rollouts |", "|---|---|"]
        lines += [f"| {_cell(k)} | {v} |" for k, v in reasons["kinds"].items()]
        lines += [""] + [f"- {_cell(r[:300])}" for r in reasons["latest"]]
    lines += ["", "## Dashboard", "", f"![dashboard]({png_name})", ""]
    return "\n".join(lines)


def _events_markdown(events: list[dict[str, Any]]) -> list[str]:
    if not events:
        return ["No fleet events recorded."]
    rows = ["| t (s) | event | replica | detail |", "|---|---|---|---|"]
    for e in events:
        rows.append(f"| {_fmt(e['t_s'], 1)} | {_cell(e['event'])} | {_cell(e['replica'])} | {_cell(e['detail'])} |")
    return rows


# ----- dashboard ---------------------------------------------------------------------------


def _series(rows: list[dict[str, Any]], time_key: str, key: str, t0: float) -> tuple[list[float], list[float]]:
    pairs = [(float(r[time_key]) - t0, float(r[key])) for r in rows
             if r.get(time_key) is not None and r.get(key) is not None]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def _pools(samples: list[dict[str, Any]]) -> list[str]:
    pools: list[str] = []
    for s in samples:
        pools += [p for p in (s.get("replicas") or {}) if p not in pools]
    return pools


def _plot_reward(ax, run: RunData, t0: float) -> None:
    ax.plot(*_series(run.metrics, "time", "reward_mean", t0), "o-", ms=3, label="trainer step")
    ax.plot(*_series(run.orchestrator, "t", "reward_mean", t0), alpha=0.6, label="orchestrator (recent)")
    ax.set_ylabel("reward")


def _plot_staleness(ax, run: RunData, t0: float) -> None:
    ax.plot(*_series(run.metrics, "time", "staleness_mean", t0), "o-", ms=3, label="mean")
    ax.plot(*_series(run.metrics, "time", "staleness_max", t0), "s--", ms=3, label="max")
    ax.set_ylabel("staleness (versions)")


def _plot_throughput(ax, run: RunData, t0: float) -> None:
    ax.plot(*_series(run.orchestrator, "t", "rollouts_per_s", t0), label="rollouts/s")
    ax.set_ylabel("rollouts / s")
    ax.set_ylim(bottom=0)


def _plot_replicas(ax, run: RunData, t0: float) -> None:
    rows = [s for s in run.samples if s.get("t") is not None]
    times = [float(s["t"]) - t0 for s in rows]
    for pool in _pools(rows):
        counts = [float((s.get("replicas") or {}).get(pool, 0)) for s in rows]
        ax.step(times, counts, where="post", label=pool)
    ax.step(*_series(rows, "t", "routable", t0), where="post", ls=":", color="black", label="routable")
    ax.set_ylabel("replicas")
    ax.set_ylim(bottom=0)


def _plot_cache(ax, run: RunData, t0: float) -> None:
    ax.plot(*_series(run.samples, "t", "cache_hit_rate", t0), label="cache hit rate")
    ax.set_ylabel("cache hit rate")
    ax.set_ylim(-0.05, 1.05)


PANELS = (_plot_reward, _plot_staleness, _plot_throughput, _plot_replicas, _plot_cache)


def _mark_outages(ax, run: RunData, t0: float, label: bool) -> None:
    """Red vertical lines where a replica was lost, on every panel, so cause and effect line up."""
    first = label
    for e in run.events:
        if e.get("event") in OUTAGE_EVENTS and e.get("t") is not None:
            ax.axvline(float(e["t"]) - t0, color="red", ls="--", lw=1,
                       label=f"{e['event']} {e.get('replica', '')}".strip() if first else None)
            first = False


def render_dashboard(run: RunData, path: Path) -> None:
    """Draw the panels over wall time since the run's first timestamp and save a PNG.

    Uses a bare Figure with the Agg canvas rather than pyplot: no global backend switch, no
    figure registry, so it is safe inside other programs and threads.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 2.3 * len(PANELS)), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(PANELS), 1, sharex=True)
    t0 = run.t0 or 0.0
    for ax, panel in zip(axes, PANELS, strict=False):
        panel(ax, run, t0)
        _mark_outages(ax, run, t0, label=panel is _plot_replicas)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="upper left", fontsize=8)
    axes[-1].set_xlabel("wall time since run start (s)")
    fig.suptitle(f"burstrl run {run.run_dir.name}")
    fig.savefig(path, dpi=100)


def write_report(run_dir: Path | str, out_dir: Path | str | None = None) -> tuple[Path, Path]:
    """Write `dashboard.png` and `summary.md` (default under RUN_DIR/report); return their paths."""
    run = load_run(run_dir)
    out = Path(out_dir) if out_dir is not None else run.run_dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    png, md = out / "dashboard.png", out / "summary.md"
    render_dashboard(run, png)
    md.write_text(render_markdown(_summary(run), png.name), encoding="utf-8")
    return png, md
