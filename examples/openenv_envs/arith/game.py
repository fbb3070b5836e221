"""The rules of the arithmetic game, shared by the OpenEnv server and its native twin.

Reset(seed) poses "What is a + b?" (1 <= a, b <= 50); each step answers with one integer. A right
answer scores 1.0 and ends the episode; a wrong one scores 0.0 and says "too low" or "too high";
the episode ends after MAX_TRIES answers.
"""

from __future__ import annotations

import random

MAX_TRIES = 3


def problem(seed: int | None) -> tuple[int, int]:
    """The two numbers of the episode reset with `seed` (None: random)."""
    rng = random.Random(seed)
    return rng.randint(1, 50), rng.randint(1, 50)


def question(a: int, b: int) -> str:
    return f"What is {a} + {b}?"


def hint(answer: int, a: int, b: int) -> str:
    """What a wrong answer is told ("" for the right one)."""
    if answer == a + b:
        return ""
    return "too low" if answer < a + b else "too high"
