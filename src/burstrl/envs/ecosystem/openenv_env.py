"""`OpenEnvEnv`: an OpenEnv environment server, trained on unmodified, as the environment "openenv:<spec>".

`<spec>` is the URL of a running server (`http://host:port`, `https://`, `ws://`, `wss://`; a path
prefix is kept) or a container image name, which the adapter runs itself (`openenv_docker`: port
8000 of the image, on a loopback port, stopped by `close()` or at exit). The server is spoken to
over its `/ws` socket with `websockets` (`openenv_ws`); openenv itself (and the gradio it imports)
is never imported in the orchestrator.

The LLM glue (OpenEnv environments never call a model) is verifiers' OpenEnv convention
(`verifiers/v1/tasksets/openenv/taskset.py`), so a policy sees the same user turns in both trainers:
- each user turn is `json.dumps({"observation": <the observation's fields>, "action_schema":
  <GET /schema's "action">})`, after an optional system prompt; the conversation grows by one
  reply and one observation per step, every call through `client.chat` (one session);
- the reply is the action: a JSON object (a reply wrapped whole in a ``` fence is unwrapped), or,
  for a schema with exactly one required field, the value of that field (JSON if it parses, else
  the raw text);
- rewards of the steps are summed (the reset's is not counted); the episode ends at `done`, after
  `max_turns` steps, or before the conversation would pass `max_context_chars`.
Not handled: MCP tool environments (verifiers lists their tools first; here the model sees only the
generic action schema) and openenv's task API (`/{env}/tasks`).

Outcome: reward = the summed step rewards, each clipped to +-`reward_clip` (a boolean reward is 1 or
0, as openenv allows), 0 on the model's failure; parts `env_reward` (the sum) and `valid` (0 on the
model's failure); info `ended` (done, max_turns, context or invalid), `steps`, `rewards` (clipped),
`clipped_steps` when any was, and on the model's failure `reason`: "bad_reply: ..." or
"action_rejected: ...".

Whose fault (an `InfraError` re-runs the attempt; an outcome with a reason is stored, reward 0):
- the model's: a reply that is not an action (empty, not an object where the schema needs one,
  NaN/Infinity), and an action the server refuses (VALIDATION_ERROR) or fails on (EXECUTION_ERROR:
  the environment raised while running the action). The second may be a bug of the environment, but
  only the action triggered it, and re-running would let a policy stall its own training by
  provoking it;
- the model's too: anything that goes wrong with the server once an action was sent (no answer
  within `timeout_s`, the connection closed, a frame that is not the documented shape):
  "env_failed_after_action: ...". An action can crash or hang a server; were that an infra error,
  the attempt would re-run unscored, and a policy could farm re-runs instead of taking a 0;
- infra: what happens before the model acts: the server unreachable, no /schema (fetched once, in
  the adapter's own thread, within `timeout_s` overall; a failure is remembered for RETRY_PREPARE_S,
  in which attempts fail at once instead of each asking again), a bad frame or an error frame to
  `reset`, a server at capacity for longer than `timeout_s`, an episode done at reset or whose first
  observation does not fit `max_context_chars` (the model never got a turn: a rollout needs at least
  one call);
- the fleet's: `client.chat` raises `ReplicaFailure`, which propagates (the attempt re-runs).

Tasks: OpenEnv environments have no task list; a task is a reset seed, hashed from (split, seed,
index): even seeds for the train split, odd ones for every other, so held-out resets never repeat
training ones. The server gets `{**reset_args, "seed": <seed>, "episode_id": <session id>}` (it
drops what its `reset` does not take). passed = no failure and summed reward >= `pass_reward`.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from pydantic import Field

from burstrl.config import Section
from burstrl.envs.base import ChatClient, InfraError, Outcome, Task
from burstrl.envs.ecosystem.openenv_docker import Container, check_image
from burstrl.envs.ecosystem.openenv_ws import (
    ActionRejected,
    AtCapacity,
    Endpoint,
    EnvSocket,
    StepResult,
    endpoint,
    fetch_action_schema,
    is_url,
    probe,
)

# How long a failed preparation (the server's /schema, or its container) is remembered: attempts in that
# time fail at once (InfraError, re-run later) instead of each asking a server that just failed.
RETRY_PREPARE_S = 10.0
SYSTEM_PROMPT = ("You act in an environment. Each user message is JSON: the current observation and the "
                 "JSON schema of an action. Reply with the action only, as a JSON object that matches the schema.")


class OpenEnvOptions(Section):
    """Options of an "openenv:<spec>" environment (`[orchestrator.env."openenv:<spec>"]`)."""

    max_turns: int = Field(8, ge=1, le=1000, description="Steps (model calls) an episode may take at most.")
    system_prompt: str = Field(SYSTEM_PROMPT, description="The system message before the first observation; "
                               "empty = none.")
    reset_args: dict[str, Any] = Field(default_factory=dict, description="Extra arguments of the server's "
                                       "reset (seed and episode_id are the task's).")
    pass_reward: float = Field(1.0, description="An episode passes when its summed reward reaches this.")
    max_tokens: int = Field(0, ge=0, description="max_tokens of each call; 0 = the orchestrator's.")
    max_context_chars: int = Field(8000, ge=100, description="Characters of conversation a call may carry; "
                                   "the episode ends before passing it (8000 fits a 4096-token context).")
    timeout_s: float = Field(30.0, gt=0, le=3600, description="Time the server has for each answer "
                             "(connect, reset, step, /schema), and to free a session when at capacity.")
    max_frame_bytes: int = Field(1 << 20, ge=1024, le=64 << 20, description="Largest frame or /schema "
                                 "answer read from the server; a bigger one is an infra error.")
    reward_clip: float = Field(1e4, gt=0, description="Each step's reward is clipped to [-reward_clip, "
                               "reward_clip]: one huge reward (a server's 1e300) would swamp its group's "
                               "advantages. A boolean reward counts as 1 or 0, as openenv's Observation allows.")
    max_sessions: int = Field(8, ge=1, description="Episodes open at once in this process (set it to the "
                              "server's max_concurrent_envs).")
    start_timeout_s: float = Field(120.0, gt=0, description="Image specs: time for the container to answer "
                                   "/health.")


class ReplyError(ValueError):
    """The model's reply is not an action: the model's failure."""


def reset_seed(split: str, seed: int, index: int) -> int:
    """The reset seed of task `index` of make_tasks(seed, split): 31 bits, even for train, odd otherwise."""
    digest = hashlib.sha256(f"openenv:{split}:{seed}:{index}".encode()).digest()
    return (int.from_bytes(digest[:4], "big") >> 2 << 1) | (split != "train")


def user_turn(observation: dict[str, Any], action_schema: dict[str, Any]) -> str:
    """The user message of one observation (verifiers' convention). Non-ASCII text stays readable,
    unless the server sent lone surrogates, which no UTF-8 request body can carry: then escaped."""
    payload = {"observation": observation, "action_schema": action_schema}
    text = json.dumps(payload, ensure_ascii=False)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = json.dumps(payload)
    return text


def parse_reply(reply: str, action_schema: dict[str, Any]) -> dict[str, Any]:
    """The action in a reply (see the module docstring); ReplyError when it holds none."""
    text = reply.strip()
    if not text:
        raise ReplyError("empty reply")
    if text.startswith("```") and text.endswith("```"):
        text = "\n".join(text.splitlines()[1:-1]).strip()
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        value = text
    if not isinstance(value, dict):
        required = action_schema.get("required")
        if not (isinstance(required, list) and len(required) == 1 and isinstance(required[0], str)):
            raise ReplyError("the reply is not a JSON object (the action schema has no single required field "
                             "a bare value could fill)")
        value = {required[0]: value}
    try:
        json.dumps(value, allow_nan=False)
    except ValueError:
        raise ReplyError("the reply holds NaN or Infinity, which JSON cannot carry") from None
    return value


class OpenEnvEnv:
    """The adapter; `envs.registry` binds `spec` and `name` in a subclass per "openenv:<spec>"."""

    spec = ""
    name = "openenv"
    max_difficulty = 1
    Options = OpenEnvOptions

    def __init__(self, options: OpenEnvOptions | None = None, run_dir: Path | str = ".") -> None:
        self.options, self.run_dir = options or OpenEnvOptions(), Path(run_dir)
        if is_url(self.spec):
            self._endpoint: Endpoint | None = endpoint(self.spec)  # ValueError on a bad URL
            self._container: Container | None = None
        else:
            self._endpoint, self._container = None, Container(self.spec, self.options.start_timeout_s)
        self._schema: dict[str, Any] | None = None
        # The first rollouts fetch the schema (and start the container) once, in this adapter's own
        # thread: never in the event loop's executor, which store writes and every other environment
        # share (a server dripping /schema held all of its threads). One preparation at a time, shared
        # by every attempt waiting for it; a failed one is remembered for RETRY_PREPARE_S.
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="openenv-prepare")
        self._lock = threading.Lock()  # guards _preparing and _retry_at only; never held while blocking
        self._preparing: Future[tuple[Endpoint, dict[str, Any]]] | None = None
        self._retry_at = 0.0
        self._gates: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = (
            weakref.WeakKeyDictionary())

    @classmethod
    def check(cls, options: OpenEnvOptions | None = None) -> None:
        """ValueError naming the problem: a bad spec, docker unusable (image), or a server that does not
        answer /health, /schema and /ws (URL). An image is not started here."""
        opts = options or OpenEnvOptions()
        try:
            if is_url(cls.spec):
                probe(endpoint(cls.spec), opts.timeout_s, opts.max_frame_bytes)
            else:
                check_image(cls.spec)
        except ValueError as exc:
            raise ValueError(f"environment {cls.name!r}: {exc}") from None

    def close(self) -> None:
        """Stop the container this adapter started, if any (the idle preparation thread stays for a
        later rollout, as the adapter does; it ends with the process)."""
        if self._container is not None:
            self._container.stop()

    def make_tasks(self, n: int, seed: int, difficulty: int = 1, split: str = "train") -> list[Task]:
        """`n` reset seeds; ids name the server (a hash of the spec), split, difficulty, seed and index."""
        where = hashlib.sha256(self.spec.encode()).hexdigest()[:8]
        return [Task(id=f"openenv-{where}-{split}-d{difficulty}-s{seed}-{i:05d}", env=self.name,
                     difficulty=difficulty, data={"seed": reset_seed(split, seed, i)}) for i in range(n)]

    def demonstrations(self, tasks: list[Task]) -> list[dict[str, list[dict[str, str]]]]:
        """None: an OpenEnv server knows no correct actions to show."""
        return []

    # ---- one episode ----
    async def rollout(self, client: ChatClient, task: Task) -> Outcome:
        """Reset the server with the task's seed, then one model call per step until the episode ends."""
        ep, schema = self._endpoint, self._schema
        if ep is None or schema is None:  # first use: fetched (the container started) in the adapter's thread
            ep, schema = await self._prepared()
        reset = {**self.options.reset_args, "seed": task.data["seed"]}
        session = getattr(client, "session_id", None)
        if session:
            reset["episode_id"] = str(session)
        async with self._gate():
            socket, first = await self._start(ep.ws, reset)
            async with socket:
                return await self._play(client, socket, schema, first)

    async def _prepared(self) -> tuple[Endpoint, dict[str, Any]]:
        """The endpoint and action schema, from the preparation every waiting attempt shares.

        Shielded: one attempt cancelled does not cancel the others' preparation. A failure is raised
        afresh to each attempt (one exception object raised in many tasks would share a traceback).
        """
        try:
            return await asyncio.shield(asyncio.wrap_future(self._preparation()))
        except InfraError as exc:
            raise InfraError(f"{exc} (a failed preparation is retried after {RETRY_PREPARE_S:g} s)") from None

    def _preparation(self) -> Future[tuple[Endpoint, dict[str, Any]]]:
        """The preparation in flight or remembered; a new one once a failed one is RETRY_PREPARE_S old."""
        with self._lock:
            prep = self._preparing
            if prep is None or (prep.done() and time.monotonic() >= self._retry_at):
                prep = self._preparing = self._worker.submit(self._prepare)
            return prep

    def _prepare(self) -> tuple[Endpoint, dict[str, Any]]:
        """The server's endpoint (starting the container of an image spec) and its action schema (in
        the adapter's thread). Every HTTP call in it has an overall deadline (`burstrl.deadline`)."""
        try:
            if self._endpoint is None:
                assert self._container is not None
                self._endpoint = endpoint(self._container.start())
            if self._schema is None:
                self._schema = fetch_action_schema(self._endpoint, self.options.timeout_s,
                                                   self.options.max_frame_bytes)
            return self._endpoint, self._schema
        except (InfraError, ValueError) as exc:
            with self._lock:
                self._retry_at = time.monotonic() + RETRY_PREPARE_S
            raise InfraError(str(exc)) from None

    def _gate(self) -> asyncio.Semaphore:
        """This event loop's bound on open episodes (a semaphore belongs to one loop)."""
        loop = asyncio.get_running_loop()
        gate = self._gates.get(loop)
        if gate is None:
            gate = self._gates[loop] = asyncio.Semaphore(self.options.max_sessions)
        return gate

    async def _start(self, url: str, reset: dict[str, Any]) -> tuple[EnvSocket, StepResult]:
        """Connect and reset; a server at capacity is asked again (backing off) for up to `timeout_s`."""
        o = self.options
        deadline, delay = time.monotonic() + o.timeout_s, 0.05
        while True:
            socket = await EnvSocket.open(url, o.timeout_s, o.max_frame_bytes)
            try:
                return socket, await socket.reset(reset)
            except AtCapacity:
                await socket.close()
                if time.monotonic() + delay > deadline:
                    raise
            except BaseException:
                await socket.close()
                raise
            await asyncio.sleep(delay)
            delay = min(2 * delay, 1.0)

    async def _play(self, client: ChatClient, socket: EnvSocket, schema: dict[str, Any],
                    result: StepResult) -> Outcome:
        o = self.options
        if result.done:
            raise InfraError("the server ended the episode at reset: the model got no turn")
        messages = [{"role": "system", "content": o.system_prompt}] if o.system_prompt else []
        messages.append({"role": "user", "content": user_turn(result.observation, schema)})
        rewards: list[float] = []
        clipped = 0  # steps whose reward was clipped (info "clipped_steps" when any)
        for turn in range(o.max_turns):
            size = sum(len(m["content"]) for m in messages)
            if size > o.max_context_chars:
                if turn == 0:
                    raise InfraError(f"the first observation makes a {size}-character prompt, over "
                                     f"max_context_chars={o.max_context_chars}")
                return self._outcome(rewards, clipped, "context")
            reply = await client.chat(messages, max_tokens=o.max_tokens or None)
            messages.append({"role": "assistant", "content": reply})
            try:
                result = await socket.step(parse_reply(reply, schema))
            except ReplyError as exc:
                return self._outcome(rewards, clipped, "invalid", reason=f"bad_reply: {exc}")
            except ActionRejected as exc:
                return self._outcome(rewards, clipped, "invalid", reason=f"action_rejected: {exc}")
            except InfraError as exc:  # after the model's action: its doing for all we can tell
                return self._outcome(rewards, clipped, "invalid", reason=f"env_failed_after_action: {exc}")
            rewards.append(min(max(result.reward, -o.reward_clip), o.reward_clip))
            clipped += rewards[-1] != result.reward
            if result.done:
                return self._outcome(rewards, clipped, "done")
            messages.append({"role": "user", "content": user_turn(result.observation, schema)})
        return self._outcome(rewards, clipped, "max_turns")

    def _outcome(self, rewards: list[float], clipped: int, ended: str, reason: str | None = None) -> Outcome:
        """reward = the summed (clipped) step rewards, or 0 when the model failed (`reason`)."""
        total = float(sum(rewards))  # finite: each is within reward_clip, and steps are at most max_turns
        valid = reason is None
        info: dict[str, Any] = {"ended": ended, "steps": len(rewards), "rewards": rewards}
        if clipped:
            info["clipped_steps"] = clipped
        if reason is not None:
            info["reason"] = reason
        return Outcome(reward=total if valid else 0.0, parts={"env_reward": total, "valid": float(valid)},
                       passed=valid and total >= self.options.pass_reward, info=info)
