"""Issue 17, move 2: an environment from outside the package runs in the orchestrator and `burstrl eval`.

`examples/third_party_env.py` is named only by its import path and its options only in the config
(`orchestrator.env.echo`); no library file lists it. Real replica (the tiny model), router,
orchestrator and store; a stand-in trainer takes the first group and commits step 1, which ends the run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from burstrl.config import OrchestrateConfig, OrchestratorSection
from burstrl.orchestrator.loop import Orchestrator
from burstrl.protocol import process

from .conftest import ADMIN_TOKEN, run_until_step_one, start_server, stop_server

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
ECHO = "examples.third_party_env:EchoEnv"
TOKEN = "third-party-env-cluster-token"


@pytest.fixture()
def router(tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.syspath_prepend(str(REPO))  # the orchestrator imports the environment by its path
    server = start_server(tiny_model_dir, tmp_path / "r0")
    router = process.start_router(tmp_path / "router", "--cluster_token", TOKEN, "--replicas",
                                  json.dumps([server.url]), "--scrape_s", "0.5")
    try:
        yield router
    finally:
        router.stop()
        stop_server(server)


def test_the_orchestrator_runs_groups_of_a_module_class_environment(router, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    o = OrchestratorSection(envs={ECHO: 1.0}, env={"echo": {"words": 2}}, group_size=2, max_tokens=4,
                           max_in_flight_groups=1, max_buffered_groups=1)
    orch = Orchestrator(OrchestrateConfig(run_dir=str(run_dir), router=router.url, steps=1, orchestrator=o),
                        ADMIN_TOKEN)
    assert orch.envs[ECHO].options.words == 2

    groups = run_until_step_one(orch, run_dir / "store.sqlite", lambda store: store.buffered_count() >= 1,
                                max_groups=1, timeout=120)  # the first stored group becomes step 1
    assert len(groups) == 1 and len(groups[0].rollouts) == 2
    assert all(set(r.reward_parts) >= {"exact", "partial"} for r in groups[0].rollouts)


def test_burstrl_eval_takes_a_module_class_environment(tiny_model_dir: Path, tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    out = tmp_path / "eval"
    r = subprocess.run([sys.executable, "-c", "from burstrl.cli import main; main()", "eval", "--model",
                        str(tiny_model_dir), "--env", ECHO, "--n", "2", "--attempts", "2", "--out", str(out)],
                       capture_output=True, text=True, timeout=300, env=env, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert results["config"]["env"] == ECHO and len(results["records"]) == 4
    assert all(r["task_id"].startswith("echo-test-") and r["infra_error"] is None for r in results["records"])
