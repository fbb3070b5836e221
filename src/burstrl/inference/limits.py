"""Size limits of a generation request, checked before any parsing, tokenizing or template rendering.

Why: the work a request costs grows with its size (JSON values built, characters tokenized,
messages rendered through the chat template), while anything past the model's context is refused
in the end anyway. Checked last, a single 8 MB body cost 3-20 s of tokenizer and template time and
held every other client of the replica meanwhile (issue 36). Checked first, on the raw bytes and on
the parsed JSON, it costs milliseconds before its 400, which names the limit and its config key.

Two stages, both in the replica's worker pool (`inference.workers`):

1. `check_json_size` on the raw bytes, before `json.loads` (`inference.jsonscan`): the parser holds
   the interpreter lock for as long as it builds objects (~0.1 µs each; 4M numbers = 0.5 s during
   which nothing else in the process runs, in whichever thread), so the number of values (and the
   nesting) is bounded before it runs.
2. `check_completion` / `check_chat` on the parsed body, before pydantic, tokenizer or template:
   O(1) length checks of the fields that drive the later work, plus one pass over the messages
   (and the strings of their tool calls and of the request's tools, which the template renders too).

Defaults derive from the model's context (`max_model_len`, in tokens); `ServeConfig.limits` sets them
explicitly:
- token ids: a prompt of max_model_len ids or more leaves no room to generate (the same bound
  `server._params` applies after tokenizing);
- characters: CHARS_PER_TOKEN per token of context. Real text averages 3-5 characters per token;
  a prompt past this ratio cannot fit the context once tokenized;
- messages: one per token of context: every message renders to at least one token; so do content
  parts and tool calls, bounded alike;
- tools: MAX_TOOLS, OpenAI's own bound;
- JSON items: ITEMS_PER_TOKEN per token of context plus ITEMS_SLACK, enough for a full context of
  token ids or of messages (about five items each) with every other field at its maximum.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from burstrl.config import RequestLimitsConfig
from burstrl.inference.jsonscan import scan_json

CHARS_PER_TOKEN = 16
ITEMS_PER_TOKEN = 8
ITEMS_SLACK = 4096
MAX_MODEL_NAME = 256  # a model name is a version name or an adapter name, never a text
MAX_FIELD_ENTRIES = 1024  # stop, stop_token_ids, logit_bias: the sampler's own bounds are smaller
MAX_TOOLS = 128  # a chat request's tools (OpenAI's own limit)
TOOL_FIELDS = ("tool_calls", "tool_call_id", "name")  # rendered strings besides content


class LimitError(ValueError):
    """A request past one of the limits (a 400); the message names the limit and its config key."""


@dataclass(frozen=True)
class RequestLimits:
    """The limits in force on one replica, resolved against its model's context length."""

    max_model_len: int
    max_prompt_chars: int
    max_messages: int
    max_json_items: int
    max_json_depth: int

    @classmethod
    def derive(cls, cfg: RequestLimitsConfig, max_model_len: int) -> RequestLimits:
        """The configured limits, each 0 replaced by its default for a `max_model_len`-token context."""
        return cls(
            max_model_len=max_model_len,
            max_prompt_chars=cfg.max_prompt_chars or CHARS_PER_TOKEN * max_model_len,
            max_messages=cfg.max_messages or max_model_len,
            max_json_items=cfg.max_json_items or ITEMS_PER_TOKEN * max_model_len + ITEMS_SLACK,
            max_json_depth=cfg.max_json_depth,
        )


def check_json_size(raw: bytes, limits: RequestLimits) -> None:
    """Refuse a body with more JSON values than `limits.max_json_items`, or nested deeper than
    `limits.max_json_depth`, before it is parsed."""
    items, too_deep = scan_json(raw, limits.max_json_items, limits.max_json_depth)
    if too_deep:
        raise LimitError(f"JSON nested deeper than {limits.max_json_depth} levels (limits.max_json_depth)")
    if items > limits.max_json_items:
        raise LimitError(f"request body holds more than {limits.max_json_items} JSON values; this replica "
                         f"takes at most {limits.max_json_items} (limits.max_json_items)")


def check_completion(data: dict[str, Any], limits: RequestLimits) -> None:
    """Sizes of a /v1/completions body (parsed JSON, not yet validated)."""
    check_common(data, limits)
    for name in ("prompt", "input_ids"):
        check_prompt(name, data.get(name), limits)


def check_chat(data: dict[str, Any], limits: RequestLimits) -> None:
    """Sizes of a /v1/chat/completions body (parsed JSON, not yet validated): messages, their text and
    tool calls, and the tools, whose characters count with the content's."""
    check_common(data, limits)
    tools = data.get("tools")
    if isinstance(tools, list) and len(tools) > MAX_TOOLS:
        raise LimitError(f"tools has {len(tools)} entries; at most {MAX_TOOLS}")
    messages = data.get("messages")
    if not isinstance(messages, list):
        return  # validation names the error
    if len(messages) > limits.max_messages:
        raise LimitError(f"messages has {len(messages)} entries; this replica takes at most "
                         f"{limits.max_messages} (limits.max_messages)")
    chars, parts, calls = json_chars(tools), 0, 0
    for message in messages:
        if not isinstance(message, dict):
            continue
        content = message.get("content")
        if isinstance(content, str):
            chars += len(content)
        elif isinstance(content, list):
            parts += len(content)
            _check_count("content parts", parts, limits)
            chars += sum(len(p["text"]) for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
        tool_calls = message.get("tool_calls")
        if isinstance(tool_calls, list):
            calls += len(tool_calls)
            _check_count("tool calls", calls, limits)
        chars += sum(json_chars(message.get(key)) for key in TOOL_FIELDS)
    _check_chars("messages' content, tool calls and tools", chars, limits)


def _check_count(what: str, count: int, limits: RequestLimits) -> None:
    if count > limits.max_messages:
        raise LimitError(f"messages have more than {limits.max_messages} {what}; this replica "
                         f"takes at most {limits.max_messages} (limits.max_messages)")


def json_chars(value: Any) -> int:
    """Characters of the strings in a JSON value, keys included (its JSON values are bounded already)."""
    chars, stack = 0, [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            chars += len(item)
        elif isinstance(item, dict):
            chars += sum(len(k) for k in item if isinstance(k, str))
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return chars


def check_common(data: dict[str, Any], limits: RequestLimits) -> None:
    """Sizes every generation body shares (model name, stop strings, stop ids, logit bias), checked
    before validation so a hostile body costs little; used by the generate endpoint too."""
    model = data.get("model")
    if isinstance(model, str) and len(model) > MAX_MODEL_NAME:
        raise LimitError(f"model has {len(model)} characters; a model name has at most {MAX_MODEL_NAME}")
    for name in ("stop", "stop_token_ids", "logit_bias"):
        value = data.get(name)
        if isinstance(value, (list, dict)) and len(value) > MAX_FIELD_ENTRIES:
            raise LimitError(f"{name} has {len(value)} entries; at most {MAX_FIELD_ENTRIES}")
    stop = data.get("stop")
    stops = [stop] if isinstance(stop, str) else stop if isinstance(stop, list) else []
    _check_chars("stop", sum(len(s) for s in stops if isinstance(s, str)), limits)


def check_prompt(name: str, prompt: Any, limits: RequestLimits) -> None:
    """A text prompt's characters, a token-id prompt's length; a one-element batch's one element."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        _check_chars(name, len(prompt), limits)
    elif isinstance(prompt, list) and len(prompt) >= limits.max_model_len:
        raise LimitError(f"{name} has {len(prompt)} entries; this model's maximum context length is "
                         f"{limits.max_model_len} tokens (engine.max_model_len)")


def _check_chars(what: str, chars: int, limits: RequestLimits) -> None:
    if chars > limits.max_prompt_chars:
        raise LimitError(f"{what} has {chars} characters; this replica takes at most {limits.max_prompt_chars} "
                         f"(limits.max_prompt_chars; for a {limits.max_model_len}-token context the default is "
                         f"{CHARS_PER_TOKEN} per token)")
