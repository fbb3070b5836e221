"""Issue 15 (orchestrator e2e): a scripted agent that wrecks its sandbox cannot stop the run.

Real router, replica (the tiny model, so every turn is a real captured call), sandboxes, grading
and store; only the replies are scripted: each attempt's turns call the model as usual, then the
"agent" sends its script's command instead of the sampled text. The attempts kill the sandbox's
processes, fill /tmp, /work and memory, leave zombies, or commit code that kills the grader; one
gets a daemon that stops answering (deterministically, whatever the backend withstands). The run
must finish on its own (a stand-in trainer commits a step), those attempts must be stored with
reward 0 (`sandbox_lost` where the sandbox died, the reason in the log), an honest attempt still
scores 1, and the attempt ledger must show nothing lost and nothing re-run.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from burstrl.config import OrchestrateConfig, OrchestratorSection, SweEnvConfig
from burstrl.envs.base import ChatClient, Outcome, Task
from burstrl.envs.swe.agent import SUBMIT_COMMAND
from burstrl.envs.swe.env import SweEnv
from burstrl.envs.swe.task import SweTask
from burstrl.orchestrator.loop import Orchestrator
from burstrl.protocol import process
from burstrl.sandbox.client import SandboxError
from burstrl.store import RolloutStore

from .conftest import ADMIN_TOKEN, commit_step_one, start_server, stop_server

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")]

TOKEN = "hostile-agent-cluster-token"
DIE = "exit_daemon"  # the wrapped sandbox answers this one with what a dead daemon gives: 503
SCRIPTS = {
    "daemon_dies": [DIE],
    "kill_all": ["kill -9 -1"],
    "fill_tmp": ["head -c 300M /dev/zero > /tmp/fill"],
    "fill_work": ["head -c 300M /dev/zero > /work/fill"],
    "fill_memory": ["python3 -c 'b = [bytearray(1 << 24) for _ in range(64)]'"],  # 1 GiB, over the limit
    "zombies": ["for i in $(seq 200); do sleep 0 & done", "for i in $(seq 200); do sleep 0 & done"],
    "grader_killer": [("for f in $(git ls-files '*.py' | grep -v '^tests/'); do "
                       "echo 'import os, signal; os.kill(-1, signal.SIGKILL)' >> $f; done && git commit -qam fix")],
}
ORDER = list(SCRIPTS) + ["honest"]  # 8 attempts: 4 groups of 2


class DiesOn:
    """A real sandbox, except that `DIE` gets the 503 a killed daemon's socket gives."""

    def __init__(self, sandbox) -> None:
        self.sandbox = sandbox

    def exec(self, cmd, **kwargs):
        if cmd == DIE:
            raise SandboxError(503, "sandboxd unreachable: ConnectionResetError(104, 'Connection reset by peer')")
        return self.sandbox.exec(cmd, **kwargs)

    def __getattr__(self, name):
        return getattr(self.sandbox, name)


class ScriptedSwe(SweEnv):
    """SweEnv whose agent's replies follow a script per attempt (ORDER, in start order)."""

    def __init__(self, cfg: SweEnvConfig, run_dir: Path) -> None:
        super().__init__(cfg, run_dir)
        self.started: dict[str, str] = {}  # session (rollout id) -> script name
        self._lock = threading.Lock()

    def _open(self, swe: SweTask):
        return DiesOn(super()._open(swe))

    async def rollout(self, client: ChatClient, task: Task) -> Outcome:
        with self._lock:
            name = ORDER[len(self.started) % len(ORDER)]
            self.started[client.session_id] = name
        commands = self._commands(name, task) + [SUBMIT_COMMAND]
        real = client.chat

        async def chat(messages, max_tokens=None):
            await real(messages, max_tokens=1)  # a real, captured call
            return f"```bash\n{commands[min(client.calls - 1, len(commands) - 1)]}\n```"

        client.chat = chat
        return await super().rollout(client, task)

    @staticmethod
    def _commands(name: str, task: Task) -> list[str]:
        if name != "honest":
            return SCRIPTS[name]
        from burstrl.envs.swe.demos import fix_commands

        return fix_commands(SweTask.from_json(task.data))


@pytest.fixture()
def cluster(tiny_model_dir: Path, tmp_path: Path):
    server = start_server(tiny_model_dir, tmp_path / "r0")
    router = process.start_router(tmp_path / "router", "--cluster_token", TOKEN, "--replicas",
                                  json.dumps([server.url]), "--scrape_s", "0.5")
    try:
        yield router
    finally:
        router.stop()
        stop_server(server)


def trainer(store_path: Path, env: ScriptedSwe, stop: threading.Event) -> list:
    """Once every script has a stored attempt, every buffered group becomes step 1 (ending the run)."""

    def every_script_stored(store: RolloutStore) -> bool:
        stored = {env.started.get(rid) for rid, (status, _) in store.attempts().items() if status == "stored"}
        return stored >= set(ORDER)

    return commit_step_one(store_path, stop, every_script_stored, max_groups=1000)


def test_a_hostile_agent_scores_0_and_the_run_finishes_with_nothing_lost(cluster, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    swe = SweEnvConfig(toy_tasks=1, max_sandboxes=4, max_turns=12, command_timeout_s=20)
    cfg = OrchestrateConfig(run_dir=str(run_dir), router=cluster.url, steps=1,
                            orchestrator=OrchestratorSection(envs={"swe": 1.0}, group_size=2, swe=swe, max_tokens=1,
                                                            max_in_flight_groups=4, max_buffered_groups=4))
    run_dir.mkdir(parents=True)
    orch = Orchestrator(cfg, ADMIN_TOKEN)
    env = orch.envs["swe"] = ScriptedSwe(swe, run_dir)  # the curriculum shares this dict

    async def go():
        loop = asyncio.get_running_loop()
        loop.set_default_executor(ThreadPoolExecutor(max_workers=64))  # as `run_orchestrator` does
        stop = threading.Event()
        taken = loop.run_in_executor(ThreadPoolExecutor(1), trainer, run_dir / "store.sqlite", env, stop)
        try:
            await asyncio.wait_for(orch.run(), timeout=150)  # returns once step 1 is committed
        finally:
            stop.set()
        return await taken

    for task in env.tasks:  # memory and /work limits low enough that the fills meet them fast
        task.memory, task.disk = 256, 128
    try:
        groups = asyncio.run(go())
    finally:
        env.close()

    rollouts = {r.id: r for g in groups for r in g.rollouts}
    assert {env.started[rid] for rid in rollouts} == set(ORDER)  # every script stored at least once
    for rid, r in rollouts.items():
        name = env.started[rid]
        if name == "honest":
            assert r.reward == 1.0 and r.status == "complete" and r.reward_parts["sandbox_lost"] == 0.0
            continue
        assert r.reward == 0.0 and r.reward_parts["resolved"] == 0.0, (name, r.reward_parts)
        lost = r.reward_parts["sandbox_lost"] == 1.0
        assert r.status == ("failed" if lost else "complete"), (name, r.status)
    assert all(r.reward_parts["sandbox_lost"] == 1.0 for rid, r in rollouts.items()
               if env.started[rid] == "daemon_dies")
    with RolloutStore(run_dir / "store.sqlite") as store:
        audit = store.audit()
    assert audit["lost"] == 0 and audit["consumed_twice"] == 0, audit
    assert audit["attempts"].get("requeued", 0) == 0, audit  # nothing the model did was re-run
    assert audit["attempts"]["stored"] >= len(rollouts), audit
    stats = [json.loads(line) for line in (run_dir / "orchestrator.jsonl").read_text().splitlines()]
    assert stats[-1]["attempts_sandbox_lost"] >= sum(r.reward_parts["sandbox_lost"] for r in rollouts.values()) > 0
