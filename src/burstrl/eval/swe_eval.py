"""`burstrl eval`: K attempts per coding task with a model (and adapter versions), scored by tests.

Why the real stack: an evaluation must measure what training optimises, so each attempt is the
same `SweEnv.rollout` the orchestrator runs (a sandbox, the agent, commit-only grading), against a
real replica (`burstrl serve`) that serves the base model and every adapter evaluated, one version
per model name. Attempts run concurrently up to the sandbox bound; an infrastructure failure is
retried (never scored as a model failure); every attempt becomes one record in the results JSON.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from burstrl.config import SweEnvConfig
from burstrl.envs.base import InfraError, Task
from burstrl.envs.swe.env import SweEnv
from burstrl.envs.swe.task import SweTask, load_tasks

log = logging.getLogger("burstrl.eval")
INFRA_RETRIES = 2


@dataclass
class EvalSpec:
    model: Path
    tasks: Path
    attempts: int = 4
    adapters: dict[str, Path] = field(default_factory=dict)  # version name -> PEFT dir; "base" is always there
    temperature: float = 1.0
    seed: int = 0
    env: SweEnvConfig = field(default_factory=SweEnvConfig)
    out: Path = Path("eval")
    admin_token: str = field(default_factory=lambda: uuid.uuid4().hex)  # the eval replica's, to release sessions


async def _attempt(env: SweEnv, http: httpx.AsyncClient, url: str, version: str, task: SweTask, k: int,
                   spec: EvalSpec) -> dict[str, Any]:
    """One attempt, retried on infrastructure failures; its record (a dict for the results JSON)."""
    from burstrl.orchestrator.client import ReplicaFailure, SessionClient, release

    t = Task(id=task.instance_id, env="swe", difficulty=task.difficulty, data=task.to_json())
    error = None
    for _ in range(INFRA_RETRIES + 1):
        sid = f"eval-{uuid.uuid4().hex}"
        client = SessionClient(http, url, sid, version, spec.temperature, env.cfg.max_tokens_per_call,
                               seed=spec.seed * 100_003 + k)
        start = time.monotonic()
        try:
            outcome = await env.rollout(client, t)  # at most max_sandboxes at once (SweEnv's gate)
            await release(http, url, sid, spec.admin_token)
        except (InfraError, ReplicaFailure) as exc:
            error = f"{type(exc).__name__}: {exc}"
            log.warning("attempt %s/%d: %s (retrying)", task.instance_id, k, error)
            continue
        p = outcome.parts
        return {"task_id": task.instance_id, "attempt": k, "version": version, "resolved": bool(p["resolved"]),
                "f2p": p["f2p"], "strict": p["strict"], "apply_ok": bool(p["apply_ok"]), "infra_error": None,
                "reason": str(outcome.info.get("reason") or ""), "reward": outcome.reward,
                "duration_s": time.monotonic() - start, "session_id": sid,
                "extra": outcome.info}
    return {"task_id": task.instance_id, "attempt": k, "version": version, "resolved": False, "f2p": 0.0,
            "strict": 0.0, "apply_ok": False, "infra_error": error, "reward": 0.0, "duration_s": 0.0,
            "session_id": "", "extra": {}}


async def evaluate_version(url: str, version: str, tasks: list[SweTask], spec: EvalSpec) -> list[dict[str, Any]]:
    """Every attempt of every task on one served version (model name), concurrently up to the bound."""
    env = SweEnv(spec.env, spec.out)
    asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(max_workers=64, thread_name_prefix="eval"))
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=5.0)) as http:
        jobs = [_attempt(env, http, url, version, t, k, spec) for t in tasks for k in range(spec.attempts)]
        records = await asyncio.gather(*jobs)
    env.close()
    return list(records)


def run_eval(spec: EvalSpec, versions: list[str] | None = None) -> dict[str, list[dict[str, Any]]]:
    """Start a replica serving the base and `spec.adapters`, evaluate each version; records by version."""
    from burstrl.inference.process import start_replica

    tasks = load_tasks(spec.tasks)
    spec.out.mkdir(parents=True, exist_ok=True)
    adapters = json.dumps({name: str(path) for name, path in spec.adapters.items()})
    replica = start_replica(spec.model, spec.out / "replica", "--adapters", adapters, "--engine.num_threads", "1",
                            "--server.admin_token", spec.admin_token, timeout=300)
    try:
        out = {}
        for version in versions or ["base", *spec.adapters]:
            print(f"evaluating {version}: {len(tasks)} tasks x {spec.attempts} attempts", flush=True)
            out[version] = asyncio.run(evaluate_version(replica.url, version, tasks, spec))
        return out
    finally:
        replica.stop()


def checkpoint_adapters(run_dir: Path, every: int) -> dict[str, Path]:
    """`step-N` -> its adapter, for every committed checkpoint whose N is a multiple of `every`."""
    found = {}
    for path in sorted((run_dir / "checkpoints").glob("step-*"), key=lambda p: int(p.name.split("-")[1])):
        step = int(path.name.split("-")[1])
        if step % every == 0 and (path / "adapter" / "adapter_config.json").exists():
            found[f"step-{step}"] = path / "adapter"
    if not found:
        raise ValueError(f"{run_dir}: no checkpoint adapter at a multiple of {every} steps")
    return found


def evaluate(spec: EvalSpec, exclude: set[str], compare: Path | None = None) -> tuple[Path, Path, Path]:
    """Evaluate base (unless adapters are given) and every adapter; write the report of the last one.

    With several adapters (`--run --every`), the report also holds the curve over checkpoints.
    """
    from burstrl.eval.passk import summarize
    from burstrl.eval.swe_report import load_results, make_results, write_eval_report

    versions = list(spec.adapters) or ["base"]
    by_version = run_eval(spec, versions)
    curve = []
    for version, records in by_version.items():
        overall = summarize(records, exclude=exclude)["overall"]
        step = int(version.split("-")[1]) if version.startswith("step-") else 0
        curve.append({"step": step, "version": version, **{k: overall.get(k) for k in ("pass@1", "f2p", "strict")}})
    last = versions[-1]
    config = {"model": str(spec.model), "version": last, "tasks": str(spec.tasks), "attempts": spec.attempts,
              "temperature": spec.temperature, "adapters": {k: str(v) for k, v in spec.adapters.items()}}
    results = make_results(by_version[last], config=config, exclude=exclude,
                           baseline=load_results(compare) if compare else None,
                           baseline_label=str(compare) if compare else "baseline",
                           curve=curve if len(curve) > 1 else None)
    return write_eval_report(results, spec.out)
