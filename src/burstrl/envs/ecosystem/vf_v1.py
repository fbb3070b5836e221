"""A verifiers v1 taskset run as a burstrl environment (the `VerifiersEnv` stack for v1 packages).

The env is verifiers' own: `load_environment(resolve_env_config(...))` with the user's options
under `taskset` (validated by the taskset's own config), and the seat pinned to what can run
here: the in-process harness (`vf_harness`: `null`'s loop without uv) and the `subprocess`
runtime (the default is a remote Prime sandbox), no whole-rollout retries (a retried episode would
make calls burstrl did not count). Episodes run with `env.run_slot` inside `env.serving()` (the
interception server and the taskset's shared tool servers), held open once per adapter on the
event loop the rollouts run on (`_Serving`).

Session and version: the interception's own client calls the router (`{router}/v1`); the rollout's
`SamplingConfig` carries `session_id` as an extra key, which verifiers merges into every request
body (`ChatDialect.apply_overrides`), and the body's `session_id` is what the router and replica
read first (verifiers' `X-Session-ID` header holds its trace id and loses). `ModelContext.model`
is the group's version: verifiers forces it into every body. The calls are counted from the
trace: each `ModelCall` without an error is an exchange the router answered 200 (verifiers records
one per upstream exchange, the error when it failed), so `client.calls` matches the replica's
capture, which the orchestrator checks.
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import verifiers.v1 as vf
from pydantic import ValidationError

from burstrl.envs.base import InfraError, Outcome, SessionChatClient, fleet_failure
from burstrl.envs.ecosystem import vf_harness
from burstrl.envs.ecosystem.vf_common import Row, after_the_model, json_row, numeric_parts, refused

API_KEY_VAR = "BURSTRL_VERIFIERS_API_KEY"  # unset: "EMPTY" (the router takes no key); not PRIME_API_KEY,
# which would make verifiers read the Prime CLI config
DEFAULT_PASS = 0.5


def env_config(spec: str, options: Any) -> dict[str, Any]:
    """The verifiers env config: the user's taskset options, every seat pinned to run here and to
    play the policy: no model, endpoint or sampling of its own (the run's, from the rollout's
    context, so every call is the session's on the group's version at the run's temperature).
    A seat's other settings, such as an env's own `max_turns`, stay its author's unless set."""
    seat: dict[str, Any] = {"harness": {"id": vf_harness.HARNESS_ID}, "runtime": {"type": "subprocess"},
                            "retries": {"max_retries": 0}, "model": None, "client": None, "sampling": None}
    if options.max_turns is not None:
        seat["max_turns"] = options.max_turns
    roles = _roles(spec)
    return {"taskset": {**options.args, "id": spec}, "retries": {"max_retries": 0}, **dict.fromkeys(roles, seat)}


def _roles(spec: str) -> list[str]:
    """The seats of the taskset's env (`agent` for a plain taskset; an `Env` package names its own)."""
    config_cls = vf.env_config_type(spec)
    return [name for name, field in config_cls.model_fields.items() if isinstance(field.default, vf.AgentConfig)]


def resolve(spec: str, options: Any) -> Any:
    """The validated env config; ValueError with verifiers' own message (it names the key)."""
    if "id" in options.args:
        raise ValueError(f"verifiers:{spec}: args.id: the taskset is the environment's name, not an option")
    try:
        return vf.resolve_env_config(env_config(spec, options))
    except ValidationError as exc:
        raise ValueError(f"verifiers:{spec}: bad options: {exc}") from None


def check(spec: str, options: Any) -> None:
    """What can be checked without loading tasks: the options against the taskset's config."""
    resolve(spec, options)


class V1Stack:
    """One adapter's verifiers env: its task pool, its serving resources and its episodes."""

    def __init__(self, spec: str, options: Any) -> None:
        self.spec, self.options = spec, options
        self.env = vf.load_environment(resolve(spec, options))
        self.task_cls = type(self.env.taskset).task_type()
        self.data_cls = self.task_cls.data_type()
        self.serving = _Serving(self.env)
        self._rows: list[Row] | None = None

    def rows(self, split: str) -> list[Row]:
        """The taskset's tasks (at most `max_tasks`: an infinite taskset is cut there). A v1
        taskset has no splits: "test" draws from the same tasks (its ids name the split)."""
        if self._rows is None:
            tasks = itertools.islice(iter(self.env.taskset), self.options.max_tasks)
            self._rows = [Row(key=str(t.data.idx if t.data.idx is not None else i),
                              data=json_row(t.data.model_dump(mode="json"), f"verifiers:{self.spec} task {i}"))
                          for i, t in enumerate(tasks)]
        return self._rows

    async def rollout(self, client: SessionChatClient, data: dict[str, Any]) -> Outcome:
        await self.serving.ensure()
        task = self.task_cls(self.data_cls.model_validate(data), self.env.config.taskset.task)
        (slot,) = self.env.slots(task)
        episode = await self.env.run_slot(slot, context(client))
        client.calls += answered_calls(episode)
        threshold = DEFAULT_PASS if self.options.pass_threshold is None else self.options.pass_threshold
        return outcome(self.spec, episode, client, threshold)

    def close(self) -> None:
        self.serving.close()

    async def aclose(self) -> None:
        await self.serving.aclose()


def context(client: SessionChatClient) -> Any:
    """The rollout's model context: the router, the group's version, the run's sampling, and the
    session id as a sampling extra (merged into every request body, see the module docstring)."""
    endpoint = vf.EvalClientConfig(base_url=f"{client.router}/v1", api_key_var=API_KEY_VAR)
    sampling = vf.SamplingConfig(temperature=client.temperature, max_tokens=client.max_tokens,
                                 seed=client.seed, session_id=client.session_id)
    return vf.ModelContext(model=client.model, client=endpoint, sampling=sampling)


def answered_calls(episode: Any) -> int:
    """Exchanges the router answered: verifiers records one `ModelCall` per upstream exchange,
    with its error when it failed (a refused or overlong prompt, a fleet failure)."""
    return sum(1 for trace in episode.traces for call in trace.calls if call.error is None)


def outcome(spec: str, episode: Any, client: SessionChatClient, threshold: float) -> Outcome:
    """The graded episode, or the exception that says whose failure it was (see `_raise_for`)."""
    failed = _failure(spec, episode, client)
    traces = episode.traces
    info: dict[str, Any] = {"stop_condition": ",".join(t.stop_condition for t in traces if t.stop_condition),
                            "turns": sum(t.num_turns for t in traces), "trace_ids": [t.id for t in traces]}
    timeout = _timeout(episode)
    if timeout:  # the agent ran past its time budget: the model's doing, scored 0
        failed = f"timeout: {timeout}"
    if failed:
        return Outcome(reward=0.0, parts={}, passed=False, info=info | {"reason": failed})
    reward = sum(t.reward for t in traces) / len(traces)
    return Outcome(reward=reward, parts=_parts(traces), passed=reward >= threshold, info=info)


def _parts(traces: list[Any]) -> dict[str, float]:
    """Each reward's score (unweighted; `trace.reward` is their weighted sum) and each numeric
    metric, averaged over the episode's traces (one for a single-agent env)."""
    per_trace = [numeric_parts({k: r.score for k, r in t.rewards.items() if r is not None}, t.metrics)
                 for t in traces]
    names = dict.fromkeys(name for parts in per_trace for name in parts)
    return {name: sum(p.get(name, 0.0) for p in per_trace) / len(per_trace) for name in names}


def _errors(episode: Any) -> list[Any]:
    return [*episode.errors, *(e for t in episode.traces for e in t.errors)]


def _is_timeout(error: Any) -> bool:
    """verifiers' agent timeout (`--env.<seat>.timeout.rollout` ran out): the model took too long."""
    return error.type == "HarnessError" and error.message.startswith("agent timeout")


def _timeout(episode: Any) -> str:
    return next((e.message for e in _errors(episode) if _is_timeout(e)), "")


def _failure(spec: str, episode: Any, client: SessionChatClient) -> str | None:
    """Raise unless the episode is the model's to score: the fleet failed a call (the attempt
    re-runs: `ReplicaFailure`), or, before the model's first answer, the router refused a call
    (`refused`: the run stops) or the environment failed (task hooks, tool servers, the harness:
    `InfraError`, re-run). After it, those two are the model's failure: its reason, scored 0
    (`after_the_model`)."""
    client.raise_failure()  # an SDK call of the session's own (none here: verifiers' client calls the router)
    for call in (c for t in episode.traces for c in t.calls if c.error is not None):
        status, detail = call.error.status_code, f"{call.error.type}: {call.error.message}"
        failure = fleet_failure(status, detail, "a call to the router") if status is not None else None
        if failure is not None:
            raise failure
    errors = [e for e in _errors(episode) if not _is_timeout(e)]
    for error in errors:
        if error.type == "ProviderError" and error.status_code is not None and 400 <= error.status_code < 500:
            if client.calls:
                return after_the_model("a call refused", f"{error.status_code}: {error.message}")
            raise refused(spec, f"{error.status_code}: {error.message}")
    if errors:
        first = errors[0]
        if client.calls:
            return after_the_model("the environment failed", f"{first.type}: {first.message}")
        raise InfraError(f"verifiers:{spec}: {first.type}: {first.message[:500]}")
    if not episode.ok and not _timeout(episode):
        raise InfraError(f"verifiers:{spec}: the episode failed without an error")
    if not episode.traces:
        raise InfraError(f"verifiers:{spec}: the episode ran no agent")
    return None


class _Serving:
    """`env.serving()` (interception server, shared tool servers) held open by a task on the event
    loop the rollouts run on, started by the first rollout and stopped by `close`/`aclose`.

    Why a task holding the context: serving is an async context manager, but the orchestrator
    only calls `rollout` (and the eval a synchronous `close`): the task keeps it open across
    rollouts, and a loop that ends (`asyncio.run` cancels what is left) still unwinds it.
    """

    def __init__(self, env: Any) -> None:
        self.env = env
        self.loop: asyncio.AbstractEventLoop | None = None
        self.task: asyncio.Task | None = None
        self.ready: asyncio.Future | None = None
        self.stop: asyncio.Event | None = None

    async def ensure(self) -> None:
        """Serving is up on this loop (started here if not); InfraError if it cannot start."""
        loop = asyncio.get_running_loop()
        if self.loop is not loop or self.task is None or self.task.done():
            self.loop, self.stop, self.ready = loop, asyncio.Event(), loop.create_future()
            self.task = loop.create_task(self._hold(self.ready, self.stop), name="verifiers-serving")
        try:
            await asyncio.shield(self.ready)
        except Exception as exc:
            raise InfraError(f"verifiers serving did not start: {type(exc).__name__}: {exc}") from exc

    async def _hold(self, ready: asyncio.Future, stop: asyncio.Event) -> None:
        try:
            async with self.env.serving():
                ready.set_result(None)
                await stop.wait()
        except BaseException as exc:
            if ready.done():
                raise
            if isinstance(exc, Exception):
                ready.set_exception(exc)
            else:
                ready.cancel()
            raise

    def close(self) -> None:
        """Stop serving from synchronous code: at once when its loop is idle in this thread, else
        the holding task unwinds as soon as its loop runs it (or `asyncio.run` cancels it)."""
        task, loop, stop = self.task, self.loop, self.stop
        if task is None or task.done() or loop is None or loop.is_closed() or stop is None:
            return
        if loop.is_running():
            loop.call_soon_threadsafe(stop.set)
            return
        stop.set()
        try:
            asyncio.get_running_loop()  # another loop runs here: the holder unwinds when its loop next runs
        except RuntimeError:
            loop.run_until_complete(task)

    async def aclose(self) -> None:
        if self.task is not None and self.stop is not None and self.loop is asyncio.get_running_loop():
            self.stop.set()
            await asyncio.gather(self.task, return_exceptions=True)
