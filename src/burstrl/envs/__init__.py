"""Environments: tasks, the rollout loop an agent runs against the model, and verifiable rewards.

Owns task generation, the conversation of one attempt and its grading. It talks to the model only
through a `ChatClient` the orchestrator binds to one session on the router (OpenAI API over
HTTP); the orchestrator writes the graded outcome and the captured calls to the rollout store. The
SFT warm start (`burstrl.trainer.sft`) uses the same environments' demonstrations.

Modules: base (the protocol), toy (single-turn copy-the-letters), toy_multi (the multi-turn variant).
"""

from __future__ import annotations

from burstrl.envs.base import ChatClient, Environment, Outcome, Task

ENV_NAMES = ("toy", "toy_multi")


def get_env(name: str) -> Environment:
    """The environment registered under `name` (ValueError naming the choices otherwise)."""
    if name == "toy":
        from burstrl.envs.toy import ToyEnv

        return ToyEnv()
    if name == "toy_multi":
        from burstrl.envs.toy_multi import MultiToyEnv

        return MultiToyEnv()
    raise ValueError(f"unknown environment {name!r}; choose from {', '.join(ENV_NAMES)}")


__all__ = ["ENV_NAMES", "ChatClient", "Environment", "Outcome", "Task", "get_env"]
