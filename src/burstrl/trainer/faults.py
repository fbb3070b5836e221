"""Crash points for the trainer's kill -9 tests.

`BURSTRL_CRASH=POINT@STEP` makes the trainer SIGKILL itself when it reaches POINT during step STEP
(points: wait, backward, checkpoint_written, committed, published). It exists so the tests can hit
the narrow windows of the commit protocol (between the checkpoint and the store commit, between the
commit and the publish) every time, not by luck; unset, it costs one dict lookup.
"""

from __future__ import annotations

import os
import signal

POINTS = ("wait", "backward", "checkpoint_written", "committed", "published")


def maybe_crash(point: str, step: int) -> None:
    spec = os.environ.get("BURSTRL_CRASH")
    if spec and spec == f"{point}@{step}":
        os.kill(os.getpid(), signal.SIGKILL)
