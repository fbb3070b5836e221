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
        assert o.parts["tampered"] == 0.0 and o.parts["reset_files"] == 0.0 and o.parts["tests_timeout"] == 0.0


# ---- issue 15, item 3: what the model does to its own sandbox ends only its attempt, with reward 0 ----

class Script:
    """Replies with fixed commands in order (the last one repeats): a model that does exactly this."""

    def __init__(self, commands: list[str]) -> None:
        self.commands, self.calls = commands, 0

    async def chat(self, messages, max_tokens=None) -> str:
        self.calls += 1
        return f"```bash\n{self.commands[min(self.calls - 1, len(self.commands) - 1)]}\n```"


HOSTILE = {  # each followed by a submit: if the sandbox survives, an empty patch is graded (reward 0)
    "kill_all": "kill -9 -1",
    "fill_tmp": "head -c 300M /dev/zero > /tmp/fill",
    "fill_memory": "python3 -c 'b = [bytearray(1 << 24) for _ in range(64)]'",  # 1 GiB, over the limit
    "zombies": "for i in $(seq 200); do sleep 0 & done",
    "grader_killer": "for f in $(git ls-files '*.py' | grep -v '^tests/'); do "  # kills it when the tests import
                     "echo 'import os, signal; os.kill(-1, signal.SIGKILL)' >> $f; done && git commit -qam fix",
}


def ends_as_model_failure(o) -> bool:
    """Reward 0 and a reason: the sandbox lost (and why), or the attempt ended its usual way."""
    if o.reward != 0.0 or o.passed:
        return False
    if o.parts["sandbox_lost"] == 1.0:
        return o.info["reason"].startswith("sandbox_lost: ") and len(o.info["reason"]) > len("sandbox_lost: ")
    return o.info["exit_reason"] == "submitted" and "reason" not in o.info


class DiesOn:
    """A real sandbox whose daemon 'dies' (503, as a killed daemon answers) under one command."""

    def __init__(self, sandbox, command: str, status: int = 503,
                 message: str = "sandboxd unreachable: ConnectionResetError(104, 'Connection reset by peer')") -> None:
        self.sandbox, self.command, self.status, self.message = sandbox, command, status, message

    def exec(self, cmd, **kwargs):
        from burstrl.sandbox.client import SandboxError

        if cmd == self.command:
            raise SandboxError(self.status, self.message)
        return self.sandbox.exec(cmd, **kwargs)

    def __getattr__(self, name):
        return getattr(self.sandbox, name)


def test_hostile_commands_end_their_attempt_with_reward_0_and_an_honest_one_still_scores(tmp_path: Path) -> None:
    from burstrl.envs.swe.demos import demonstration_chat
    from burstrl.envs.swe.task import SweTask

    env = SweEnv(SweEnvConfig(toy_tasks=1, max_sandboxes=3, max_turns=12, command_timeout_s=20), tmp_path)
    task = env.make_tasks(1, seed=0, difficulty=1)[0]
    task.data["memory"] = 256  # so that filling memory or tmpfs meets the limit fast
    fix = [m["content"].split("\n", 1)[1].rsplit("\n```", 1)[0]
           for m in demonstration_chat(SweTask.from_json(task.data)) if m["role"] == "assistant"]

    async def go():
        hostile = [env.rollout(Script([cmd, SUBMIT_COMMAND]), task) for cmd in HOSTILE.values()]
        outcomes = await asyncio.wait_for(asyncio.gather(*hostile), timeout=240)
        honest = await asyncio.wait_for(env.rollout(Script(fix), task), timeout=120)
        return outcomes, honest

    try:
        outcomes, honest = asyncio.run(go())
    finally:
        env.close()
    for name, o in zip(HOSTILE, outcomes, strict=False):
        assert ends_as_model_failure(o), (name, o)
    assert honest.reward == 1.0 and honest.passed and honest.parts["sandbox_lost"] == 0.0, honest


def test_a_daemon_that_dies_under_a_command_is_sandbox_lost_not_infra(tmp_path: Path) -> None:
    """Deterministic, whatever the backend survives: the daemon stops answering under the model's command."""
    env = SweEnv(SweEnvConfig(toy_tasks=1, max_sandboxes=1, max_turns=3), tmp_path)
    task = env.make_tasks(1, seed=0, difficulty=1)[0]
    opened = env._open
    env._open = lambda swe: DiesOn(opened(swe), "kill -9 -1")
    try:
        o = asyncio.run(env.rollout(Script(["ls", "kill -9 -1", SUBMIT_COMMAND]), task))
    finally:
        env.close()
    assert o.reward == 0.0 and o.parts["sandbox_lost"] == 1.0 and o.info["exit_reason"] == "sandbox_lost"
    assert o.info["reason"] == "sandbox_lost: SandboxError: 503: sandboxd unreachable: " \
                               "ConnectionResetError(104, 'Connection reset by peer')"
    assert o.info["turns"] == 2


def test_a_refused_request_is_shown_to_the_model_and_the_attempt_goes_on(tmp_path: Path) -> None:
    """A 4xx is the daemon refusing one request (it is alive): an observation, not a lost sandbox."""
    env = SweEnv(SweEnvConfig(toy_tasks=1, max_sandboxes=1, max_turns=3), tmp_path)
    task = env.make_tasks(1, seed=0, difficulty=1)[0]
    opened = env._open
    env._open = lambda swe: DiesOn(opened(swe), "cat huge", 413, "body too large")
    try:
        o = asyncio.run(env.rollout(Script(["cat huge", SUBMIT_COMMAND]), task))
    finally:
        env.close()
    assert o.info["exit_reason"] == "submitted" and o.parts["sandbox_lost"] == 0.0 and "reason" not in o.info


def test_a_sandbox_that_cannot_be_created_is_still_infra(tmp_path: Path) -> None:
    from burstrl.envs.base import InfraError

    env = SweEnv(SweEnvConfig(toy_tasks=1, max_sandboxes=1), tmp_path)
    task = env.make_tasks(1, seed=0, difficulty=1)[0]

    class NoSandboxes:
        def create(self, spec, timeout):
            raise RuntimeError("no cgroup for you")

    env._pool = NoSandboxes()
    client = Script(["kill -9 -1"])
    with pytest.raises(InfraError, match="no cgroup for you"):
        asyncio.run(env.rollout(client, task))
    assert client.calls == 0  # before the model acted


def test_difficulty_0_fix_scores_1_and_format_shaping_is_named_and_bounded(tmp_path: Path) -> None:
    """A difficulty-0 task solved by its stated one-command fix scores 1 (+ the format bonus when
    configured, never for a format error); an empty submission gets only the bonus, and with the
    default config (bonus 0) exactly 0."""
    from burstrl.envs.swe.task import SweTask
    from burstrl.envs.swe.toygen import located_fix_command

    cfg = SweEnvConfig(toy_tasks=1, toy_difficulties=[0], max_sandboxes=3, max_turns=2, format_reward=0.1)
    env = SweEnv(cfg, tmp_path)
    [task] = env.make_tasks(1, seed=0, difficulty=0)
    fix = located_fix_command(SweTask.from_json(task.data))

    class Garbled:
        calls = 0

        async def chat(self, messages, max_tokens=None) -> str:
            self.calls += 1
            return "no block" if self.calls == 1 else f"```bash\n{fix}\n```"

    async def go():
        return await asyncio.gather(env.rollout(Script([fix]), task), env.rollout(SubmitAtOnce(), task),
                                    env.rollout(Garbled(), task))
    try:
        solved, empty, garbled = asyncio.run(go())
    finally:
        env.close()
    assert solved.passed and solved.reward == pytest.approx(1.1) and solved.parts["format_ok"] == 1.0
    assert not empty.passed and empty.reward == pytest.approx(0.1)
    assert garbled.passed and garbled.reward == pytest.approx(1.0) and garbled.parts["format_ok"] == 0.0
    assert SweEnvConfig().format_reward == 0.0
