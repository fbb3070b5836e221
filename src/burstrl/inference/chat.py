"""Chat prompts to token ids, reusing a session's sampled ids verbatim (token continuity).

Why: re-tokenizing the model's own output can give different ids than were sampled (BPE merges
across the boundary, normalisation), and then the trainer's logprobs no longer describe what the
policy did. When a chat call extends the session's last call (same messages and tools, then the
assistant message exactly as we returned it, then new messages), its prompt ids are

    previous prompt ids + sampled ids + tokens(template text after the sampled text)

where the last part is the rest of the assistant turn (e.g. `<|im_end|>\\n`, or only `\\n` if the
model sampled the end token itself) plus the new messages and the generation prompt. Anything
else (edited history, a stop string cut the text, a template whose render of the returned tool calls
does not start with the sampled text) falls back to tokenizing the whole conversation and is counted
as a continuity break.

Tool use (`inference.tools`) is rendered by the template: `tools` go to `apply_chat_template`,
assistant `tool_calls` (arguments as JSON values, as vLLM passes them) and tool messages' ids stay
on the messages. A template that would silently drop either is refused rather than used.
"""

from __future__ import annotations

import functools
import threading
from typing import Any

from jinja2 import TemplateError

from burstrl.inference.plaintext import PlainTextError, SpecialText, content_spans
from burstrl.inference.sessions import ReplicaSession
from burstrl.inference.tools import (
    ToolError,
    ToolSpec,
    assistant_message,
    check_tool_calls,
    for_template,
    json_strings,
    optional_name,
    same_reply,
)

ROLES = ("system", "user", "assistant", "tool", "developer")
TOOL_KEYS = ("tool_calls", "tool_call_id", "name")  # what a normalized message holds besides role and content
PROBE_TOOL = {"type": "function", "function": {"name": "probe", "description": "probe",
                                               "parameters": {"type": "object", "properties": {}}}}
PROBE_CALL = {"id": "call_probe", "type": "function", "function": {"name": "probe", "arguments": "{}"}}
# What a template may raise for input it cannot render (its own raise_exception included): the caller's 400.
RENDER_ERRORS = (TemplateError, TypeError, ValueError, LookupError, AttributeError)


class ChatError(ValueError):
    """Messages that cannot be rendered (bad roles or content)."""


def normalize_messages(messages: Any) -> list[dict[str, Any]]:
    """OpenAI messages -> [{role, content}] with text content (parts joined), plus the tool use the
    template renders: an assistant's `tool_calls`, a tool message's `tool_call_id` and `name`."""
    if not isinstance(messages, list) or not messages:
        raise ChatError("messages must be a non-empty list")
    out = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or msg.get("role") not in ROLES:
            raise ChatError(f"messages[{i}] needs a role of system/user/assistant/tool/developer")
        content = msg.get("content")
        if content is None:
            content = ""
        if isinstance(content, list):
            parts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
            parts = [t for t in parts if isinstance(t, str)]
            if len(parts) != len(content):
                raise ChatError(f"messages[{i}]: only text content parts with string text are supported")
            content = "".join(parts)
        if not isinstance(content, str):
            raise ChatError(f"messages[{i}].content must be a string or text parts")
        try:
            out.append({"role": msg["role"], "content": content, **_tool_fields(i, msg)})
        except ToolError as exc:
            raise ChatError(str(exc)) from None
    return out


def _tool_fields(i: int, msg: dict[str, Any]) -> dict[str, Any]:
    """The tool use a message carries, checked (`tools.check_tool_calls`); empty tool_calls are none."""
    calls = msg.get("tool_calls")
    if calls is not None and calls != []:
        if msg["role"] != "assistant":
            raise ToolError(f"messages[{i}].tool_calls: only assistant messages carry tool calls")
        return {"tool_calls": check_tool_calls(calls, f"messages[{i}].tool_calls")}
    if msg["role"] != "tool":
        return {}
    fields = {key: optional_name(msg.get(key), f"messages[{i}].{key}") for key in ("tool_call_id", "name")}
    return {k: v for k, v in fields.items() if v is not None}


def _listed(tools: ToolSpec | None) -> list[dict[str, Any]] | None:
    return tools.tools if tools is not None else None


class ChatTokenizer:
    """Renders the tokenizer's chat template and builds prompt ids with continuity.

    Called from the replica's request workers (`inference.workers`), several at once: the counters
    take a lock, the tokenizer is only read.
    """

    def __init__(self, tokenizer: Any, content_special_tokens: str = "text") -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ChatError("the tokenizer has no chat template; use /v1/completions")
        self.tokenizer = tokenizer
        self.special = SpecialText(tokenizer)
        self.parse_special = content_special_tokens == "parse"  # vLLM's behaviour (inference.plaintext)
        self.continued = 0
        self.breaks = 0
        self._lock = threading.Lock()
        # Compile the template now: compiling is one call that holds the interpreter lock ~0.2 s,
        # which the first request would otherwise make every other client wait for.
        self.render([{"role": "user", "content": ""}], generation_prompt=True)
        self.renders_tools, self.renders_tool_calls = self._tool_support()

    def render(self, messages: list[dict[str, Any]], generation_prompt: bool,
               tools: list[dict[str, Any]] | None = None) -> str:
        """The template's text; ChatError (a 400) when the template refuses these messages."""
        try:
            if any("tool_calls" in m for m in messages):
                messages = [{**m, "tool_calls": for_template(m["tool_calls"])} if "tool_calls" in m else m
                            for m in messages]
            return self.tokenizer.apply_chat_template(
                messages, tools=tools or None, tokenize=False, add_generation_prompt=generation_prompt)
        except RENDER_ERRORS as exc:
            raise ChatError(f"the chat template cannot render these messages: {str(exc)[:200]}") from None

    def _tool_support(self) -> tuple[bool, bool]:
        """Whether the template renders `tools`, and assistant `tool_calls`: one that ignores them
        would drop them silently, so requests holding them are refused instead."""
        user = [{"role": "user", "content": "x"}]
        called = [*user, {"role": "assistant", "content": "", "tool_calls": [PROBE_CALL]}]
        try:
            tools = self.render(user, True, [PROBE_TOOL]) != self.render(user, True)
        except ChatError:
            tools = False
        try:
            calls = self.render(called, False) != self.render([*user, {"role": "assistant", "content": ""}], False)
        except ChatError:
            calls = False
        return tools, calls

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def prompt_ids(self, messages: list[dict[str, Any]], session: ReplicaSession,
                   tools: ToolSpec | None = None) -> list[int]:
        """Token ids for this call's prompt; continuous with the session's last call when possible.

        ChatError (a 400) for messages whose special-token text cannot be kept as text, and for tool
        use this template cannot render.
        """
        self._check_tool_use(messages, tools)
        try:
            if session.messages is not None and session.completion_ids:
                ids = self._continue(messages, session, tools)
                self._count(continued=ids is not None)
                if ids is not None:
                    return ids
            text = self.render(messages, True, _listed(tools))
            return self._encode_render(messages, text, 0, 0, tools)
        except PlainTextError as exc:
            raise ChatError(str(exc)) from None

    def _check_tool_use(self, messages: list[dict[str, Any]], tools: ToolSpec | None) -> None:
        """Refuse tool use the template would drop, and special-token text outside content: only
        content spans are kept as text (`inference.plaintext`), so elsewhere it would forge tokens."""
        if tools is not None and not self.renders_tools:
            raise ChatError("this model's chat template does not render tools")
        if not self.renders_tool_calls and any("tool_calls" in m for m in messages):
            raise ChatError("this model's chat template does not render assistant tool_calls")
        if self.parse_special:
            return
        for i, m in enumerate(messages):
            for key in TOOL_KEYS:
                if key in m and any(self.special.found_in(s) for s in json_strings(m[key])):
                    raise ChatError(f"messages[{i}].{key} holds special-token text; only message content may")
        if tools is not None and any(self.special.found_in(s) for s in json_strings(tools.tools)):
            raise ChatError("tools hold special-token text; only message content may")

    def _encode_render(self, messages: list[dict[str, Any]], text: str, start: int, new_from: int,
                       tools: ToolSpec | None) -> list[int]:
        """Ids of `text`, the render of `messages` from character `start` on, with the contents of
        messages[new_from:] kept as text (inference.plaintext)."""
        if self.parse_special or not self.special.any_in(messages[new_from:]):
            return self.encode(text[start:])
        render = functools.partial(self.render, tools=_listed(tools))
        spans = [(a - start, b - start) for a, b in content_spans(render, messages, True, text) if a >= start]
        return self.special.encode(text[start:], spans)

    def _count(self, continued: bool) -> None:
        with self._lock:
            if continued:
                self.continued += 1
            else:
                self.breaks += 1

    def _continue(self, messages: list[dict[str, Any]], session: ReplicaSession,
                  tools: ToolSpec | None) -> list[int] | None:
        prev = session.messages
        n = len(prev)
        if session.tools != tools or len(messages) <= n + 1 or messages[:n] != prev:
            return None
        if not same_reply(messages[n], assistant_message(session.completion_text, session.tools)):
            return None
        listed = _listed(tools)
        prev_text = self.render(prev, True, listed)
        with_reply = self.render(messages[: n + 1], False, listed)
        full = self.render(messages, True, listed)
        if not (with_reply.startswith(prev_text) and full.startswith(with_reply)):
            return None
        reply_text = with_reply[len(prev_text):]
        sampled = self.tokenizer.decode(session.completion_ids, skip_special_tokens=False)
        if not reply_text.startswith(sampled):
            return None
        tail = reply_text[len(sampled):]  # the template's end of the assistant turn
        if self.parse_special or not self.special.any_in(messages[n + 1:]):
            return session.prompt_ids + session.completion_ids + self.encode(tail + full[len(with_reply):])
        rest = self._encode_render(messages, full, len(with_reply), n + 1, tools)
        return session.prompt_ids + session.completion_ids + self.encode(tail) + rest
