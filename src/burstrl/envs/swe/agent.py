"""The minimal bash agent: one fenced bash command per turn, its output back as the next message.

Why this shape (mini-swe-agent's): the whole agent is a loop over "ask the model, run its one
command, show it the result", so every sampled token is a command or its reasoning, the trace the
trainer learns from is exactly the conversation, and there is no tool-calling format for a tiny
model to learn first. The attempt ends when the model commits and prints the submit sentinel
(mini-swe-agent's convention), or at a turn, token, time or format-error limit.

Why the whole conversation goes into every call: the replica keeps the session's KV cache and
rebuilds the prompt from the previous prompt ids + the sampled ids (token continuity) only when a
call's messages extend the last call's. The one exception is context truncation (see
`fit_context`): a model with a short context (the tiny Qwen3 has 4096 positions) cannot hold
eight 2,000-character observations, so when the conversation passes `max_context_chars` the
oldest observations are elided, down to half the budget at once so that this re-tokenization
(a counted continuity break on the replica) happens rarely, not on every later turn.

The sandbox is anything with `exec(cmd, timeout=, cwd=, env=)` returning an `ExecResult`: a
`Sandbox` (sync, run in a worker thread) or an `AsyncSandboxClient` (awaited).

Why a sandbox that dies under a command ends the attempt instead of raising: every exec runs a
command the model wrote, in a sandbox that answered before it (the repo was uploaded), so a daemon
killed or OOM-killed by `kill -9 -1` or a filled tmpfs is the model's doing. The attempt stops with
`exit_reason="sandbox_lost"` and the error kept; the caller scores it 0. Re-running it as an infra
fault would let the policy erase its failures (and loop a group forever).
"""

from __future__ import annotations

import asyncio
import math
import re
import time
from dataclasses import dataclass, field
from typing import Any

from burstrl.envs.base import ChatClient
from burstrl.envs.swe.task import SweTask
from burstrl.sandbox.client import SandboxError

REPO_DIR = "/work/repo"
SUBMIT_SENTINEL = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
SUBMIT_COMMAND = f"echo {SUBMIT_SENTINEL}"
# Estimate only: the ChatClient returns text, not usage. The exact counts are in the replica's trace.
CHARS_PER_TOKEN = 3.0
# So that `git commit` works without the model configuring git first (not what is being tested).
GIT_ENV = {"GIT_AUTHOR_NAME": "agent", "GIT_AUTHOR_EMAIL": "agent@burstrl.invalid",
           "GIT_COMMITTER_NAME": "agent", "GIT_COMMITTER_EMAIL": "agent@burstrl.invalid"}

SYSTEM_PROMPT = f"""You fix bugs in the git repository at {REPO_DIR}.
Each reply: exactly one bash command in a ```bash block. You will see its output.
When done, commit: git commit -am "fix", then reply with: {SUBMIT_COMMAND}"""

_BASH_BLOCK = re.compile(r"```bash[ \t]*\n(.*?)```", re.DOTALL)
_ELIDED = "[old output elided to fit the context]"


@dataclass
class AgentLimits:
    """When an attempt stops. Defaults fit the tiny model's 4096-token context."""

    max_turns: int = 8  # model calls, format errors included
    max_tokens_per_call: int = 256
    max_total_tokens: int = 2048  # completion tokens over the attempt (estimated from text length)
    max_seconds: float = 300.0  # wall clock for the whole attempt
    command_timeout_s: float = 30.0
    max_output_chars: int = 2000  # per observation, head and tail kept
    max_format_errors: int = 3  # replies without exactly one bash block, over the attempt
    max_context_chars: int = 6000  # ~2,400 prompt tokens for the tiny tokenizer (~2.5 chars/token)


@dataclass
class AgentResult:
    """How an attempt ended. `transcript` has one record per turn; `messages` is the last conversation."""

    submitted: bool
    turns: int
    exit_reason: str  # submitted | max_turns | max_tokens | timeout | format_errors | sandbox_lost
    transcript: list[dict[str, Any]] = field(default_factory=list)
    messages: list[dict[str, str]] = field(default_factory=list)
    format_errors: int = 0
    est_completion_tokens: int = 0
    seconds: float = 0.0
    sandbox_error: str = ""  # why the sandbox stopped answering (exit_reason "sandbox_lost")


class SandboxLost(Exception):
    """The sandbox died or stopped answering under one of the model's commands (the model's doing)."""


def is_sandbox_lost(exc: BaseException) -> bool:
    """Whether a sandbox call's error means the sandbox is gone, not that one request was refused.

    A 4xx is the daemon refusing a request (bad cwd, too big): it is alive. 5xx (500 daemon error,
    503 unreachable, 504 no answer in time) and socket errors: it died or hangs.
    """
    if isinstance(exc, SandboxError):
        return exc.status >= 500
    return isinstance(exc, OSError)


def extract_commands(reply: str) -> list[str]:
    """Every ```bash fenced block in the reply, stripped (other languages and bare fences don't count)."""
    return [block.strip() for block in _BASH_BLOCK.findall(reply)]


def is_submission(command: str, stdout: str, exit_code: int) -> bool:
    """Submitted when the command is exactly the sentinel echo, or its output starts with the sentinel."""
    if command.strip() == SUBMIT_COMMAND:
        return True
    lines = stdout.lstrip().splitlines()
    return exit_code == 0 and bool(lines) and lines[0].strip() == SUBMIT_SENTINEL


def cap_output(text: str, max_chars: int) -> str:
    """Head and tail of `text` around a marker saying how much was dropped: errors are usually at the end."""
    if len(text) <= max_chars:
        return text
    head = max_chars // 2
    tail = max_chars - head
    return f"{text[:head]}\n[... {len(text) - max_chars} characters elided ...]\n{text[-tail:]}"


def format_observation(result: Any, max_chars: int) -> str:
    """The next user message: exit code, then stdout and stderr, capped together."""
    parts = [f"exit code: {result.exit_code}" + (" (timed out)" if result.timed_out else "")]
    if result.stdout:
        parts.append(result.stdout.rstrip("\n"))
    if result.stderr:
        parts.append("stderr:\n" + result.stderr.rstrip("\n"))
    return cap_output("\n".join(parts), max_chars)


def format_error_message(commands: list[str]) -> str:
    if len(commands) == 1:
        return "Format error: the ```bash block is empty; put one command in it."
    return f"Format error: found {len(commands)} ```bash blocks; reply with exactly one."


def initial_messages(task: SweTask) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": task.problem_statement.strip()}]


def fit_context(messages: list[dict[str, str]], max_chars: int) -> bool:
    """Elide the oldest observations (never the prompt, replies or the newest message) until the
    conversation is at most half of `max_chars`, once it passes `max_chars`. Returns whether it elided.

    Half, not just under the limit: every elision re-tokenizes the prompt on the replica, so it
    should happen once per several turns, not on every turn after the context fills up.
    """
    total = sum(len(m["content"]) for m in messages)
    if total <= max_chars:
        return False
    for m in messages[2:-1]:
        if total <= max_chars // 2:
            break
        if m["role"] == "user" and m["content"] != _ELIDED:
            total -= len(m["content"]) - len(_ELIDED)
            m["content"] = _ELIDED
    return True


def estimate_tokens(text: str) -> int:
    return math.ceil(len(text) / CHARS_PER_TOKEN)


async def run_command(sandbox: Any, command: str, timeout: float) -> Any:
    """Run one command in the repo; sync sandboxes run in a worker thread so the event loop keeps going."""
    kwargs = {"timeout": timeout, "cwd": REPO_DIR, "env": GIT_ENV}
    if asyncio.iscoroutinefunction(sandbox.exec):
        return await sandbox.exec(command, **kwargs)
    return await asyncio.to_thread(sandbox.exec, command, **kwargs)


def _stop_reason(limits: AgentLimits, turns: int, tokens: int, deadline: float,
                 format_errors: int) -> str | None:
    if format_errors >= limits.max_format_errors:
        return "format_errors"
    if turns >= limits.max_turns:
        return "max_turns"
    if tokens >= limits.max_total_tokens:
        return "max_tokens"
    if time.monotonic() >= deadline:
        return "timeout"
    return None


async def run_agent(client: ChatClient, sandbox: Any, task: SweTask,
                    limits: AgentLimits | None = None) -> AgentResult:
    """One attempt at `task`: the model's commands run in `sandbox`, whose repo is at /work/repo.

    A sandbox that dies under a command ends the attempt as `sandbox_lost` (see the module
    docstring). Replica failures propagate: they are infrastructure faults the caller retries.
    """
    limits = limits or AgentLimits()
    start = time.monotonic()
    deadline = start + limits.max_seconds
    messages = initial_messages(task)
    transcript: list[dict[str, Any]] = []
    tokens = format_errors = 0
    sandbox_error = ""
    while (reason := _stop_reason(limits, len(transcript), tokens, deadline, format_errors)) is None:
        elided = fit_context(messages, limits.max_context_chars)
        max_tokens = min(limits.max_tokens_per_call, limits.max_total_tokens - tokens)
        try:
            reply = await asyncio.wait_for(client.chat(list(messages), max_tokens=max_tokens),
                                           timeout=max(deadline - time.monotonic(), 0.001))
        except asyncio.TimeoutError:  # (the builtin TimeoutError only from Python 3.11)
            reason = "timeout"
            break
        tokens += estimate_tokens(reply)
        messages.append({"role": "assistant", "content": reply})
        try:
            step = await _act(sandbox, reply, limits, deadline)
        except SandboxLost as exc:
            transcript.append({"turn": len(transcript) + 1, "reply": reply, "context_elided": elided,
                               "command": extract_commands(reply)[0], "format_error": False,
                               "submitted": False, "sandbox_error": str(exc)})
            reason, sandbox_error = "sandbox_lost", str(exc)
            break
        step.update(turn=len(transcript) + 1, reply=reply, context_elided=elided)
        transcript.append(step)
        format_errors += step["format_error"]
        messages.append({"role": "user", "content": step["observation"]})
        if step["submitted"]:
            reason = "submitted"
            break
    return AgentResult(submitted=reason == "submitted", turns=len(transcript), exit_reason=reason,
                       transcript=transcript, messages=messages, format_errors=format_errors,
                       est_completion_tokens=tokens, seconds=time.monotonic() - start,
                       sandbox_error=sandbox_error)


async def _act(sandbox: Any, reply: str, limits: AgentLimits, deadline: float) -> dict[str, Any]:
    """Run the reply's one command, or say why there is none; returns the turn's record."""
    commands = extract_commands(reply)
    if len(commands) != 1 or not commands[0]:
        return {"command": None, "format_error": True, "submitted": False, "exit_code": None,
                "timed_out": False, "observation": format_error_message(commands), "exec_s": 0.0}
    command = commands[0]
    timeout = max(1.0, min(limits.command_timeout_s, deadline - time.monotonic()))
    try:
        result = await run_command(sandbox, command, timeout)
    except (SandboxError, OSError) as exc:
        if not is_sandbox_lost(exc):
            return {"command": command, "format_error": False, "submitted": False, "exit_code": None,
                    "timed_out": False, "observation": f"error: {exc}", "exec_s": 0.0}
        raise SandboxLost(f"{type(exc).__name__}: {exc}") from exc
    return {"command": command, "format_error": False,
            "submitted": is_submission(command, result.stdout, result.exit_code),
            "exit_code": result.exit_code, "timed_out": result.timed_out,
            "observation": format_observation(result, limits.max_output_chars),
            "exec_s": result.duration_s}
