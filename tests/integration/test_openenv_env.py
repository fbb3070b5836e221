"""Issue 38: an OpenEnv server, unmodified, trained on and evaluated as the environment "openenv:<url>".

The server is `examples/openenv_envs/arith` (written with openenv's own `Environment`, `Rubric` and
`create_app`, served by uvicorn) in its own process group on a loopback port, one per module. Real
replica (the tiny model), router, orchestrator and store; a stand-in trainer takes the first group
and commits step 1, which ends the run. The tiny model's replies are rarely integers, so most
attempts end as the model's failure (the server refuses the action): what is checked is that every
attempt reached the store with its captured turns and graded parts, and never as an infra error.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from burstrl.config import OrchestrateConfig, OrchestratorSection
from burstrl.envs.ecosystem.openenv_env import OpenEnvEnv
from burstrl.envs.registry import get_env
from burstrl.orchestrator.loop import Orchestrator
from burstrl.protocol import process
from burstrl.protocol.process import ready_url
from tests.waiting import wait_for

from .conftest import ADMIN_TOKEN, run_until_step_one, start_server, stop_server

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
TOKEN = "openenv-env-cluster-token"


def pythonpath() -> dict[str, str]:
    """The environment of a child that imports `examples.` from the repository root."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}


def ready_line(proc: subprocess.Popen, timeout: float) -> str:
    """The URL in the child's JSON ready line (importing openenv costs it ~5 CPU-s first)."""
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if sel.select(timeout=0.5):
            url = ready_url(proc.stdout.readline())
            if url:
                return url
    raise AssertionError(f"the arith server did not say where it listens within {timeout:.0f} s")


@contextlib.contextmanager
def arith_server(log: Path, environ: dict[str, str]) -> Iterator[str]:
    """The arith OpenEnv server in its own process group on a free loopback port: its URL."""
    with open(log, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "examples.openenv_envs.arith.server", "--port", "0"],
                                cwd=REPO, env=environ, stdout=subprocess.PIPE, stderr=err, text=True,
                                start_new_session=True)
    try:
        url = ready_line(proc, 180)
        wait_for(lambda: httpx.get(f"{url}/health", timeout=5).status_code == 200, 120, "arith /health")
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        proc.stdout.close()


@pytest.fixture(scope="module")
def arith_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with arith_server(tmp_path_factory.mktemp("arith") / "server.log", pythonpath()) as url:
        yield url


@pytest.fixture(scope="module")
def router(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("openenv-fleet")
    server = start_server(tiny_model_dir, tmp / "r0")
    router = process.start_router(tmp / "router", "--cluster_token", TOKEN, "--replicas", json.dumps([server.url]),
                                  "--scrape_s", "0.5")
    try:
        yield router
    finally:
        router.stop()
        stop_server(server)


class Arithmetic:
    """A ChatClient that answers like a policy: a wrong sum first, then the right one (from the question)."""

    def __init__(self) -> None:
        self.calls = 0

    async def chat(self, messages: list[dict[str, str]], max_tokens: int | None = None) -> str:
        self.calls += 1
        question = json.loads(messages[-1]["content"])["observation"]["question"]  # "What is a + b?"
        a, b = (int(w.strip("?")) for w in question.split() if w.strip("?").isdigit())
        return "0" if self.calls == 1 else f'```json\n{{"answer": {a + b}}}\n```'


class Junk:
    calls = 0

    async def chat(self, messages: list[dict[str, str]], max_tokens: int | None = None) -> str:
        return "no idea"


def test_the_adapter_plays_the_real_openenv_server(arith_url: str) -> None:
    name = f"openenv:{arith_url}"
    type(get_env(name)).check(None)
    env = get_env(name)
    assert isinstance(env, OpenEnvEnv)

    async def episodes() -> list:
        tasks = env.make_tasks(8, 1)
        return await asyncio.gather(*(env.rollout(Arithmetic(), t) for t in tasks))

    outcomes = asyncio.run(episodes())
    assert all(o.passed and o.reward == 1.0 and o.info["rewards"] == [0.0, 1.0] for o in outcomes)
    refused = asyncio.run(env.rollout(Junk(), env.make_tasks(1, 2)[0]))
    assert refused.reward == 0.0 and "invalid action" in refused.info["reason"]



def test_the_orchestrator_stores_groups_of_an_openenv_server(arith_url: str, router, tmp_path: Path) -> None:
    name = f"openenv:{arith_url}"
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    o = OrchestratorSection(envs={name: 1.0}, env={name: {"max_turns": 2}}, group_size=2, max_tokens=6,
                            max_in_flight_groups=1, max_buffered_groups=1)
    orch = Orchestrator(OrchestrateConfig(run_dir=str(run_dir), router=router.url, steps=1, orchestrator=o),
                        ADMIN_TOKEN)
    assert orch.envs[name].options.max_turns == 2

    groups = run_until_step_one(orch, run_dir / "store.sqlite", lambda store: store.buffered_count() >= 1,
                                max_groups=1, timeout=180)
    assert len(groups) == 1 and len(groups[0].rollouts) == 2
    for r in groups[0].rollouts:
        assert 1 <= len(r.turns) == r.calls <= 2 and all(t.completion_ids for t in r.turns)
        assert set(r.reward_parts) == {"env_reward", "valid"} and r.reward in (0.0, 1.0, 2.0)
        assert r.status == ("failed" if r.reason else "complete")
    assert orch.counters.attempts_requeued == 0  # nothing here is an infra error


def test_burstrl_eval_takes_an_openenv_server(arith_url: str, tiny_model_dir: Path, tmp_path: Path) -> None:
    name, out = f"openenv:{arith_url}", tmp_path / "eval"
    r = subprocess.run([sys.executable, "-c", "from burstrl.cli import main; main()", "eval", "--model",
                        str(tiny_model_dir), "--env", name, "--env-option", "max_turns=2", "--max-tokens", "6",
                        "--n", "2", "--attempts", "2", "--out", str(out)],
                       capture_output=True, text=True, timeout=300, env=pythonpath(), check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert results["config"]["env"] == name and len(results["records"]) == 4
    for rec in results["records"]:
        assert rec["task_id"].startswith("openenv-") and "-test-" in rec["task_id"] and rec["infra_error"] is None
        assert set(rec["parts"]) == {"env_reward", "valid"}
        assert rec["extra"]["ended"] in ("done", "invalid", "max_turns")
