"""What the orchestrator writes and the trainer reads: turns, rollouts, groups.

A turn is one captured call (exact ids and behaviour logprobs, from the replica's trace); a rollout
is one attempt at a task (its turns, reward and status); a group is G attempts at the same task,
the unit GRPO normalises advantages over. Versions are integers: N for `policy-vN`, 0 for the base.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

STATUSES = ("complete", "failed", "aborted")


class BadRollout(ValueError):
    """A rollout that must not be trained on (the message says why); it is quarantined, not lost."""


@dataclass
class Turn:
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]  # behaviour logprob of each completion id, as sampled
    version: int  # policy version the call was sampled under (0 = base)
    replica: str = ""

    def validate(self) -> None:
        if not self.prompt_ids or not self.completion_ids:
            raise BadRollout("a turn needs prompt and completion ids")
        if len(self.logprobs) != len(self.completion_ids):
            raise BadRollout(f"{len(self.completion_ids)} completion ids but {len(self.logprobs)} logprobs")
        if any(not isinstance(t, int) or t < 0 for t in (*self.prompt_ids, *self.completion_ids)):
            raise BadRollout("token ids must be non-negative integers")
        if any(not math.isfinite(lp) or lp > 1e-4 for lp in self.logprobs):
            raise BadRollout("logprobs must be finite and <= 0")
        if self.version < 0:
            raise BadRollout("version must be >= 0")


@dataclass
class Rollout:
    id: str  # unique across the run (the orchestrator's uuid)
    turns: list[Turn]
    reward: float
    reward_parts: dict[str, float] = field(default_factory=dict)
    status: str = "complete"
    timings: dict[str, float] = field(default_factory=dict)  # seconds only: rollout_s, total_s
    reason: str | None = None  # "kind: why" of a failed attempt (sandbox_lost, tampered, tests_timeout); kept as text
    passed: bool = False  # the environment's verdict (all target tests pass), which the curriculum learns from
    calls: int = 0  # model calls the environment made, each one captured turn

    @property
    def version(self) -> int:
        """The oldest version any of its turns was sampled under (staleness counts from it)."""
        return min(t.version for t in self.turns)

    def validate(self) -> None:
        if self.status not in STATUSES:
            raise BadRollout(f"status must be one of {STATUSES}")
        if not math.isfinite(self.reward):
            raise BadRollout(f"reward {self.reward!r} is not finite")
        if not self.turns:
            raise BadRollout("a rollout needs at least one turn")
        for turn in self.turns:
            turn.validate()

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Rollout:
        """The inverse of `to_json`; also reads the older shape that kept `passed` and `calls` in
        `timings` (rollouts written before they were fields), so old stores decode unchanged."""
        timings = dict(data.get("timings") or {})
        old_passed, old_calls = timings.pop("passed", 0.0), timings.pop("calls", 0)  # the older shape
        passed, calls = data.get("passed", bool(old_passed)), data.get("calls", int(old_calls))
        turns = [Turn(**t) for t in data["turns"]]
        return cls(**{**data, "turns": turns, "timings": timings, "passed": passed, "calls": calls})


@dataclass
class Group:
    id: int
    task_id: str
    rollouts: list[Rollout]
    created: float = 0.0

    @property
    def version(self) -> int:
        return min(r.version for r in self.rollouts)
