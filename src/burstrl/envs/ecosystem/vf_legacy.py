"""A legacy verifiers environment module run as a burstrl environment (the `VerifiersEnv` stack for
modules with `load_environment(**kwargs) -> vf.Environment`, verifiers <= 0.3.1).

The env is the module's own: `load_environment(**args)`, tasks are the rows of its dataset
(`get_dataset()` for train, `get_eval_dataset()` for test, which falls back to the dataset as
verifiers does), and one attempt is one `env.run_rollout(row, client, model, sampling_args)`:
rollout plus the rubric's per-rollout scoring. Group scoring (`run_group`) is not used: burstrl's
orchestrator runs a group's attempts as independent sessions, so a rubric's group-level rewards
(`has_group_rewards`) see a group of one.

Session and version: the client is verifiers' `OpenAIChatCompletionsClient` around
`common.openai_client(client)`, whose transport forces the session id and the group's version on
every request and counts the answered calls (`SessionChatClient.sdk_http`).
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import logging
import signal
import threading
from collections.abc import Iterator
from types import ModuleType
from typing import Any

from burstrl.envs.base import InfraError, Outcome, SessionChatClient
from burstrl.envs.ecosystem.common import openai_client
from burstrl.envs.ecosystem.vf_common import Row, after_the_model, json_row, numeric_parts, refused

log = logging.getLogger("burstrl.envs.verifiers")
MODEL_ERRORS = ("EmptyModelResponseError", "InvalidModelResponseError", "ToolError", "ToolParseError",
                "ToolCallError")  # the model's doing: an empty reply, a tool call it got wrong


def check(spec: str, module: ModuleType, options: Any) -> None:
    """The options bound to `load_environment`'s signature: ValueError naming unknown or missing
    keys. A signature with **kwargs takes any key (verifiers' Environment even sets unknown ones as
    attributes): those keys are logged as unchecked, since only loading could tell more."""
    if options.max_turns is not None:
        raise ValueError(f"verifiers:{spec}: max_turns is for v1 tasksets; a legacy module takes its own "
                         "limits through args (e.g. args.max_turns)")
    fn = module.load_environment
    params = inspect.signature(fn).parameters
    named = {n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
    unknown = sorted(set(options.args) - named)
    if unknown and not takes_any:
        raise ValueError(f"verifiers:{spec}: unknown args {unknown}: load_environment takes {sorted(named)}")
    try:
        inspect.signature(fn).bind(**options.args)
    except TypeError as exc:
        raise ValueError(f"verifiers:{spec}: args do not fit load_environment{inspect.signature(fn)}: {exc}") from None
    if unknown:
        log.warning("verifiers:%s: load_environment takes **kwargs: args %s cannot be checked before it loads",
                    spec, unknown)


class LegacyStack:
    """One adapter's legacy env: loaded once, its dataset rows by split, its rollouts."""

    def __init__(self, spec: str, module: ModuleType, options: Any) -> None:
        self.spec, self.options = spec, options
        with _keep_signal_handlers():
            self.env = module.load_environment(**options.args)
        self.env.env_id = self.env.env_id or spec  # as verifiers' own loader does
        self.env.env_args = self.env.env_args or dict(options.args)
        self._rows: dict[str, list[Row]] = {}

    def rows(self, split: str) -> list[Row]:
        """The split's rows (train: the dataset; test: the eval dataset, else the dataset)."""
        if split not in self._rows:
            dataset = self.env.get_dataset() if split == "train" else self.env.get_eval_dataset()
            where = f"verifiers:{self.spec} {split} row"
            self._rows[split] = [Row(key=str(row.get("example_id", i)), data=json_row(row, f"{where} {i}"))
                                 for i, row in enumerate(dataset.to_list())]
        return self._rows[split]

    async def rollout(self, client: SessionChatClient, data: dict[str, Any]) -> Outcome:
        import verifiers as vf

        sdk = openai_client(client)
        try:
            output = await self.env.run_rollout(copy.deepcopy(data), vf.OpenAIChatCompletionsClient(sdk),
                                                client.model, self.sampling(client), max_retries=0)
        except Exception as exc:  # the environment's own code raised (verifiers keeps model errors in state)
            client.raise_failure()
            raise InfraError(f"verifiers:{self.spec}: {type(exc).__name__}: {exc}") from exc
        finally:
            await sdk.close()
        return self.outcome(client, output)

    def sampling(self, client: SessionChatClient) -> dict[str, Any]:
        """The env's own sampling args (as `generate` merges them) under the run's: temperature,
        max_tokens (sent as max_completion_tokens by verifiers' client) and the attempt's seed."""
        args = copy.deepcopy(self.env.sampling_args)
        return args | {"temperature": client.temperature, "max_tokens": client.max_tokens, "seed": client.seed}

    def outcome(self, client: SessionChatClient, output: dict[str, Any]) -> Outcome:
        """The graded rollout: reward and metrics from the rubric, `passed` at the threshold (the
        option, else the env's own `pass_threshold`, verifiers' pass@k line: 0.5 by default)."""
        client.raise_failure()
        reward = float(output.get("reward") or 0.0)
        parts = numeric_parts(output.get("metrics") or {})
        threshold = self.options.pass_threshold
        threshold = float(getattr(self.env, "pass_threshold", 0.5)) if threshold is None else threshold
        info: dict[str, Any] = {"stop_condition": str(output.get("stop_condition") or ""),
                                "example_id": output.get("example_id")}
        error = output.get("error")
        if error:  # the model's failure (else `_reason` raised): scored 0, as every failed attempt is
            info["reason"] = self._reason(error, client.calls)
            reward = 0.0
        return Outcome(reward=reward, parts=parts, passed=reward >= threshold and not error, info=info)

    def _reason(self, error: dict[str, Any], answered: int) -> str:
        """The error as the model's doing (its reason), or the exception for anyone else's: before
        the model's first answer, a refused call stops the run and any other error re-runs the
        attempt; after it, both are the model's (`after_the_model`)."""
        kind, chain = str(error.get("error", "")), str(error.get("error_chain_repr", ""))
        message = f"{kind}: {error.get('message', '')}"[:500]
        if kind in MODEL_ERRORS:
            return message
        rejected = kind == "ModelError" and ("BadRequestError" in chain or "UnprocessableEntityError" in chain)
        if answered:
            return after_the_model("a call refused" if rejected else "the environment failed", message)
        if rejected:
            raise refused(self.spec, chain)
        raise InfraError(f"verifiers:{self.spec}: {message}")

    def close(self) -> None:
        """Nothing held between rollouts (each closes its own client)."""

    async def aclose(self) -> None:
        """As `close`."""


@contextlib.contextmanager
def _keep_signal_handlers() -> Iterator[None]:
    """Undo what verifiers' Environment.__init__ does to SIGINT/SIGTERM: it installs handlers that
    tear the env down and exit(143), which would take the orchestrator's own (clean shutdown of the
    store and sessions) away. Only the main thread can set handlers, and only there does it."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            if handler is not None:
                signal.signal(sig, handler)
