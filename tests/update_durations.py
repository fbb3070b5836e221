"""Write tests/durations.json, the seconds each test file took, from a JUnit XML report.

The parallel run starts the most expensive files first (tests/conftest.py); this table is what
it knows of their cost. Regenerate it after a full run when files are added or change much:

    make test                                                  # writes build/test-report.xml
    .venv/bin/python tests/update_durations.py build/test-report.xml
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

TABLE = Path(__file__).with_name("durations.json")


def file_seconds(junit: Path) -> dict[str, float]:
    """Sum of test times per file ('tests/unit/test_x.py'), from the report's testcase classnames."""
    seconds: dict[str, float] = {}
    for case in ET.parse(junit).iter("testcase"):
        path = case.get("classname", "").replace(".", "/") + ".py"
        seconds[path] = seconds.get(path, 0.0) + float(case.get("time", 0))
    return seconds


def print_timeline(timeline: Path) -> None:
    """Each worker's work units in order (minutes from the start): where a slow run's time went."""
    rows = json.loads(timeline.read_text())
    t0 = min(r["start"] for r in rows)
    units: dict[tuple[str, str], list[float]] = {}
    for r in rows:
        span = units.setdefault((r["worker"], r["test"].split("::", 1)[0]), [r["start"], r["stop"]])
        span[0], span[1] = min(span[0], r["start"]), max(span[1], r["stop"])
    for worker in sorted({w for w, _ in units}):
        spans = sorted((s, e, f) for (w, f), (s, e) in units.items() if w == worker)
        line = ", ".join(f"{f.removeprefix('tests/')} {(s - t0) / 60:.1f}-{(e - t0) / 60:.1f}" for s, e, f in spans
                         if e - s > 30)
        print(f"{worker} (ends at {(spans[-1][1] - t0) / 60:.1f} min; units over 30 s): {line}")


def print_cpu(timeline: Path, top: int = 25) -> None:
    """CPU seconds per directory and the files that cost the most (worker + reaped children)."""
    rows = [r for r in json.loads(timeline.read_text()) if r.get("cpu_s") is not None]
    by_file: dict[str, float] = {}
    for r in rows:
        path = r["test"].split("::", 1)[0]
        by_file[path] = by_file.get(path, 0.0) + r["cpu_s"]
    by_dir: dict[str, float] = {}
    for path, cpu in by_file.items():
        by_dir[path.split("/")[1]] = by_dir.get(path.split("/")[1], 0.0) + cpu
    print(f"CPU: {sum(by_file.values()) / 60:.1f} min in all; by directory (s):",
          {d: round(c) for d, c in sorted(by_dir.items())})
    for path, cpu in sorted(by_file.items(), key=lambda kv: -kv[1])[:top]:
        print(f"  {cpu:7.1f} s  {path}")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(f"usage: {sys.argv[0]} JUNIT_XML")
    seconds = file_seconds(Path(sys.argv[1]))
    table = {path: round(s, 1) for path, s in sorted(seconds.items())}
    TABLE.write_text(json.dumps(table, indent=0) + "\n")
    print(f"{TABLE}: {len(table)} files, {sum(table.values()):.0f} s in all")
    by_dir: dict[str, float] = {}
    for path, s in seconds.items():
        by_dir[path.split("/")[1]] = by_dir.get(path.split("/")[1], 0.0) + s
    print("by directory (s, summed over workers):", {d: round(s) for d, s in sorted(by_dir.items())})
    timeline = Path(sys.argv[1]).with_name("test-timeline.json")
    if timeline.exists():
        print_timeline(timeline)
        print_cpu(timeline)
