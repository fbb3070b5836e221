"""`SweEnv.rollout` under load: many attempts at once share a small sandbox pool and finish.

Regression test: with more attempts than sandbox slots and worker threads, attempts waiting for a
sandbox used to park every worker thread while the attempts holding sandboxes waited for a thread
to run their commands (a deadlock). The model's side is a scripted client that submits at once.
"""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest

from burstrl.config import SweEnvConfig
from burstrl.envs.swe.agent import SUBMIT_COMMAND
from burstrl.envs.swe.env import SweEnv

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")]


class SubmitAtOnce:
    def __init__(self) -> None:
        self.calls = 0

    async def chat(self, messages, max_tokens=None) -> str:
        self.calls += 1
        return f"```bash\n{SUBMIT_COMMAND}\n```"


def test_more_attempts_than_sandboxes_all_finish_and_are_graded(tmp_path: Path) -> None:
    env = SweEnv(SweEnvConfig(toy_tasks=2, max_sandboxes=2, max_turns=2), tmp_path)
    tasks = env.make_tasks(1, seed=0, difficulty=1) * 10

    async def go():
        return await asyncio.wait_for(asyncio.gather(*(env.rollout(SubmitAtOnce(), t) for t in tasks)), timeout=300)

    try:
        outcomes = asyncio.run(go())
    finally:
        env.close()
    assert len(outcomes) == 10
    for o in outcomes:  # submitted without a commit: an empty patch, graded, not resolved
        assert o.parts["submitted"] == 1.0 and o.parts["resolved"] == 0.0 and o.reward == 0.0
        assert o.info["patch_bytes"] == 0
