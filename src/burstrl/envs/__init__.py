"""Environments: tasks, the rollout loop an agent runs against the model, and verifiable rewards.

Owns task generation, the conversation of one attempt and its grading. It talks to the model only
through a `ChatClient` the orchestrator binds to one session on the router (OpenAI API over
HTTP); the orchestrator writes the graded outcome and the captured calls to the rollout store. Each
environment's SFT warm start lives beside it (`toy_warm`, `swe/warm.py`) and calls the trainer's
generic `sft`.

Modules: base (the protocol), registry (names and `module:Class` to environments, and their
options), toy (single-turn copy-the-letters), toy_multi (the multi-turn variant), toy_eval and
toy_warm (scoring and the warm start of the toy model), swe (coding tasks in sandboxes, graded by
tests).
"""

from __future__ import annotations

from burstrl.envs.base import ChatClient, Environment, InfraError, Outcome, Task
from burstrl.envs.registry import ENV_NAMES, check_env, env_class, get_env, options_key, register

__all__ = ["ENV_NAMES", "ChatClient", "Environment", "InfraError", "Outcome", "Task", "check_env", "env_class",
           "get_env", "options_key", "register"]
