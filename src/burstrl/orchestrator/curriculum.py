"""Which task the next group attempts: environment by weight, difficulty by recent pass rate, retries.

Why a curriculum: GRPO learns only from groups whose rewards differ, so tasks should be neither
always solved nor never solved. Each environment starts at `start_difficulty` and moves up one
step once the share of passing attempts over its last `window` groups at that difficulty reaches
`advance_pass_rate`. A task whose whole group failed comes back later (after `retry_after` more
groups have started, so the policy has had a chance to change), at most `task_retries` times.

Pure logic, no I/O and no clock: the same seed and the same reports give the same tasks, and
`state()` / `load_state()` let a resumed run continue where it stopped. Environment picks are
derived from (seed, groups started), so they need no RNG state to resume.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any

from burstrl.config import CurriculumConfig
from burstrl.envs.base import Environment, Outcome, Task

# Fresh tasks are drawn one at a time as make_tasks(1, seed=seed * TASK_SEED_STRIDE + counter):
# the counter never repeats within a run, so neither do the task ids (they name the seed).
TASK_SEED_STRIDE = 1_000_000


@dataclass
class _EnvState:
    """One environment's difficulty and its recent groups there, as (passed, attempts)."""

    difficulty: int
    max_difficulty: int
    window: deque[tuple[int, int]] = field(default_factory=deque)

    def pass_rate(self) -> float | None:
        attempts = sum(n for _, n in self.window)
        return sum(p for p, _ in self.window) / attempts if attempts else None


@dataclass
class _Retry:
    """A re-queued task: it comes back once `started` reaches `due`."""

    task: Task
    due: int


class Curriculum:
    """Hands out tasks and learns from their groups' outcomes (see the module docstring)."""

    def __init__(self, config: CurriculumConfig, weights: dict[str, float],
                 envs: dict[str, Environment], seed: int = 0) -> None:
        if not weights or any(w < 0 for w in weights.values()) or sum(weights.values()) <= 0:
            raise ValueError(f"environment weights must be >= 0 with a positive sum, got {weights}")
        missing = sorted(set(weights) - set(envs))
        if missing:
            raise ValueError(f"no environment object for {missing}")
        self.config, self.weights, self.envs, self.seed = config, dict(weights), envs, seed
        self.started = 0  # groups started (fresh and retried): the clock of retries and env picks
        self.fresh = 0  # fresh tasks drawn: the counter in their seeds
        self.requeued = 0
        self.gave_up = 0
        self.queue: deque[_Retry] = deque()
        self.retries: dict[str, int] = {}  # task id -> times re-queued, while it may come back
        self.state_by_env = {name: self._initial(envs[name]) for name in weights}

    def _initial(self, env: Environment) -> _EnvState:
        top = self.config.max_difficulty or env.max_difficulty
        top = min(top, env.max_difficulty)
        return _EnvState(difficulty=min(self.config.start_difficulty, top), max_difficulty=top)

    def difficulty(self, env_name: str) -> int:
        """The difficulty of `env_name`'s fresh tasks now."""
        return self.state_by_env[env_name].difficulty

    def next_task(self) -> Task:
        """A due re-queued task if there is one, else a fresh task from an environment picked by weight."""
        self.started += 1
        if self.queue and self.queue[0].due <= self.started:
            return self.queue.popleft().task
        name = self._pick_env()
        seed = self.seed * TASK_SEED_STRIDE + self.fresh
        self.fresh += 1
        return self.envs[name].make_tasks(1, seed=seed, difficulty=self.difficulty(name))[0]

    def _pick_env(self) -> str:
        point = random.Random(f"burstrl-curriculum:{self.seed}:{self.started}").random()
        point *= sum(self.weights.values())
        for name, weight in self.weights.items():
            point -= weight
            if point < 0:
                return name
        return next(name for name, weight in reversed(self.weights.items()) if weight > 0)

    def report(self, task: Task, outcomes: list[Outcome]) -> None:
        """Record a finished group: the pass-rate window (and maybe a step up), and the task's retry."""
        if not outcomes:
            raise ValueError(f"task {task.id}: a group needs at least one outcome")
        if task.env not in self.state_by_env:
            raise ValueError(f"task {task.id}: environment {task.env!r} is not in the curriculum")
        passed = sum(o.passed for o in outcomes)
        self._record(self.state_by_env[task.env], task, passed, len(outcomes))
        if passed:
            self.retries.pop(task.id, None)
            return
        times = self.retries.get(task.id, 0)
        if times < self.config.task_retries:
            self.retries[task.id] = times + 1
            self.requeued += 1
            # next_task counts a start before checking: the task returns at the (retry_after + 1)-th.
            self.queue.append(_Retry(task=task, due=self.started + self.config.retry_after + 1))
        else:
            self.retries.pop(task.id, None)
            self.gave_up += 1

    def _record(self, env: _EnvState, task: Task, passed: int, attempts: int) -> None:
        """Only groups at the env's current difficulty count (a retried older task does not)."""
        if task.difficulty != env.difficulty:
            return
        env.window.append((passed, attempts))
        while len(env.window) > self.config.window:
            env.window.popleft()
        full = len(env.window) == self.config.window
        if full and env.pass_rate() >= self.config.advance_pass_rate and env.difficulty < env.max_difficulty:
            env.difficulty += 1
            env.window.clear()

    def state(self) -> dict[str, Any]:
        """JSON-ready: what the stats line shows and what `load_state` needs to continue."""
        return {
            "seed": self.seed, "started": self.started, "fresh": self.fresh,
            "queue_length": len(self.queue), "requeued": self.requeued, "gave_up": self.gave_up,
            "envs": {name: {"difficulty": s.difficulty, "max_difficulty": s.max_difficulty,
                            "pass_rate": s.pass_rate(), "window": [list(g) for g in s.window]}
                     for name, s in self.state_by_env.items()},
            "queue": [{"task": asdict(r.task), "due": r.due} for r in self.queue],
            "retries": dict(self.retries),
        }

    def load_state(self, state: dict[str, Any]) -> None:
        """Continue from `state()`; environments no longer configured are dropped, new ones start fresh."""
        self.started, self.fresh = state["started"], state["fresh"]
        self.requeued, self.gave_up = state["requeued"], state["gave_up"]
        for name, saved in state["envs"].items():
            env = self.state_by_env.get(name)
            if env is not None:
                env.difficulty = min(saved["difficulty"], env.max_difficulty)
                env.window = deque((p, n) for p, n in saved["window"])
        self.queue = deque(_Retry(task=Task(**r["task"]), due=r["due"]) for r in state["queue"]
                           if r["task"]["env"] in self.state_by_env)
        self.retries = dict(state["retries"])
