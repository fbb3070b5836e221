"""What the verifiers adapter's two stacks (v1 tasksets, legacy modules) share: task draws, ids,
reward parts and the line between the model's failures, the fleet's and the environment's.

No verifiers import here: `verifiers_env` uses these before it knows which stack a module is.
"""

from __future__ import annotations

import json
import math
import random
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

SPLITS = ("train", "test")


@dataclass(frozen=True)
class Row:
    """One task of a stack's pool: its key in the source (legacy `example_id`, v1 `idx`) and its
    JSON-safe data, what `Task.data` holds and the rollout rebuilds the environment's task from."""

    key: str
    data: dict[str, Any]


def draw(size: int, n: int, seed: int, split: str) -> list[int]:
    """`n` pool positions for (seed, split), the same in every process (a string seed is hashed
    with sha512 by `random`): a seeded sample without repeats, then a fresh one per lap when
    `n` exceeds the pool, so no task repeats before every task came once."""
    if size <= 0:
        raise ValueError("the environment has no tasks")
    rng = random.Random(f"burstrl-verifiers:{split}:{seed}")
    picked: list[int] = []
    while len(picked) < n:
        picked += rng.sample(range(size), min(size, n - len(picked)))
    return picked


def check_draw(n: int, difficulty: int, split: str) -> None:
    """ValueError naming the argument `make_tasks` cannot serve (these environments have one level)."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if difficulty != 1:
        raise ValueError(f"difficulty must be 1 (a verifiers environment has one level), got {difficulty}")
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")


def task_id(spec: str, split: str, seed: int, index: int, key: str) -> str:
    """Unique across a run: the curriculum never repeats a seed and `index` is unique within a
    draw; the row's key only makes the id readable (`vf-<module>-train-s7-00000-e12`)."""
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", spec)
    return f"vf-{slug}-{split}-s{seed}-{index:05d}-e{key}"


def json_row(row: Mapping[str, Any], where: str) -> dict[str, Any]:
    """`row` as plain JSON (tasks are stored as JSON); ValueError naming the column that is not."""
    out = {}
    for column, value in row.items():
        try:
            out[column] = json.loads(json.dumps(value))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{where}: column {column!r} is not JSON ({exc}); burstrl stores tasks as JSON") from None
    return out


def numeric_parts(*mappings: Mapping[str, Any]) -> dict[str, float]:
    """The finite numbers of `mappings` as floats, by name (the first mapping wins a name)."""
    parts: dict[str, float] = {}
    for mapping in mappings:
        for name, value in mapping.items():
            if isinstance(value, (int, float)) and math.isfinite(value) and name not in parts:
                parts[str(name)] = float(value)
    return parts


def after_the_model(what: str, message: str) -> str:
    """The reason an attempt is scored 0 for a failure that came once the model had answered.

    Why not re-run it (`InfraError`) or stop the run (`refused`): after a reply, what the
    environment sends next carries the model's output (a tool call that crashes the tool server,
    arguments the replica refuses), so whether the model caused it cannot be told; a re-run would
    let a policy farm unscored attempts, a stop would let it end the run. Only failures before the
    model's first answer are the environment's.
    """
    return f"{what} after the model's reply: {message[:500]}"


def refused(spec: str, message: str) -> RuntimeError:
    """A call the router refused (4xx) for what the environment sent, not for what the model did:
    re-running cannot fix it (a request field burstrl's replica does not serve), so the run stops
    on it instead of retrying forever."""
    return RuntimeError(f"verifiers:{spec}: the router refused a call the environment made ({message[:500]}); "
                        "the environment needs something burstrl's replica does not serve")
