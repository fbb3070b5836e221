"""Progress display of `burstrl run`: a live panel in a terminal, plain lines everywhere else.

Why two modes: a person at a terminal wants one compact panel redrawn in place, while CI logs and
`burstrl run > log` want one readable line per step or event and no escape codes. The launcher
calls `update` with a snapshot dict from its own loop; nothing here runs a thread or reads files.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

MAX_EVENTS_SHOWN = 5


def snapshot_eta(elapsed_s: float, step: int | None, steps: int) -> float | None:
    """Seconds left if the remaining steps go at the average pace so far; None before step 1."""
    if not step or step <= 0 or elapsed_s <= 0:
        return None
    return max(0.0, elapsed_s / step * (steps - step))


def format_duration(seconds: float | None) -> str:
    """Short human duration: 45s, 1m20s, 2h05m; '-' when unknown."""
    if seconds is None:
        return "-"
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def _num(value: Any, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _replicas(replicas: dict[str, int] | None) -> str:
    return " ".join(f"{pool}={n}" for pool, n in (replicas or {}).items()) or "-"


def format_line(snap: dict[str, Any]) -> str:
    """The one-line form of a snapshot, as CI logs show it."""
    return (
        f"step {snap.get('step', 0)}/{snap.get('steps', '?')}"
        f"  reward {_num(snap.get('reward'), '.2f')}"
        f"  pass {_num(snap.get('pass_rate'), '.2f')}"
        f"  stale {_num(snap.get('staleness'), '.1f')}"
        f"  replicas {_replicas(snap.get('replicas'))}"
        f"  cache {_num(snap.get('cache_hit_rate'), '.2f')}"
        f"  {_num(snap.get('rollouts_per_s'), '.1f')} rollouts/s"
        f"  eta {format_duration(snap.get('eta_s'))}"
    )


def new_events(previous: list[str], current: list[str]) -> list[str]:
    """The events in `current` not already in `previous`, both being windows of a recent-events list.

    The launcher passes the last few events each time, so the same event appears in many
    snapshots; the longest suffix of `previous` that starts `current` is the overlap.
    """
    for k in range(min(len(previous), len(current)), 0, -1):
        if previous[len(previous) - k:] == current[:k]:
            return current[k:]
    return list(current)


def render_panel(snap: dict[str, Any], run_dir: Path) -> Panel:
    """The live panel: a two-column table of the snapshot plus its recent events."""
    table = Table.grid(padding=(0, 2))
    table.add_column(style="bold")
    table.add_column()
    rows = [
        ("step", f"{snap.get('step', 0)}/{snap.get('steps', '?')}"),
        ("reward", _num(snap.get("reward"), ".3f")),
        ("pass rate", _num(snap.get("pass_rate"), ".3f")),
        ("staleness", _num(snap.get("staleness"), ".2f")),
        ("replicas", f"{_replicas(snap.get('replicas'))}  (routable {snap.get('routable', '-')})"),
        ("cache hit", _num(snap.get("cache_hit_rate"), ".2f")),
        ("rollouts/s", _num(snap.get("rollouts_per_s"), ".1f")),
        ("buffered", str(snap.get("buffered", "-"))),
        ("elapsed", format_duration(snap.get("elapsed_s"))),
        ("eta", format_duration(snap.get("eta_s"))),
    ]
    for name, value in rows:
        table.add_row(name, value)
    events = Text("\n".join(snap.get("events", [])[-MAX_EVENTS_SHOWN:]), style="yellow")
    return Panel(Group(table, events), title=f"burstrl run {run_dir}", expand=False)


class Display:
    """Shows the launcher's snapshots; `close()` must be called (it stops the live panel)."""

    def __init__(self, run_dir: Path, steps: int, live: bool | None = None,
                 console: Console | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.steps = steps
        self.live = sys.stdout.isatty() if live is None else live
        self._console = console or Console()
        self._last_step: int | None = None
        self._last_events: list[str] = []
        self._live: Live | None = None
        if self.live:
            # auto_refresh=False: no refresh thread, the panel is redrawn only by update().
            self._live = Live(Text(f"burstrl run {self.run_dir}: starting"), console=self._console,
                              auto_refresh=False, transient=False)
            self._live.start()

    def update(self, snapshot: dict[str, Any]) -> None:
        """Redraw the panel (live) or print a line if the step changed or an event arrived."""
        snap = {"steps": self.steps, **snapshot}
        events = list(snap.get("events") or [])
        fresh = new_events(self._last_events, events)
        self._last_events = events
        if self._live is not None:
            self._live.update(render_panel(snap, self.run_dir), refresh=True)
            return
        step = snap.get("step")
        if step == self._last_step and not fresh:
            return
        self._last_step = step
        line = format_line(snap)
        if fresh:
            line += "  | " + "; ".join(fresh)
        print(line, flush=True)

    def close(self) -> None:
        """Stop the live panel, leaving its last state on screen; safe to call twice."""
        if self._live is not None:
            self._live.stop()
            self._live = None
