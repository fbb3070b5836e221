"""Environments: tasks, the rollout loop an agent runs against the model, and verifiable rewards.

Owns task generation, the conversation of one attempt and its grading. It talks to the model only
through a `ChatClient` the orchestrator binds to one session on the router (OpenAI API over
HTTP); the orchestrator writes the graded outcome and the captured calls to the rollout store. The
SFT warm start (`burstrl.trainer.sft`) uses the same environments' demonstrations.

Modules: base (the protocol), toy (single-turn copy-the-letters), toy_multi (the multi-turn variant),
swe (coding tasks in sandboxes, graded by tests).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from burstrl.envs.base import ChatClient, Environment, InfraError, Outcome, Task

ENV_NAMES = ("toy", "toy_multi", "swe")


def get_env(name: str, options: Any = None, run_dir: str | Path | None = None) -> Environment:
    """The environment registered under `name` (ValueError naming the choices otherwise).

    `options` is the orchestrator's config (environments read their own section of it, e.g. `swe`);
    `run_dir` is where an environment may keep files (generated tasks).
    """
    if name == "toy":
        from burstrl.envs.toy import ToyEnv

        return ToyEnv()
    if name == "toy_multi":
        from burstrl.envs.toy_multi import MultiToyEnv

        return MultiToyEnv()
    if name == "swe":
        from burstrl.config import SweEnvConfig
        from burstrl.envs.swe.env import SweEnv

        cfg = getattr(options, "swe", None) or SweEnvConfig()
        return SweEnv(cfg, Path(run_dir or "."))
    raise ValueError(f"unknown environment {name!r}; choose from {', '.join(ENV_NAMES)}")


__all__ = ["ENV_NAMES", "ChatClient", "Environment", "InfraError", "Outcome", "Task", "get_env"]
