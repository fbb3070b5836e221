"""OpenAI tool calling on /v1/chat/completions, the way vLLM's hermes parser does it for Qwen models.

Why: environments of the ecosystem (verifiers' ToolEnv, its MCP toolsets) send OpenAI `tools`, expect
`tool_calls` back, and send the conversation back with assistant `tool_calls` and `role: "tool"`
results. The chat template renders all of it (`chat.ChatTokenizer`: the tools as a system block, the
calls as `<tool_call>` blocks, the results as `<tool_response>` blocks); this module checks what
the request holds and parses the model's `<tool_call>` blocks back out of its completion.

Everything here is pure: no tokenizer, no engine. Request input is hostile, so every shape is
checked and a bad one is a `ToolError` (a 400) naming the field; sizes are bounded earlier
(`inference.limits`). The completion is the policy's own output, also untrusted: a block that does
not parse (bad JSON, an unknown tool, arguments that are not an object) stays in `content` as text,
the model's mistake and never an error, and the parser is linear in the text.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
MAX_NAME = 256  # tool names and call ids: identifiers, never texts
MAX_DEPTH = 64  # nesting of arguments, as of a request body (openai_api.MAX_JSON_DEPTH)
INVALID = object()  # what `_json_value` gives for text that is not usable JSON (JSON null is None)
TOOL_CHOICES = (None, "auto", "none")


class ToolError(ValueError):
    """A request's tools, tool_choice or tool messages in a shape this server refuses (a 400)."""


@dataclass(frozen=True)
class ToolSpec:
    """The request's tools as the template renders them, and how calls are parsed back.

    Kept on the session (`ReplicaSession.tools`): the next call continues the token stream only with
    the same tools, and its assistant message must be the one parsed with them.
    """

    tools: list[dict[str, Any]]
    parallel: bool = True  # parallel_tool_calls: false keeps only the first call

    @property
    def names(self) -> set[str]:
        return {t["function"]["name"] for t in self.tools}


def tool_spec(tools: Any, tool_choice: Any, parallel_tool_calls: Any = None) -> ToolSpec | None:
    """The request's tools checked; None when there are none or `tool_choice` is "none" (not rendered)."""
    canonical = check_tools(tools)
    if isinstance(tool_choice, dict):
        raise ToolError("tool_choice naming a function is not supported by this server; use 'auto' or 'none'")
    if tool_choice == "required":
        raise ToolError("tool_choice 'required' is not supported by this server; use 'auto' or 'none'")
    if not isinstance(tool_choice, (str, type(None))) or tool_choice not in TOOL_CHOICES:
        raise ToolError("tool_choice must be 'auto' or 'none'")
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise ToolError("parallel_tool_calls must be true or false")
    if not canonical or tool_choice == "none":
        return None
    return ToolSpec(canonical, parallel=parallel_tool_calls is not False)


def check_tools(tools: Any) -> list[dict[str, Any]]:
    """`tools` as [{"type": "function", "function": {name, description?, parameters?, strict?}}],
    unknown keys dropped; ToolError naming the first bad field."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise ToolError("tools must be a list")
    out, seen = [], set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise ToolError(f"{where}.type must be 'function' (the only kind of tool served)")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise ToolError(f"{where}.function must be an object")
        name = _name(fn.get("name"), f"{where}.function.name")
        if name in seen:
            raise ToolError(f"{where}.function.name {name!r} is given twice")
        seen.add(name)
        out.append({"type": "function", "function": {"name": name, **_optional_fields(fn, where)}})
    return out


def _optional_fields(fn: dict[str, Any], where: str) -> dict[str, Any]:
    kinds = {"description": (str, "a string"), "parameters": (dict, "an object"), "strict": (bool, "a boolean")}
    out = {}
    for key, (kind, what) in kinds.items():
        value = fn.get(key)
        if value is None:
            continue
        if not isinstance(value, kind):
            raise ToolError(f"{where}.function.{key} must be {what}")
        out[key] = value
    return out


def _name(value: Any, where: str) -> str:
    if not isinstance(value, str) or not 0 < len(value) <= MAX_NAME:
        raise ToolError(f"{where} must be a non-empty string of at most {MAX_NAME} characters")
    return value


def check_tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    """An assistant message's `tool_calls` as [{id, type: "function", function: {name, arguments}}]
    (unknown keys such as a stream's `index` dropped); `arguments` must be JSON text."""
    if not isinstance(calls, list):
        raise ToolError(f"{where} must be a list")
    out = []
    for j, call in enumerate(calls):
        at = f"{where}[{j}]"
        if not isinstance(call, dict):
            raise ToolError(f"{at} must be an object")
        if call.get("type") not in (None, "function"):
            raise ToolError(f"{at}.type must be 'function'")
        fn = call.get("function")
        if not isinstance(fn, dict):
            raise ToolError(f"{at}.function must be an object")
        arguments = fn.get("arguments")
        if not isinstance(arguments, str) or _json_value(arguments) is INVALID:
            raise ToolError(f"{at}.function.arguments must be a string of JSON text "
                            f"(valid Unicode, nested at most {MAX_DEPTH} levels)")
        out.append({"id": _name(call.get("id"), f"{at}.id"), "type": "function",
                    "function": {"name": _name(fn.get("name"), f"{at}.function.name"), "arguments": arguments}})
    return out


def optional_name(value: Any, where: str) -> str | None:
    """A tool message's `tool_call_id` or `name`: absent, null, or a short string."""
    return None if value is None else _name(value, where)


def _json_value(text: str) -> Any:
    """The JSON value in `text`, or INVALID when it is not JSON a template and a response can hold:
    JSON text may escape a lone surrogate (no tokenizer or UTF-8 response takes it) or nest deep
    enough to exhaust the stack when a template serializes it again."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return INVALID
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > MAX_DEPTH:
            return INVALID
        if isinstance(item, str) and not _is_unicode(item):
            return INVALID
        if isinstance(item, dict):
            stack.extend((k, depth) for k in item)
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, list):
            stack.extend((v, depth + 1) for v in item)
    return value


def _is_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def for_template(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Tool calls with their arguments as JSON values, not text, as vLLM hands them to templates
    (Qwen2.5's renders `arguments | tojson`, which would quote a string)."""
    return [{**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
            for c in calls]


def parse_tool_calls(text: str, names: set[str], parallel: bool = True) -> tuple[str, list[dict[str, Any]]]:
    """`text` split into what lies outside its parsed `<tool_call>` blocks and the calls.

    A block is `<tool_call>JSON</tool_call>` (or a last `<tool_call>JSON` left open, as when a stop
    string cut its end); it is a call when the JSON is an object with a `name` among `names` and an
    object of `arguments`. Any other block stays in the text. Without `parallel`, calls after the
    first stay text too. Linear in `text`: each block is found with one forward search.
    """
    kept, calls, pos = [], [], 0
    for start, end, body in _blocks(text):
        call = _call(body, names) if parallel or not calls else None
        if call is not None:
            kept.append(text[pos:start])
            calls.append(call)
            pos = end
    kept.append(text[pos:])
    return "".join(kept), calls


def _blocks(text: str) -> Iterator[tuple[int, int, str]]:
    """(start, end, inner text) of each `<tool_call>` block, in order."""
    pos = 0
    while (start := text.find(OPEN, pos)) >= 0:
        inner = start + len(OPEN)
        close = text.find(CLOSE, inner)
        if close < 0:
            yield start, len(text), text[inner:]
            return
        yield start, close + len(CLOSE), text[inner:close]
        pos = close + len(CLOSE)


def _call(body: str, names: set[str]) -> dict[str, Any] | None:
    data = _json_value(body)
    if not isinstance(data, dict) or not isinstance(data.get("arguments"), dict):
        return None
    name = data.get("name")
    if not isinstance(name, str) or name not in names:
        return None
    arguments = json.dumps(data["arguments"], ensure_ascii=False)
    return {"id": f"call_{secrets.token_hex(12)}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def assistant_message(text: str, spec: ToolSpec | None) -> dict[str, Any]:
    """The assistant message returned for a completion `text`: with tools, its calls parsed out.

    Without calls the content is `text` as sampled (what a request without tools gets); with calls
    it is the text around the blocks, stripped, or None when nothing is left (as OpenAI answers).
    """
    if spec is None:
        return {"role": "assistant", "content": text}
    rest, calls = parse_tool_calls(text, spec.names, spec.parallel)
    if not calls:
        return {"role": "assistant", "content": text}
    return {"role": "assistant", "content": rest.strip() or None, "tool_calls": calls}


def same_reply(reply: dict[str, Any], returned: dict[str, Any]) -> bool:
    """Whether a normalized message is the assistant message we returned, the calls' ids aside
    (templates of this family do not render ids; content None and "" are the same empty text)."""
    return (reply.get("role") == "assistant" and (reply.get("content") or "") == (returned.get("content") or "")
            and _calls_without_ids(reply) == _calls_without_ids(returned))


def _calls_without_ids(message: dict[str, Any]) -> list[tuple[str, str]]:
    return [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls") or []]


def json_strings(value: Any) -> Iterator[str]:
    """Every string in a JSON value, keys included (for the special-token check)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            yield item
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
