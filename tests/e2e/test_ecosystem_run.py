"""Issue 38: `burstrl run examples/ecosystem.toml` at test size: a verifiers v1 taskset, a legacy
verifiers module and an OpenEnv server (openenv's own classes, on loopback), unmodified, trained on
side by side through the whole loop (router, replicas with capture, trainer, orchestrator, store).

The random tiny model solves nothing (rewards 0, so the trainer skips its updates); what is checked
is that every environment's attempts reached the store with captured turns on their group's
version and their graded parts, nothing lost or twice, and the steps committed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from burstrl.store import RolloutStore
from tests.integration.test_openenv_env import ready_line
from tests.waiting import wait_for

from .conftest import REPO, audit, burstrl_cmd

pytestmark = pytest.mark.slow

PORT_IN_EXAMPLE = "http://127.0.0.1:8001"


def child_env() -> dict[str, str]:
    paths = [str(REPO / "examples" / "verifiers_envs"), str(REPO), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}


@pytest.fixture()
def arith_url(tmp_path: Path):
    with open(tmp_path / "arith.log", "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "examples.openenv_envs.arith.server", "--port", "0"],
                                cwd=REPO, env=child_env(), stdout=subprocess.PIPE, stderr=err, text=True,
                                start_new_session=True)
    try:
        url = ready_line(proc, 180)
        wait_for(lambda: httpx.get(f"{url}/health", timeout=5).status_code == 200, 120, "arith /health")
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        proc.stdout.close()


def test_verifiers_and_openenv_environments_train_side_by_side(tmp_path: Path, tiny_model_dir: Path,
                                                                arith_url: str) -> None:
    config = tmp_path / "ecosystem.toml"  # the example, on the port the server got
    config.write_text((REPO / "examples" / "ecosystem.toml").read_text().replace(PORT_IN_EXAMPLE, arith_url))
    run_dir = tmp_path / "run"
    cmd = burstrl_cmd("run", str(config), "--run_dir", str(run_dir), "--model.path", str(tiny_model_dir),
                      "--trainer.steps", "2", "--trainer.batch_groups", "3", "--orchestrator.group_size", "2",
                      "--fleet.on_demand", "0", "--engine.num_threads", "1", "--trainer.num_threads", "1",
                      "--orchestrator.seed", "8")  # seed 8: the curriculum's first 6 picks are each env twice
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=child_env())
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    audit(run_dir, 2, batch_groups=3, group_size=2)
    with RolloutStore(run_dir / "store.sqlite") as store:
        groups = store.groups()
    by_env: dict[str, list] = {}
    for g in groups:  # ids: vf-<module>-... and openenv-<hash of the url>-...
        env = g.task_id.split("-")[1] if g.task_id.startswith("vf-") else g.task_id.split("-")[0]
        by_env.setdefault(env, []).extend(g.rollouts)
    assert set(by_env) == {"vf_sum_v1", "vf_sum_legacy", "openenv"}, sorted(g.task_id for g in groups)
    for rollouts in by_env.values():
        for rollout in rollouts:
            assert rollout.turns and all(t.completion_ids and len(t.logprobs) == len(t.completion_ids)
                                         for t in rollout.turns)
            assert len({t.version for t in rollout.turns}) == 1
    print({env: len(rs) for env, rs in by_env.items()})
