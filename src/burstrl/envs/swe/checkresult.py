"""What `burstrl tasks check` says of one task, whatever kind of task it is (SWE or functions).

A module of its own so that each kind's checker (`envs/swe/check.py`, `envs/functions/check.py`)
returns the same record without either importing the other.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_PROBLEMS = 12  # problems listed per task; the rest are counted


@dataclass
class CheckResult:
    instance_id: str
    ok: bool
    problems: list[str] = field(default_factory=list)
    seconds: float = 0.0
    at_base: dict[str, str] = field(default_factory=dict)  # test id -> status, test patch applied
    at_gold: dict[str, str] = field(default_factory=dict)  # ... and the gold patch too
