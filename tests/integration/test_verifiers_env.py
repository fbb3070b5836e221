"""Issue 38: verifiers environments, unmodified, train and evaluate through `VerifiersEnv`.

The four examples of `examples/verifiers_envs` (v1 taskset single-turn and with a shared MCP tool
server; legacy SingleTurnEnv and ToolEnv) run in the real orchestrator against a real replica (the
tiny model, serving the adapter `policy-v1` as its newest version) behind a real router; a
stand-in trainer commits step 1 once each environment has a stored group. Then `burstrl eval` on a
v1 and a legacy example. The tool environments send `tools` with every call, so they need the
replica's tool support (the tiny random model never calls a tool: one call per rollout).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from burstrl.config import OrchestrateConfig, OrchestratorSection
from burstrl.orchestrator.loop import Orchestrator
from burstrl.protocol import process
from tests.http_client import HTTP

from .conftest import ADMIN_TOKEN, run_until_step_one, start_server, stop_server

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples" / "verifiers_envs"
TOKEN = "verifiers-env-cluster-token"
# env name -> (reward parts it must report, weight of each part in the reward)
ENVS = {
    "verifiers:vf-sum-v1": {"correct": 1.0, "reply_chars": 0.0},
    "verifiers:vf-tool-v1": {"correct": 1.0, "used_tool": 0.5},
    "verifiers:vf-sum-legacy": {"correct": 1.0, "num_turns": 0.0},
    "verifiers:vf-tool-legacy": {"correct": 1.0, "used_tool": 0.5, "total_tool_calls": 0.0},
}


def slug(name: str) -> str:
    return "vf-" + name.split(":", 1)[1] + "-"


@pytest.fixture(scope="module")
def examples_path():
    """The examples importable here and in the tool server verifiers starts (a subprocess)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(EXAMPLES))
        mp.setenv("PYTHONPATH", os.pathsep.join([str(EXAMPLES), os.environ.get("PYTHONPATH", "")]))
        yield


@pytest.fixture(scope="module")
def router(tiny_model_dir: Path, adapters: dict[str, Path], tmp_path_factory: pytest.TempPathFactory):
    """A replica serving base and policy-v1, behind a router that already routes policy-v1."""
    root = tmp_path_factory.mktemp("vf-fleet")
    server = start_server(tiny_model_dir, root / "r0", "--adapters", json.dumps({"policy-v1": str(adapters["policy-v1"])}))
    router = process.start_router(root / "router", "--cluster_token", TOKEN, "--replicas", json.dumps([server.url]),
                                  "--scrape_s", "0.5")
    try:
        deadline = time.monotonic() + 120
        while "policy-v1" not in HTTP.get(router.url + "/v1/models", timeout=30).text:
            assert time.monotonic() < deadline, "the router never listed policy-v1"
            time.sleep(0.2)
        yield router
    finally:
        router.stop()
        stop_server(server)


def every_env_has_a_group(store) -> bool:
    ids = [g.task_id for g in store.groups(("buffered",))]
    return all(any(i.startswith(slug(name)) for i in ids) for name in ENVS)


def test_the_orchestrator_trains_on_every_kind_of_verifiers_environment(examples_path, router, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    o = OrchestratorSection(envs=dict.fromkeys(ENVS, 1.0), env={"verifiers:vf-sum-v1": {"args": {"num_tasks": 3}}},
                            group_size=2, max_tokens=8, max_in_flight_groups=4, max_buffered_groups=64)
    orch = Orchestrator(OrchestrateConfig(run_dir=str(run_dir), router=router.url, steps=1, orchestrator=o),
                        ADMIN_TOKEN)

    groups = run_until_step_one(orch, run_dir / "store.sqlite", every_env_has_a_group, max_groups=1000, timeout=240)
    assert orch.counters.attempts_requeued == 0  # every call captured on the group's version, first time
    for name, weights in ENVS.items():
        mine = [g for g in groups if g.task_id.startswith(slug(name))]
        assert mine, name
        for rollout in (r for g in mine for r in g.rollouts):
            check_rollout(name, weights, rollout)
    ids = [g.task_id for g in groups if g.task_id.startswith(slug("verifiers:vf-sum-v1"))]
    assert all(i.rsplit("-e", 1)[1] in {"0", "1", "2"} for i in ids)  # args.num_tasks reached the taskset


def check_rollout(name: str, weights: dict[str, float], rollout) -> None:
    """Captured turns with ids and logprobs, all on policy-v1, and the env's own reward parts."""
    assert rollout.turns and rollout.calls == len(rollout.turns), name
    for turn in rollout.turns:
        assert turn.prompt_ids and turn.completion_ids and len(turn.logprobs) == len(turn.completion_ids)
        assert turn.version == 1, (name, turn.version)
    if rollout.status == "failed":  # the model's doing only (a legacy env refuses an empty reply)
        assert "ModelResponseError" in (rollout.reason or ""), (name, rollout.reason)
        return
    assert set(rollout.reward_parts) >= set(weights), (name, rollout.reward_parts)
    expected = sum(w * rollout.reward_parts[part] for part, w in weights.items())
    assert rollout.reward == pytest.approx(expected), (name, rollout.reward, rollout.reward_parts)


def burstrl_eval(model: Path, env: str, out: Path, *extra: str) -> dict:
    environ = {**os.environ, "PYTHONPATH": os.pathsep.join([str(EXAMPLES), str(REPO), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-c", "from burstrl.cli import main; main()", "eval", "--model", str(model),
                        "--env", env, "--n", "2", "--attempts", "2", "--max-tokens", "8", "--out", str(out), *extra],
                       capture_output=True, text=True, timeout=300, env=environ, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads((out / "results.json").read_text())


# One per way `burstrl eval` draws tasks: a v1 taskset, a legacy module with an eval dataset, one
# without. vf-tool-v1 runs the v1 path again (its tool loop: the orchestrator test above, the e2e).
@pytest.mark.parametrize(("env", "options", "keys", "parts"), [
    ("verifiers:vf-sum-v1", ["--env-option", "args.num_tasks=1"], {"0"}, {"correct", "reply_chars"}),
    ("verifiers:vf-sum-legacy", [], {"0", "1"}, {"correct", "num_turns"}),  # its eval dataset's rows
    ("verifiers:vf-tool-legacy", [], None, {"correct", "num_turns"}),  # no eval dataset: drawn from its dataset
])
def test_burstrl_eval_runs_a_verifiers_environment(tiny_model_dir: Path, tmp_path: Path, env: str, options: list,
                                                   keys: set | None, parts: set) -> None:
    results = burstrl_eval(tiny_model_dir, env, tmp_path / "eval", *options)
    records = results["records"]
    assert results["config"]["env"] == env and len(records) == 4
    assert keys is None or {r["task_id"].rsplit("-e", 1)[1] for r in records} == keys
    for record in records:
        assert record["task_id"].startswith(slug(env) + "test-") and record["version"] == "base"
        assert record["infra_error"] is None and set(record["parts"]) >= parts, record
        assert record["resolved"] == (record["reward"] >= 0.5 and not record["reason"])
