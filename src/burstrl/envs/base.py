"""The environment protocol: what the orchestrator needs from any environment.

Why a rollout method and not reset/step: an agent's loop (how many calls, what it does between
them) belongs to the environment, and the orchestrator only needs the graded outcome. The
environment talks to the model through a `ChatClient` bound to one session, so every call of a
rollout lands on the same replica, reuses its KV cache, and is captured there with exact token
ids; the orchestrator then reads the captured calls (the training data) from the replica's trace.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Protocol


class InfraError(RuntimeError):
    """The environment's infrastructure failed (a sandbox did not start, grading timed out), not the
    model: the orchestrator re-runs the attempt under a new id instead of scoring it."""


class ReplicaFailure(RuntimeError):
    """The fleet failed this attempt (replica gone, version gone, capture lost): retry it elsewhere.
    Raised by the orchestrator's session client, and by an environment whose own model client
    met such a failure (envs.ecosystem)."""


class VersionGone(ReplicaFailure):
    """No replica serves the group's version any more: the whole group restarts on a newer one."""


def fleet_failure(status: int, detail: str, what: str) -> ReplicaFailure | None:
    """The fleet's failure a router answer to a generation, assign or trace call means, else None.

    5xx: a replica (or the router) failed; 404/409: the session or its version moved (`VersionGone`
    when the answer names the model, so the group restarts on a newer version); 408/429: a timeout
    or shed load on the way (burstrl's router sends neither, a proxy or an SDK's own mapping may).
    Any other 4xx is the caller's own bad request, never the fleet's. One rule for the orchestrator's
    client, the transport under an environment's SDK and verifiers' error objects.
    """
    detail = detail[:300]
    if status in (404, 409) and "model" in detail:
        return VersionGone(f"{what}: {status} {detail}")
    if status >= 500 or status in (404, 408, 409, 429):
        return ReplicaFailure(f"{what}: {status} {detail}")
    return None


@dataclass
class Task:
    """One task: an id unique across the run, its environment, difficulty and env-specific data (JSON)."""

    id: str
    env: str
    difficulty: int
    data: dict[str, Any] = field(default_factory=dict)


@dataclass
class Outcome:
    """A graded rollout: total reward, its named parts, and whether it counts as a pass."""

    reward: float
    parts: dict[str, float] = field(default_factory=dict)
    passed: bool = False
    info: dict[str, Any] = field(default_factory=dict)


class ChatClient(Protocol):
    """One session's OpenAI chat client (model, sampling and session id are bound by the orchestrator)."""

    calls: int  # chat calls made so far in this session

    async def chat(self, messages: list[dict[str, str]], max_tokens: int | None = None) -> str:
        """The assistant's reply text to `messages` (the whole conversation so far)."""
        ...

    async def complete(self, prompt: str, max_tokens: int | None = None, stop: list[str] | None = None) -> str:
        """The model's continuation of `prompt` as plain text (no chat template: base models)."""
        ...


class SessionChatClient(ChatClient, Protocol):
    """What an environment that brings its own model client (envs.ecosystem) needs of the session:
    the router, the session's id, version and sampling, and an HTTP client for its SDK that pins
    every call to them (the orchestrator's `SessionClient`)."""

    router: str
    session_id: str
    model: str
    temperature: float
    max_tokens: int
    seed: int

    def sdk_http(self) -> Any:
        """An `httpx.AsyncClient` whose generation calls are this session's, counted in `calls`."""
        ...

    def raise_failure(self) -> None:
        """Raise the fleet failure (the orchestrator's ReplicaFailure) an SDK call met, if any."""
        ...


class Environment(Protocol):
    """Tasks, a rollout loop against a chat client, rewards with named parts, and demonstrations."""

    name: str
    max_difficulty: int

    def make_tasks(self, n: int, seed: int, difficulty: int = 1, split: str = "train") -> list[Task]:
        """`n` tasks; the same arguments always give the same tasks, with ids unique across calls."""
        ...

    async def rollout(self, client: ChatClient, task: Task) -> Outcome:
        """Run one attempt at `task` through `client` and grade it."""
        ...

    def demonstrations(self, tasks: list[Task]) -> list[dict[str, list[dict[str, str]]]]:
        """Chat rows `{"messages": [...]}` with correct replies, for the SFT warm start."""
        ...


async def close_env(env: object) -> None:
    """Stop what an environment holds (sandboxes, a server it started, an adapter's serving loop).

    Optional on an environment: `async aclose()` (awaited on the loop its rollouts ran on: an
    adapter's servers live there) or `close()` (run in a thread: it may block on processes).
    """
    aclose = getattr(env, "aclose", None)
    if aclose is not None:
        await aclose()
        return
    close = getattr(env, "close", None)
    if close is not None:
        await asyncio.to_thread(close)
