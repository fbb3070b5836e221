"""How configs are read: TOML (or JSON) files, then `--a.b value` overrides, validated by name.

Why one grammar for every command: a user learns `burstrl serve cfg.toml --server.port 9000
--dry-run` once and it works for `run`, `train`, `sft`, `eval` and `route sim` too. The command
line after a command's own flags is parsed here, once (`parse_command_line`): words that are not
options are config files, `--a.b value` / `--a.b=value` are overrides. Errors are `ConfigError`s
that name the key the way the user typed it.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the same parser, packaged as tomli
    import tomli as tomllib


class ConfigError(ValueError):
    """A config file or override is wrong; the message names the key."""


class Section(BaseModel):
    """Base for config sections: unknown keys are rejected, defaults are validated."""

    model_config = ConfigDict(extra="forbid", validate_default=True)


C = TypeVar("C", bound=BaseModel)


def parse_command_line(args: Sequence[str]) -> tuple[list[str], dict[str, Any]]:
    """Split command-line words into config files and a nested dict of `--a.b value` overrides.

    Click cannot do this itself: a variadic CONFIG argument would swallow the values of the
    unknown `--a.b value` options. An override takes the next word unless written `--a.b=value`;
    a key segment holding dots is bracketed or quoted (`--orchestrator.env[openenv:http://h:8000].max_turns 4`).
    Values are typed as TOML/JSON literals when they parse (numbers, bools, lists), else strings.
    Hyphens become underscores later, in `validate`, and only in keys that name a field: the keys
    of free-form tables (an adapter named `policy-v1`) must keep their hyphens.
    """
    files: list[str] = []
    tree: dict[str, Any] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        i += 1
        if not arg.startswith("--"):
            files.append(arg)
            continue
        path, eq, value = split_key(arg[2:])
        if not path:
            raise ConfigError(f"expected an override like --section.key value, got {arg!r}")
        if not eq:
            if i >= len(args):
                raise ConfigError(f"override {arg} has no value")
            value = args[i]
            i += 1
        _set_path(tree, path, _parse_value(value))
    return files, tree


def split_key(text: str) -> tuple[list[str], bool, str]:
    """`a.b[c.d]."e.f"=v` -> (["a", "b", "c.d", "e.f"], True, "v").

    Why: table keys can hold dots and colons (an environment named `openenv:http://127.0.0.1:8000`
    or `verifiers:pkg.module`), so a segment may be bracketed or double-quoted (as in TOML) and is
    then taken whole; the value starts after the first `=` outside them."""
    path: list[str] = []
    part, quoted, i = "", False, 0
    while i < len(text):
        c = text[i]
        if c in "[\"":
            close = text.find("]" if c == "[" else '"', i + 1)
            if close < 0:
                raise ConfigError(f"override --{text}: {c} without its closing {']' if c == '[' else c}")
            if part:
                path.append(part)
            part, quoted, i = text[i + 1:close], True, close + 1
            if i < len(text) and text[i] not in ".=[\"":
                raise ConfigError(f"override --{text}: expected . or = after {text[:i]}")
            continue
        if c in ".=":
            if part or quoted:
                path.append(part)
            elif c == "." or not path:
                raise ConfigError(f"override --{text}: an empty key segment")
            part, quoted = "", False
            if c == "=":
                return path, True, text[i + 1:]
        else:
            part += c
        i += 1
    if part or quoted:
        path.append(part)
    elif text:
        raise ConfigError(f"override --{text}: an empty key segment")
    return path, False, ""


def parse_overrides(args: Sequence[str]) -> dict[str, Any]:
    """Overrides only (`--a.b value` / `--a.b=value`) into a nested dict; any other word is an error."""
    files, tree = parse_command_line(args)
    if files:
        raise ConfigError(f"expected an override like --section.key value, got {files[0]!r}")
    return tree


def _parse_value(text: str) -> Any:
    """TOML/JSON literal when it parses (numbers, bools, lists), else the raw string."""
    for candidate in (text, text.lower()):
        try:
            return json.loads(candidate)
        except json.JSONDecodeError:
            continue
    return text


def _set_path(tree: dict[str, Any], path: list[str], value: Any) -> None:
    for part in path[:-1]:
        node = tree.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {'.'.join(path)} conflicts with a value at {part}")
        tree = node
    tree[path[-1]] = value


def merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    """Deep-merge `top` over `base` (dicts merge, anything else replaces)."""
    out = dict(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def read_config_file(path: str | Path) -> dict[str, Any]:
    """One config file as a dict: JSON if it ends in .json, else TOML."""
    text = Path(path).read_text()
    try:
        return json.loads(text) if str(path).endswith(".json") else tomllib.loads(text)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path}: {exc}") from None


def load_config(cls: type[C], files: Sequence[str | Path] = (), overrides: Sequence[str] = ()) -> C:
    """Build `cls` from config files then dotted overrides; errors name the offending key."""
    return load_tree(cls, files, parse_overrides(overrides))


def load_tree(cls: type[C], files: Sequence[str | Path], overrides: dict[str, Any]) -> C:
    """Defaults < `files` (in order) < an already parsed override tree."""
    data: dict[str, Any] = {}
    for path in files:
        data = merge(data, read_config_file(path))
    return validate(cls, merge(data, overrides))


def validate(cls: type[C], data: dict[str, Any]) -> C:
    """`cls.model_validate(data)` with errors rewritten to name keys the way a user typed them."""
    try:
        return cls.model_validate(_field_keys(cls, data))
    except ValidationError as exc:
        lines = []
        for err in exc.errors():
            key = ".".join(str(p) for p in err["loc"])
            if err["type"] in ("extra_forbidden", "unexpected_keyword_argument"):  # a model, a dataclass
                lines.append(f"unknown config key '{key}'")
            elif err["type"] == "missing":
                lines.append(f"config key '{key}' is required")
            elif key:
                lines.append(f"config key '{key}': {err['msg']}")
            else:  # a check across sections (model_post_init): the message names the keys
                lines.append(err["msg"].removeprefix("Value error, "))
        raise ConfigError("; ".join(lines)) from None


def _field_keys(cls: type[BaseModel], data: dict[str, Any]) -> dict[str, Any]:
    """Read `max-running-requests` as the field `max_running_requests`, in nested sections too."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = key.replace("-", "_")
        field = cls.model_fields.get(name)
        if field is None:
            out[key] = value  # not a field: left as typed, so the unknown-key error shows it
            continue
        section = field.annotation
        if isinstance(value, dict) and isinstance(section, type) and issubclass(section, BaseModel):
            value = _field_keys(section, value)
        out[name] = value
    return out


def dump_toml(cfg: BaseModel) -> str:
    """Render a config as TOML (for the run directory and `--dry-run`)."""
    return _toml_table(cfg.model_dump(mode="json"), prefix="")


def _toml_table(data: dict[str, Any], prefix: str, array: bool = False) -> str:
    tables = {k: v for k, v in data.items() if isinstance(v, dict) or _is_table_array(v)}
    scalars = [f"{_toml_key(k)} = {json.dumps(v)}" for k, v in data.items() if k not in tables]
    text = ""
    if array:
        text = f"[[{prefix}]]\n" + "".join(f"{line}\n" for line in scalars) + "\n"
    elif scalars:
        text = (f"[{prefix}]\n" if prefix else "") + "\n".join(scalars) + "\n\n"
    for key, value in tables.items():
        name = f"{prefix}.{_toml_key(key)}" if prefix else _toml_key(key)
        if isinstance(value, list):  # [[name]] per element: a list of sections (the router sim's pools)
            text += "".join(_toml_table(item, name, array=True) for item in value)
        else:
            text += _toml_table(value, name) if value else f"[{name}]\n\n"
    return text


def _is_table_array(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(v, dict) for v in value)


def _toml_key(key: str) -> str:
    """Bare keys as is; anything else (an adapter named `policy.v1`) quoted so it stays one key."""
    return key if re.fullmatch(r"[A-Za-z0-9_-]+", key) else json.dumps(key)
