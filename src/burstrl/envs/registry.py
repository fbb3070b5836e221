"""Which environment a name means, and the options it is built with: the plug-in point.

Why a registry keyed by name or `module:Class` (as mini-swe-agent's environment mapping and
SkyRL-gym's `register`): adding an environment must touch no library file. The built-in ones are
listed here by import path (nothing is imported until asked for, so the light processes that check a
name stay light); any other is named `package.module:Class` in `orchestrator.envs` (or `burstrl eval
--env`) and imported in the process that runs it (its module must be importable there, e.g. on
PYTHONPATH), or registered by code that runs first (`register`). Environments written for verifiers
or OpenEnv are named "verifiers:<module>" or "openenv:<url>" and run through their adapters
(envs.ecosystem), each name bound to its own subclass.

Options: an environment class that declares `Options` (a pydantic model, usually a
`burstrl.config.Section`) is built as `cls(options, run_dir)`, one that does not as `cls()`. Its
options are validated by its own model from the run config's orchestrator section: the typed
section named after it where the config has one (`orchestrator.swe`, kept for the built-in SWE
environment) or the free mapping `orchestrator.env.<name>` (`[orchestrator.env.echo]` in TOML,
`--orchestrator.env.echo.key value`), where `<name>` is the class's `name`.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from burstrl.config import ConfigError, validate
from burstrl.envs.base import Environment

# Built-in environments: name -> "module:Class". Tuple of names kept for importers and messages.
_REGISTRY: dict[str, str] = {
    "toy": "burstrl.envs.toy:ToyEnv",
    "toy_multi": "burstrl.envs.toy_multi:MultiToyEnv",
    "swe": "burstrl.envs.swe.env:SweEnv",
    "functions": "burstrl.envs.functions.env:FunctionsEnv",
}
ENV_NAMES = tuple(_REGISTRY)

# Environments written for the ecosystem's standards, named "<prefix>:<what>" (checked before the
# module:Class form, which the same colon would otherwise mean): prefix -> (adapter, extra, package).
ECOSYSTEM: dict[str, tuple[str, str, str]] = {
    "verifiers": ("burstrl.envs.ecosystem.verifiers_env:VerifiersEnv", "verifiers", "verifiers"),
    "openenv": ("burstrl.envs.ecosystem.openenv_env:OpenEnvEnv", "openenv", "openenv"),
}


def register(name: str, target: str | type) -> None:
    """Make `name` mean `target` (a class, or "module:Class" imported when first used)."""
    if ":" in name:
        raise ValueError(f"environment name {name!r}: ':' is reserved for module:Class names")
    _REGISTRY[name] = target if isinstance(target, str) else f"{target.__module__}:{target.__qualname__}"


def names() -> tuple[str, ...]:
    """The registered names (built-in ones first), for error messages."""
    return tuple(_REGISTRY)


def env_class(name: str) -> type:
    """The class `name` stands for: a registered name, "verifiers:<module>", "openenv:<url>" or
    "module:Class" (ValueError otherwise)."""
    prefix, _, spec = name.partition(":")
    if name not in _REGISTRY and prefix in ECOSYSTEM:
        return _ecosystem_class(name, prefix, spec)
    target = _REGISTRY.get(name, name if ":" in name else None)
    if target is None:
        raise ValueError(f"unknown environment {name!r}; choose from {', '.join(names())} "
                         "or name one as package.module:Class")
    module_name, _, attr = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise ValueError(f"environment {name!r}: cannot import {module_name!r} ({exc}); is its directory on "
                         "PYTHONPATH?") from None
    cls = module
    for part in attr.split("."):
        cls = getattr(cls, part, None)
        if cls is None:
            raise ValueError(f"environment {name!r}: {module_name} has no {attr!r}")
    if not isinstance(cls, type):
        raise ValueError(f"environment {name!r}: {target} is not a class")
    return cls


def _import_target(target: str) -> type:
    module_name, _, attr = target.partition(":")
    return getattr(importlib.import_module(module_name), attr)


def _ecosystem_class(name: str, prefix: str, spec: str) -> type:
    """The adapter for an ecosystem environment, bound to `spec` (a subclass per name, so its
    options live under `orchestrator.env."<name>"` like any environment's).

    Without the extra installed this fails here, before a run starts, with the pip command.
    """
    target, extra, package = ECOSYSTEM[prefix]
    if not spec:
        raise ValueError(f"environment {name!r}: name what to run after {prefix + ':'!r}")
    if importlib.util.find_spec(package) is None:
        raise ValueError(f"environment {name!r} needs the {package} package: pip install 'burstrl[{extra}]'")
    adapter = _import_target(target)
    return type(f"{adapter.__name__}[{spec}]", (adapter,), {"spec": spec, "name": name,
                                                              "__module__": adapter.__module__})


def check_env(name: str, options: Any = None) -> None:
    """ValueError (naming the problem) unless `name` is an environment whose options validate.

    A registered name with no `orchestrator.env.<name>` mapping is checked without importing its
    module (its typed section, if any, was validated with the config), so the CLI and the launcher
    answer fast.
    """
    if name in _REGISTRY and name not in (getattr(options, "env", None) or {}):
        return
    cls = env_class(name)
    opts = env_options(cls, options)
    check = getattr(cls, "check", None)
    if check is not None:  # what only the environment can tell (an ecosystem env's own arguments)
        check(opts)


def options_key(cls: type) -> str:
    """Where `cls`'s options live in the orchestrator config: its typed section or `env.<key>`."""
    return getattr(cls, "name", cls.__name__)


def env_options(cls: type, options: Any) -> BaseModel | None:
    """`cls`'s options, validated by its own `Options` model from the orchestrator config `options`.

    `options` is the orchestrator section (or anything with the same attributes; None: defaults).
    None when `cls` declares no options.
    """
    model: type[BaseModel] | None = getattr(cls, "Options", None)
    key = options_key(cls)
    mapping: Mapping[str, Any] | None = (getattr(options, "env", None) or {}).get(key)
    if model is None:
        if mapping:
            raise ValueError(f"orchestrator.env.{key}: environment {key!r} takes no options")
        return None
    typed = getattr(options, key, None)
    if mapping is None:
        return typed if isinstance(typed, model) else model()
    if isinstance(typed, BaseModel) and typed.model_fields_set:
        raise ValueError(f"environment {key!r}: set its options in orchestrator.{key} or in "
                         f"orchestrator.env.{key}, not both")
    try:  # the config's own validation: `reward-exact` reads as reward_exact, errors name the keys
        return validate(model, dict(mapping))
    except ConfigError as exc:
        raise ValueError(f"orchestrator.env.{key}: {exc}") from None


def get_env(name: str, options: Any = None, run_dir: str | Path | None = None) -> Environment:
    """The environment `name` stands for (ValueError naming the choices otherwise).

    `options` is the orchestrator's config (the environment's options are read from it, see the
    module docstring); `run_dir` is where an environment may keep files (generated tasks). An
    environment answers to the name it was asked by ("module:Class", or a name `register`ed for a
    class whose own `name` differs): its `name` is set to it, so the tasks it makes
    (`Task.env = self.name`) find it again in the orchestrator's and curriculum's tables, which
    are keyed by the names in `orchestrator.envs`. Built-in ones already carry their name.
    """
    cls = env_class(name)
    opts = env_options(cls, options)
    env = cls() if opts is None else cls(opts, Path(run_dir or "."))
    if getattr(env, "name", None) != name:
        env.name = name
    return env
