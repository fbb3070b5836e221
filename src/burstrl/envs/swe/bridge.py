"""Run an unmodified mini-swe-agent (PyPI `mini-swe-agent`, 2.x) on our sandboxes and our router.

Why a bridge and not a fork: the point is to show that any OpenAI-speaking harness trains and
evaluates on burstrl unchanged. Two seams are enough, both public in mini-swe-agent:
- its `Environment` protocol (`execute(action, cwd="", *, timeout=None) -> {"output",
  "returncode", "exception_info"}`, raising `Submitted` when the output's first line is the
  sentinel, as its `LocalEnvironment` does), implemented here by `SandboxEnvironment` over sandboxd;
- its model, which is its own `LitellmTextbasedModel` (litellm's `openai/` provider pointed at
  `{base_url}/v1`, the router or a replica), with the session id sent both as the `X-Session-ID`
  header and as `session_id` in the body (`extra_headers`, `extra_body`), so routing, the session
  KV cache and capture apply to every call exactly as for our own agent.

Configuration, not code, adapts it: short templates (the tiny model has 4096 positions), the
```bash action regex our own agent uses, cost tracking off (a local model has no price), and,
before mini-swe-agent/litellm are first imported, environment defaults that keep them off the
network and quiet: `LITELLM_LOCAL_MODEL_COST_MAP` (litellm otherwise fetches its price list from
GitHub at import), `MSWEA_SILENT_STARTUP`, and `MSWEA_MODEL_RETRY_STOP_AFTER_ATTEMPT=2`
(mini-swe-agent otherwise retries a failing call 10 times with waits up to a minute: a dead
replica is the scheduler's to retry elsewhere). Each is a `setdefault`, so the user's own wins.

Token continuity: well-formed turns extend the session's last call (checked: no continuity break
on the replica, the sampled ids reused). A reply with no (or several) ```bash blocks is different:
mini-swe-agent 2.x keeps such a reply only inside the error message's `extra`, not as an assistant
message, so the next call does not extend the last one and the replica re-tokenizes it (a counted
continuity break). Each captured call is still exact; it is mini-swe-agent's behaviour, left as is.

mini-swe-agent is synchronous: call `run_minisweagent` from a worker thread in async code.
Importing this module does not import mini-swe-agent (a dev extra); `run_minisweagent` does.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

from burstrl.envs.swe.agent import (
    GIT_ENV,
    REPO_DIR,
    SUBMIT_SENTINEL,
    SYSTEM_PROMPT,
    cap_output,
)
from burstrl.envs.swe.task import SweTask
from burstrl.protocol.http import SESSION_HEADER

ACTION_REGEX = r"```bash[ \t]*\n(.*?)```"
OBSERVATION_TEMPLATE = ("{% if output.exception_info %}{{output.exception_info}}\n{% endif %}"
                        "exit code: {{output.returncode}}\n{{output.output}}")
FORMAT_ERROR_TEMPLATE = "Format error: {{error}} Reply with exactly one ```bash block."

_ENV_DEFAULTS = {"LITELLM_LOCAL_MODEL_COST_MAP": "True", "MSWEA_SILENT_STARTUP": "1",
                 "MSWEA_MODEL_RETRY_STOP_AFTER_ATTEMPT": "2"}


def _prepare_import() -> None:
    """Set the environment defaults above; must run before minisweagent or litellm is imported."""
    for key, value in _ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)


@dataclass
class SandboxEnvironmentConfig:
    """What mini-swe-agent reads from `env.config` (serialized into its trajectory)."""

    cwd: str = REPO_DIR
    timeout: int = 30
    max_output_chars: int = 1000
    env: dict[str, str] = field(default_factory=dict)

    def model_dump(self, mode: str = "python") -> dict[str, Any]:  # mini-swe-agent's pydantic-style call
        return {"cwd": self.cwd, "timeout": self.timeout, "max_output_chars": self.max_output_chars,
                "env": dict(self.env)}


class SandboxEnvironment:
    """mini-swe-agent's Environment protocol, backed by a burstrl sandbox (sync `exec`)."""

    def __init__(self, sandbox: Any, **kwargs: Any) -> None:
        self.sandbox = sandbox
        self.config = SandboxEnvironmentConfig(**kwargs)
        self.commands = 0

    def execute(self, action: dict, cwd: str = "", *, timeout: int | None = None) -> dict[str, Any]:
        """Run the action's command in the sandbox; stdout and stderr are merged like LocalEnvironment's."""
        command = action.get("command", "")
        self.commands += 1
        result = self.sandbox.exec(command, timeout=timeout or self.config.timeout,
                                   cwd=cwd or self.config.cwd, env={**GIT_ENV, **self.config.env})
        raw = result.stdout + result.stderr
        output = {"output": cap_output(raw, self.config.max_output_chars), "returncode": result.exit_code,
                  "exception_info": f"The command timed out after {timeout or self.config.timeout}s."
                  if result.timed_out else ""}
        self._check_finished(raw, output)
        return output

    def _check_finished(self, raw: str, output: dict[str, Any]) -> None:
        """Raise mini-swe-agent's `Submitted` on the sentinel, exactly as its LocalEnvironment does."""
        from minisweagent.exceptions import Submitted

        lines = raw.lstrip().splitlines(keepends=True)
        if lines and lines[0].strip() == SUBMIT_SENTINEL and output["returncode"] == 0:
            submission = "".join(lines[1:])
            raise Submitted({"role": "exit", "content": submission,
                             "extra": {"exit_status": "Submitted", "submission": submission}})

    def get_template_vars(self, **kwargs: Any) -> dict[str, Any]:
        return {**self.config.model_dump(), **kwargs}

    def serialize(self) -> dict[str, Any]:
        return {"info": {"config": {"environment": self.config.model_dump(mode="json"),
                                    "environment_type": f"{type(self).__module__}.{type(self).__name__}"}}}


def make_model(base_url: str, model_name: str, session_id: str, max_tokens: int = 256,
               temperature: float = 1.0, timeout_s: float = 120.0) -> Any:
    """mini-swe-agent's own text-based litellm model, pointed at our OpenAI-compatible endpoint."""
    _prepare_import()
    from minisweagent.models.litellm_textbased_model import LitellmTextbasedModel

    kwargs = {"api_base": f"{base_url.rstrip('/')}/v1", "api_key": "burstrl", "max_tokens": max_tokens,
              "temperature": temperature, "timeout": timeout_s,
              "extra_headers": {SESSION_HEADER: session_id}, "extra_body": {"session_id": session_id}}
    return LitellmTextbasedModel(model_name=f"openai/{model_name}", model_kwargs=kwargs,
                                 cost_tracking="ignore_errors", action_regex=ACTION_REGEX,
                                 format_error_template=FORMAT_ERROR_TEMPLATE,
                                 observation_template=OBSERVATION_TEMPLATE)


def run_minisweagent(task: SweTask, sandbox: Any, base_url: str, model_name: str, session_id: str,
                     step_limit: int = 8, max_tokens: int = 256, temperature: float = 1.0,
                     max_seconds: int = 300, command_timeout_s: int = 30) -> dict[str, Any]:
    """One attempt by mini-swe-agent's `DefaultAgent`; returns its exit status, submission and messages.

    A context overflow ends the attempt (exit status `ContextWindowExceededError`) instead of
    raising: running out of context is an outcome of the attempt, not a fault of the fleet.
    """
    _prepare_import()
    import litellm
    from minisweagent.agents.default import DefaultAgent

    litellm.suppress_debug_info = True  # else it prints a provider list on every uncosted call

    model = make_model(base_url, model_name, session_id, max_tokens, temperature)
    env = SandboxEnvironment(sandbox, timeout=command_timeout_s)
    agent = DefaultAgent(model, env, system_template=SYSTEM_PROMPT, instance_template="{{task}}",
                         step_limit=step_limit, cost_limit=0, wall_time_limit_seconds=max_seconds,
                         max_consecutive_format_errors=3)
    start = time.monotonic()
    try:
        info = agent.run(task.problem_statement)
    except litellm.exceptions.ContextWindowExceededError:
        info = agent.messages[-1].get("extra", {})
    status = info.get("exit_status", "")
    return {"exit_status": status, "submitted": status == "Submitted", "submission": info.get("submission", ""),
            "model_calls": agent.n_calls, "commands": env.commands, "seconds": time.monotonic() - start,
            "messages": [{k: v for k, v in m.items() if k != "extra"} for m in agent.messages]}
