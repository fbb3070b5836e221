"""The whole loop on vLLM: `burstrl run examples/functions-gemma.toml --engine.backend vllm` on Gemma 3 270M.

One replica, whose engine is a vLLM child; two steps. What it shows: the run trains (rewards, the
store's rollouts, the report); the trainer's recomputed logprobs agree with the ones vLLM captured at
step 1 (fp32 on both sides: every token's ratio within 1e-3 of 1); and when the replica's vLLM dies
mid-run (SIGKILL of vLLM's process group, as an OOM kill would) the replica answers 503 and exits,
the launcher replaces it, and the run finishes with nothing lost and nothing trained twice.

One vLLM at a time (the only replica, then its replacement) on cores of its own
(`engine.vllm.cpu_cores`, given by the launcher). Needs vLLM's environment (`make vllm`; `.ci/run`
makes it): without it the test skips, saying so, unless BURSTRL_REQUIRE_VLLM is set.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.vllm_env import require_vllm, vllm_slot

from .conftest import REPO, audit, burstrl_cmd, events, finish, read_jsonl, wait_until

pytestmark = pytest.mark.slow
STEPS, GROUPS, GROUP_SIZE = 2, 2, 4
VLLM_PID = re.compile(r"vLLM starting \(pid (\d+), log ")


@pytest.fixture
def vllm_env() -> Iterator[str]:
    python = require_vllm()
    with vllm_slot():  # the run's vLLM replicas: one vLLM test at a time on this machine
        yield python


def test_the_whole_loop_on_vllm_survives_its_engine_dying_mid_run(tmp_path: Path, gemma_model: Path,
                                                                  vllm_env: str) -> None:
    run_dir = tmp_path / "vllm-loop"
    args = ["run", str(REPO / "examples" / "functions-gemma.toml"), "--run_dir", str(run_dir),
            "--model.path", str(gemma_model), "--engine.backend", "vllm", "--engine.vllm.kv_cache_gib", "1",
            "--engine.max_model_len", "1024", "--trainer.steps", str(STEPS), "--trainer.batch_groups", str(GROUPS),
            "--orchestrator.group_size", str(GROUP_SIZE), "--orchestrator.max_tokens", "32",
            "--orchestrator.env.functions.max_tokens", "32", "--orchestrator.env.functions.n_tasks", "16",
            "--orchestrator.env.functions.max_sandboxes", "2"]
    out = open(tmp_path / "vllm-loop.out", "w")  # noqa: SIM115 - finish() reads it by name
    proc = subprocess.Popen(burstrl_cmd(*args), stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        # mid-step: the first attempts are sampling on the replica when its vLLM dies, so step 1's
        # rollouts (and the ratio check) come from the replacement, and the run cannot end without it
        wait_until(lambda: _attempts_running(run_dir), 900, "step 1's first attempts", proc, run_dir)
        first = (run_dir / "logs" / "replica-1-reserved.log").read_text()
        vllm_pid = int(VLLM_PID.search(first).group(1))
        os.killpg(vllm_pid, signal.SIGKILL)  # vLLM and its engine core (its own group), as an OOM kill would
        finish(proc, run_dir, timeout=1200)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        out.close()

    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    assert all(0.0 <= m["reward_mean"] <= 1.0 for m in metrics)
    # fp32 capture on vLLM vs the trainer's fp32 recompute, before any update: ratios of 1 (measured 4e-5).
    # The first step that trains any token (step 1 unless all its groups had one reward: nothing to learn,
    # no update, so the policy is still the base model under whatever version name sampled it)
    trained = [m for m in metrics if m["tokens"] > 0]
    assert trained, f"no step had a group with different rewards to train on: {metrics}"
    first = trained[0]
    assert abs(first["ratio_max"] - 1.0) < 1e-3 and abs(first["ratio_mean"] - 1.0) < 1e-3, first
    assert first["ratio_outside_frac"] == 0.0
    print("first trained step:", {k: first[k] for k in ("step", "reward_mean", "tokens", "ratio_mean", "ratio_max",
                                                        "compute_s", "step_s")})

    died = events(run_dir, "replica_died")
    assert [e["replica"] for e in died] == ["replica-1-reserved"], died
    replaced = [e for e in events(run_dir, "replica_started") if "replaces replica-1-reserved" in e["detail"]]
    assert replaced, events(run_dir, "replica_failed_start")
    pids = [int(m.group(1)) for log in sorted((run_dir / "logs").glob("replica-*.log"))
            for m in VLLM_PID.finditer(log.read_text())]
    assert len(pids) >= 2, "the replica and its replacement both ran vLLM"
    counts = audit(run_dir, STEPS, batch_groups=GROUPS, group_size=GROUP_SIZE)
    print("attempts by status:", counts)
    assert counts.get("stored", 0) >= STEPS * GROUPS * GROUP_SIZE
    assert counts.get("requeued", 0) > 0, "the attempts vLLM's death cut short ran again"
    assert (run_dir / "report" / "summary.md").is_file()
    wait_until(lambda: not any(_running(p) for p in pids), 60, "every vLLM server to be gone after the run")


def _attempts_running(run_dir: Path) -> bool:
    from burstrl.store import RolloutStore

    if not (run_dir / "store.sqlite").exists():
        return False
    with RolloutStore(run_dir / "store.sqlite") as store:
        return store.audit()["attempts"].get("running", 0) > 0


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False
