"""`VerifiersEnv`: a verifiers environment, unmodified, as a burstrl environment ("verifiers:<module>").

`<module>` is what verifiers itself would load: an importable module or package, named as on the
verifiers Hub (`owner/name@version` and hyphens are normalized as verifiers' loaders do). Which
stack it is written for is detected, as verifiers' loaders tell them apart:
- v1: the module's `__all__` exports a `verifiers.v1.Taskset` subclass (`verifiers.v1.tasksets.<name>`,
  verifiers' built-in tasksets, is tried first, as verifiers does). Run by `vf_v1`.
- legacy: the module has a callable `load_environment` (verifiers <= 0.3.1's protocol). Run by
  `vf_legacy`.

Options (`[orchestrator.env."verifiers:<module>"]`, `burstrl eval --env-option args.KEY=VALUE`):
- `args`: the environment's own arguments: the taskset's config keys (v1, validated by the
  taskset's pydantic config, so an unknown key fails naming it) or `load_environment`'s keyword
  arguments (legacy, bound to its signature; a `**kwargs` signature cannot be checked before load).
- `max_turns` (v1): the agent's model turns per rollout; None: no limit beyond the taskset's own.
- `pass_threshold`: `passed` = reward >= it. None: 0.5 for v1 (a reward of weighted scores in
  [0, 1] is half right), and the env's own `pass_threshold` for legacy (verifiers' pass@k line,
  0.5 unless the module sets it).
- `max_tasks` (v1): tasks read from the taskset (an infinite one is cut there).

One attempt is one verifiers rollout (an episode for v1), every model call of it going to the
router as the attempt's session on the group's version (see each stack), so the replica captures
the exact tokens and logprobs, and the reward and its named parts come from verifiers' scoring.
Whose failure an error is decides what happens: the fleet's re-runs the attempt (`ReplicaFailure`),
the environment's re-runs it too (`InfraError`), the model's is scored with `info["reason"]`, and
a request the router refuses (something the replica does not serve) stops the run (RuntimeError).

verifiers costs 5-7 CPU-seconds to import: it is imported here only when a stack is needed
(`check`, the first task or rollout), never when burstrl is.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType
from typing import Any

from pydantic import Field

from burstrl.config import Section
from burstrl.envs.base import ChatClient, Outcome, Task
from burstrl.envs.ecosystem.vf_common import check_draw, draw, task_id


class VerifiersOptions(Section):
    args: dict[str, Any] = Field(default_factory=dict, description="The environment's own arguments: its "
                                 "taskset config keys (v1) or load_environment's keyword arguments (legacy).")
    max_turns: int | None = Field(None, ge=1, description="v1: the agent's model turns per rollout (None: "
                                  "the taskset's own limit, if any). Legacy modules take theirs in `args`.")
    pass_threshold: float | None = Field(None, description="passed = reward >= this. None: 0.5 for v1, the "
                                         "env's own pass_threshold for legacy (0.5 unless it sets one).")
    max_tasks: int = Field(100_000, ge=1, description="v1: tasks read from the taskset (an infinite one is "
                           "cut here).")


def module_names(spec: str) -> list[str]:
    """What verifiers would import for `spec`, in its order: v1's built-in tasksets, then the
    module named as v1 normalizes (`owner/` and `@version` dropped, hyphens to underscores,
    lowercase), then as the legacy loader does (no lowercasing)."""
    base = spec.rsplit("/", 1)[-1].split("@", 1)[0].replace("-", "_")
    return list(dict.fromkeys([f"verifiers.v1.tasksets.{base.lower()}", base.lower(), base]))


def import_module(spec: str) -> ModuleType:
    """The module `spec` names; ValueError naming it when it is missing or fails to import."""
    names = module_names(spec)
    for name in names:
        try:
            return importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name and not name.startswith(f"{exc.name}."):  # the module is there, a dependency not
                raise ValueError(f"verifiers:{spec}: importing {name!r} failed: {exc}") from None
        except Exception as exc:  # the module itself raised
            raise ValueError(f"verifiers:{spec}: importing {name!r} failed: {type(exc).__name__}: {exc}") from None
    raise ValueError(f"verifiers:{spec}: no module {names[-1]!r} (tried {', '.join(names)}); is its package "
                     "installed or its directory on PYTHONPATH?")


def detect(spec: str) -> tuple[str, ModuleType]:
    """("v1" | "legacy", the module): see the module docstring; ValueError if it is neither."""
    module = import_module(spec)
    from verifiers.v1 import Taskset

    exported = [getattr(module, name, None) for name in getattr(module, "__all__", None) or []]
    tasksets = [o for o in exported if isinstance(o, type) and issubclass(o, Taskset) and o is not Taskset]
    if len(tasksets) > 1:
        raise ValueError(f"verifiers:{spec}: {module.__name__} exports {len(tasksets)} Taskset subclasses "
                         f"({[c.__name__ for c in tasksets]}); verifiers needs exactly one")
    if tasksets:
        return "v1", module
    if callable(getattr(module, "load_environment", None)):
        return "legacy", module
    raise ValueError(f"verifiers:{spec}: {module.__name__} is neither a v1 taskset package (no "
                     "verifiers.v1.Taskset subclass in its __all__) nor a legacy environment module "
                     "(no load_environment)")


class VerifiersEnv:
    """A verifiers environment (v1 taskset or legacy module) behind burstrl's `Environment`."""

    spec = ""  # the module, set on the subclass the registry makes for "verifiers:<spec>"
    name = "verifiers"
    max_difficulty = 1
    Options = VerifiersOptions

    def __init__(self, options: VerifiersOptions | None = None, run_dir: Path | str = ".") -> None:
        if not self.spec:
            raise ValueError("VerifiersEnv needs a module: name the environment verifiers:<module>")
        self.options, self.run_dir = options or VerifiersOptions(), Path(run_dir)
        self._stack: Any = None

    @classmethod
    def check(cls, options: VerifiersOptions | None) -> None:
        """ValueError naming the problem: the module does not import, is neither stack, or the
        options do not validate against its own arguments (see the module docstring)."""
        options = options or VerifiersOptions()
        kind, module = detect(cls.spec)
        if kind == "v1":
            from burstrl.envs.ecosystem import vf_v1

            vf_v1.check(cls.spec, options)
        else:
            from burstrl.envs.ecosystem import vf_legacy

            vf_legacy.check(cls.spec, module, options)

    def stack(self) -> Any:
        """The stack running the module, built on first use (imports verifiers, loads the env)."""
        if self._stack is None:
            self.check(self.options)
            kind, module = detect(self.spec)
            if kind == "v1":
                from burstrl.envs.ecosystem.vf_v1 import V1Stack

                self._stack = V1Stack(self.spec, self.options)
            else:
                from burstrl.envs.ecosystem.vf_legacy import LegacyStack

                self._stack = LegacyStack(self.spec, module, self.options)
        return self._stack

    def make_tasks(self, n: int, seed: int, difficulty: int = 1, split: str = "train") -> list[Task]:
        """`n` rows of the split, a seeded draw without repeats (the same arguments give the same
        tasks); ids name the split, seed and index, so they never collide across calls."""
        check_draw(n, difficulty, split)
        rows = self.stack().rows(split)
        return [Task(id=task_id(self.spec, split, seed, i, rows[j].key), env=self.name, difficulty=1,
                     data=rows[j].data) for i, j in enumerate(draw(len(rows), n, seed, split))]

    async def rollout(self, client: ChatClient, task: Task) -> Outcome:
        """One verifiers rollout of `task` through `client`'s session (a `SessionChatClient`)."""
        return await self.stack().rollout(client, task.data)

    def demonstrations(self, tasks: list[Task]) -> list[dict[str, list[dict[str, str]]]]:
        """None: a verifiers environment carries rewards, not reference replies."""
        return []

    def close(self) -> None:
        """Stop what the env holds open between rollouts (v1: its serving resources)."""
        if self._stack is not None:
            self._stack.close()

    async def aclose(self) -> None:
        """`close` from async code, waiting until everything is down."""
        if self._stack is not None:
            await self._stack.aclose()
