"""The task record every part of `burstrl.envs.swe` shares: SWE-bench's fields plus ours.

Why one dataclass: the generator writes it, `tasks check` verifies it, the environment runs it,
the grader grades it and `burstrl eval` reports on it; a field read differently in one place is
a silently wrong score. JSON lists may arrive as JSON strings (SWE-bench's own files do that).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

DEFAULT_TEST_CMD = "python3 -m pytest -rA -q -p no:cacheprovider"


class TaskError(ValueError):
    """A task record that cannot be used; the message names the task and the field."""


@dataclass
class SweTask:
    instance_id: str
    repo: str  # a local git repository (directory) or a git bundle file
    base_commit: str
    problem_statement: str
    FAIL_TO_PASS: list[str]  # target tests: fail at the base, pass with the gold patch
    PASS_TO_PASS: list[str]  # existing tests: pass both ways
    patch: str = ""  # the gold patch (git diff); never shown to the agent
    test_patch: str = ""  # applied only at grading
    version: str = ""
    image: str = ""  # OCI layout dir for the sandbox; "" = the host's system dirs
    difficulty: int = 1
    cpu: float = 1.0
    memory: int = 2048  # MB
    disk: int = 4096  # MB: the size of the sandbox's /work (ENOSPC past it)
    test_cmd: str = DEFAULT_TEST_CMD  # run from the repo root; test ids are appended
    extra: dict[str, Any] = field(default_factory=dict)  # generator details (bug kinds, split, ...)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SweTask:
        known = {f.name for f in fields(cls)}
        tid = data.get("instance_id", "?")
        missing = [n for n in ("instance_id", "repo", "base_commit", "problem_statement", "FAIL_TO_PASS",
                               "PASS_TO_PASS") if n not in data]
        if missing:
            raise TaskError(f"task {tid}: missing field(s) {', '.join(missing)}")
        values = {k: v for k, v in data.items() if k in known}
        values["extra"] = {**data.get("extra", {}), **{k: v for k, v in data.items() if k not in known}}
        for name in ("FAIL_TO_PASS", "PASS_TO_PASS"):
            values[name] = _test_list(tid, name, values[name])
        return cls(**values)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _test_list(tid: str, name: str, value: Any) -> list[str]:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise TaskError(f"task {tid}: {name} is a string but not a JSON list") from None
    if not isinstance(value, list) or not all(isinstance(t, str) for t in value):
        raise TaskError(f"task {tid}: {name} must be a list of test ids")
    return value


def load_tasks(path: str | Path) -> list[SweTask]:
    """Tasks from a JSONL file (one object per line; blank lines skipped); errors name the line."""
    out = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            out.append(SweTask.from_json(json.loads(line)))
        except json.JSONDecodeError as exc:
            raise TaskError(f"{path}:{n}: not JSON: {exc}") from None
        except TaskError as exc:
            raise TaskError(f"{path}:{n}: {exc}") from None
    return out


def dump_tasks(tasks: list[SweTask], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(t.to_json()) + "\n" for t in tasks))
    return path
