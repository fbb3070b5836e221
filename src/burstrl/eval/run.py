"""`burstrl eval`: K attempts per task of any environment with a model (and adapter versions).

Why the real stack: an evaluation must measure what training optimises, so each attempt is the
same `Environment.rollout` the orchestrator runs (for `swe`: a sandbox, the agent, commit-only
grading; for `toy`/`toy_multi`: the chat conversation and its verifiable reward), against a real
replica (`burstrl serve`) that serves the base model and every adapter evaluated, one version per
model name. Attempts run concurrently up to a bound; an infrastructure failure (`InfraError`, a
replica failure) is retried, never scored as a model failure; every attempt becomes one record in
the results JSON.

Tasks: `swe` reads a task file (`--tasks`, as `burstrl tasks` writes them); every other
environment makes its own (`Environment.make_tasks(n, seed, difficulty, split)`, the held-out
`test` split by default). Environment options are the environment's section of the orchestrator
config (`OrchestratorSection.swe` for `swe`), so an evaluation runs an environment exactly as a
training run configured the same way would.

A record: task_id, attempt, version, resolved (= `Outcome.passed`), reward, parts (the reward's
named parts), reason, infra_error, duration_s, session_id, extra (`Outcome.info`). Records of an
environment graded by tests (`swe`) also carry f2p, strict and apply_ok; the summary leaves those
metrics out where no record has them.
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

from burstrl.config import EngineConfig, OrchestratorSection, SweEnvConfig
from burstrl.config.run import VLLM_REPLICA_EXTRA_S
from burstrl.envs import get_env
from burstrl.envs.base import Environment, InfraError, Task, close_env

log = logging.getLogger("burstrl.eval")
INFRA_RETRIES = 2
TEST_FIELDS = ("f2p", "strict")  # parts an environment graded by tests reports (records carry them as fields)
OWN_START_TIMEOUT_S = 300.0  # the own engine loads and proves the model in seconds to a minute
VLLM_START_TIMEOUT_S = 900.0  # vLLM alone takes ~50-90 s (minutes on a loaded CPU), then the start probe


def eval_engine() -> EngineConfig:
    """The eval replica's engine by default: the own engine on one torch thread (attempts run
    concurrently in the replica's batch, so more threads buy little and would fight an RL run beside)."""
    return EngineConfig(num_threads=1)


@dataclass
class EvalSpec:
    model: Path
    tasks: Path | None = None  # a task file (swe); None = the environment makes them (n, split, difficulty, seed)
    attempts: int = 4
    adapters: dict[str, Path] = field(default_factory=dict)  # version name -> PEFT dir; "base" is always there
    temperature: float = 1.0
    seed: int = 0
    env: str = "swe"
    options: OrchestratorSection = field(default_factory=OrchestratorSection)  # the env reads its own section
    n: int = 8
    split: str = "test"
    difficulty: int = 1
    task_seed: int = 0
    max_tokens: int = 0  # of each call; 0 = the environment's (swe: max_tokens_per_call; else orchestrator's)
    concurrency: int = 4  # attempts running at once (swe: also bounded by its max_sandboxes)
    out: Path = Path("eval")
    admin_token: str = field(default_factory=lambda: uuid.uuid4().hex)  # the eval replica's, to release sessions
    engine: EngineConfig = field(default_factory=eval_engine)  # the replica's `engine` section (backend, vllm)
    dtype: str = "auto"  # the replica's model.dtype (auto = float32 on CPU, bfloat16 on GPU)

    @property
    def swe(self) -> SweEnvConfig:
        return self.options.swe


def load_eval_tasks(spec: EvalSpec, env: Environment | None = None) -> list[Task]:
    """The tasks evaluated: the task file's for `swe` (or any env given --tasks), else `make_tasks`."""
    if spec.tasks is not None:
        from burstrl.envs.swe.task import load_tasks

        if spec.env != "swe":
            raise ValueError(f"--tasks is for the swe environment; {spec.env} makes its own tasks (--n, --split)")
        return [Task(id=t.instance_id, env="swe", difficulty=t.difficulty, data=t.to_json())
                for t in load_tasks(spec.tasks)]
    if spec.env == "swe":
        raise ValueError("the swe environment needs --tasks FILE (see `burstrl tasks`)")
    env = env or get_env(spec.env, spec.options, spec.out)
    return env.make_tasks(spec.n, spec.task_seed, spec.difficulty, spec.split)


def _max_tokens(env: Environment, spec: EvalSpec) -> int:
    if spec.max_tokens:
        return spec.max_tokens
    cfg = getattr(env, "cfg", None)
    return int(getattr(cfg, "max_tokens_per_call", 0) or spec.options.max_tokens)


def make_record(task: Task, k: int, version: str, outcome: Any, duration_s: float, sid: str) -> dict[str, Any]:
    """The record of one graded attempt (see the module docstring)."""
    parts = {key: float(v) for key, v in outcome.parts.items()}
    record: dict[str, Any] = {"task_id": task.id, "attempt": k, "version": version, "resolved": bool(outcome.passed),
                              "reward": float(outcome.reward), "parts": parts,
                              "reason": str(outcome.info.get("reason") or ""), "infra_error": None}
    for key in TEST_FIELDS:
        if key in parts:
            record[key] = parts[key]
    if "apply_ok" in parts:
        record["apply_ok"] = bool(parts["apply_ok"])
    return record | {"duration_s": duration_s, "session_id": sid, "extra": dict(outcome.info)}


def infra_record(task: Task, k: int, version: str, error: str | None) -> dict[str, Any]:
    """The record of an attempt whose infrastructure failed every retry (not counted in n)."""
    return {"task_id": task.id, "attempt": k, "version": version, "resolved": False, "reward": 0.0, "parts": {},
            "reason": "", "infra_error": error, "duration_s": 0.0, "session_id": "", "extra": {}}


async def _attempt(env: Environment, http: httpx.AsyncClient, url: str, version: str, task: Task, k: int,
                   spec: EvalSpec, gate: asyncio.Semaphore) -> dict[str, Any]:
    """One attempt, retried on infrastructure failures; its record (a dict for the results JSON)."""
    from burstrl.orchestrator.client import ReplicaFailure, SessionClient, release

    error = None
    async with gate:
        for _ in range(INFRA_RETRIES + 1):
            sid = f"eval-{uuid.uuid4().hex}"
            client = SessionClient(http, url, sid, version, spec.temperature, _max_tokens(env, spec),
                                   seed=spec.seed * 100_003 + k)
            start = time.monotonic()
            try:
                outcome = await env.rollout(client, task)
                await release(http, url, sid, spec.admin_token)
            except (InfraError, ReplicaFailure) as exc:
                error = f"{type(exc).__name__}: {exc}"
                log.warning("attempt %s/%d: %s (retrying)", task.id, k, error)
                continue
            return make_record(task, k, version, outcome, time.monotonic() - start, sid)
    return infra_record(task, k, version, error)


async def evaluate_version(url: str, version: str, tasks: list[Task], spec: EvalSpec) -> list[dict[str, Any]]:
    """Every attempt of every task on one served version (model name), concurrently up to the bound."""
    env = get_env(spec.env, spec.options, spec.out)
    asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(max_workers=64, thread_name_prefix="eval"))
    gate = asyncio.Semaphore(spec.concurrency)
    try:
        async with httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=5.0)) as http:
            jobs = [_attempt(env, http, url, version, t, k, spec, gate) for t in tasks for k in range(spec.attempts)]
            records = await asyncio.gather(*jobs)
    finally:
        await close_env(env)
    return list(records)


def _changed(section: dict[str, Any], default: dict[str, Any], prefix: str) -> list[str]:
    """`--prefix.key=VALUE` for each leaf of `section` that differs from `default` (values as JSON, so a
    string that looks like a number stays a string)."""
    args = []
    for key, value in section.items():
        if isinstance(value, dict) and isinstance(default.get(key), dict):
            args += _changed(value, default[key], f"{prefix}.{key}")
        elif value != default.get(key):
            args.append(f"--{prefix}.{key}={json.dumps(value)}")
    return args


def replica_args(spec: EvalSpec) -> list[str]:
    """The eval replica's serve overrides for its engine and dtype: what differs from `burstrl serve`'s
    defaults. engine.num_threads is the own engine's torch threads; vLLM does not read it, so a vllm
    replica does not get it (its cores are engine.vllm.cpu_cores)."""
    engine = spec.engine.model_dump(mode="json")
    if spec.engine.backend == "vllm":
        engine.pop("num_threads")
    args = _changed(engine, EngineConfig().model_dump(mode="json"), "engine")
    return args + ([f"--model.dtype={spec.dtype}"] if spec.dtype != "auto" else [])


def replica_start_timeout(spec: EvalSpec) -> float:
    """How long the eval replica may take to say ready: vLLM's start (and its own deadline) is far
    longer than the own engine's."""
    if spec.engine.backend == "vllm":
        return max(VLLM_START_TIMEOUT_S, spec.engine.vllm.start_timeout_s + VLLM_REPLICA_EXTRA_S)
    return OWN_START_TIMEOUT_S


def run_eval(spec: EvalSpec, versions: list[str] | None = None) -> dict[str, list[dict[str, Any]]]:
    """Start a replica serving the base and `spec.adapters`, evaluate each version; records by version."""
    from burstrl.protocol.process import start_replica

    spec.out.mkdir(parents=True, exist_ok=True)
    tasks = load_eval_tasks(spec)
    adapters = json.dumps({name: str(path) for name, path in spec.adapters.items()})
    replica = start_replica(spec.model, spec.out / "replica", "--adapters", adapters, *replica_args(spec),
                            "--server.admin_token", spec.admin_token, timeout=replica_start_timeout(spec))
    try:
        out = {}
        for version in versions or ["base", *spec.adapters]:
            print(f"evaluating {version} on {spec.env}: {len(tasks)} tasks x {spec.attempts} attempts", flush=True)
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


def eval_config(spec: EvalSpec, version: str) -> dict[str, Any]:
    """What the report's header shows: the environment first, then where its tasks came from."""
    config: dict[str, Any] = {"env": spec.env, "model": str(spec.model), "version": version}
    if spec.tasks is not None:
        config["tasks"] = str(spec.tasks)
    else:
        config |= {"tasks": f"{spec.env}.make_tasks", "n": spec.n, "split": spec.split,
                   "difficulty": spec.difficulty, "task_seed": spec.task_seed}
    return config | {"attempts": spec.attempts, "temperature": spec.temperature,
                     "adapters": {k: str(v) for k, v in spec.adapters.items()}}


def evaluate(spec: EvalSpec, exclude: set[str], compare: Path | None = None) -> tuple[Path, Path, Path]:
    """Evaluate base (unless adapters are given) and every adapter; write the report of the last one.

    With several adapters (`--run --every`), the report also holds the curve over checkpoints.
    """
    from burstrl.eval.passk import summarize
    from burstrl.eval.swe_report import CURVE_METRICS, load_results, make_results, write_eval_report

    versions = list(spec.adapters) or ["base"]
    by_version = run_eval(spec, versions)
    curve = []
    for version, records in by_version.items():
        overall = summarize(records, exclude=exclude)["overall"]
        step = int(version.split("-")[1]) if version.startswith("step-") else 0
        curve.append({"step": step, "version": version, **{k: overall.get(k) for k in CURVE_METRICS}})
    last = versions[-1]
    results = make_results(by_version[last], config=eval_config(spec, last), exclude=exclude,
                           baseline=load_results(compare) if compare else None,
                           baseline_label=str(compare) if compare else "baseline",
                           curve=curve if len(curve) > 1 else None)
    return write_eval_report(results, spec.out)
