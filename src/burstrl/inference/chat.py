"""Chat prompts to token ids, reusing a session's sampled ids verbatim (token continuity).

Why: re-tokenizing the model's own output can give different ids than were sampled (BPE merges
across the boundary, normalisation), and then the trainer's logprobs no longer describe what the
policy did. When a chat call extends the session's last call (same messages, then the assistant
message exactly as we returned it, then new messages), its prompt ids are

    previous prompt ids + sampled ids + tokens(template text after the sampled text)

where the last part is the rest of the assistant turn (e.g. `<|im_end|>\\n`, or only `\\n` if the
model sampled the end token itself) plus the new messages and the generation prompt. Anything
else (edited history, a stop string cut the text) falls back to tokenizing the whole conversation
and is counted as a continuity break.
"""

from __future__ import annotations

import threading
from typing import Any

from burstrl.inference.plaintext import PlainTextError, SpecialText, content_spans
from burstrl.inference.sessions import ReplicaSession


class ChatError(ValueError):
    """Messages that cannot be rendered (bad roles or content)."""


def normalize_messages(messages: Any) -> list[dict[str, str]]:
    """OpenAI messages -> [{role, content}] with text content; content parts are joined."""
    if not isinstance(messages, list) or not messages:
        raise ChatError("messages must be a non-empty list")
    out = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or msg.get("role") not in ("system", "user", "assistant", "tool", "developer"):
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
        out.append({"role": msg["role"], "content": content})
    return out


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

    def render(self, messages: list[dict[str, str]], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def prompt_ids(self, messages: list[dict[str, str]], session: ReplicaSession) -> list[int]:
        """Token ids for this call's prompt; continuous with the session's last call when possible.

        ChatError (a 400) for messages whose special-token text cannot be kept as text.
        """
        try:
            if session.messages is not None and session.completion_ids:
                ids = self._continue(messages, session)
                self._count(continued=ids is not None)
                if ids is not None:
                    return ids
            text = self.render(messages, generation_prompt=True)
            return self._encode_render(messages, text, 0, 0)
        except PlainTextError as exc:
            raise ChatError(str(exc)) from None

    def _encode_render(self, messages: list[dict[str, str]], text: str, start: int, new_from: int) -> list[int]:
        """Ids of `text`, the render of `messages` from character `start` on, with the contents of
        messages[new_from:] kept as text (inference.plaintext)."""
        if self.parse_special or not self.special.any_in(messages[new_from:]):
            return self.encode(text[start:])
        spans = [(a - start, b - start) for a, b in content_spans(self.render, messages, True, text) if a >= start]
        return self.special.encode(text[start:], spans)

    def _count(self, continued: bool) -> None:
        with self._lock:
            if continued:
                self.continued += 1
            else:
                self.breaks += 1

    def _continue(self, messages: list[dict[str, str]], session: ReplicaSession) -> list[int] | None:
        prev = session.messages
        n = len(prev)
        if len(messages) <= n + 1 or messages[:n] != prev:
            return None
        reply = messages[n]
        if reply["role"] != "assistant" or reply["content"] != session.completion_text:
            return None
        prev_text = self.render(prev, generation_prompt=True)
        with_reply = self.render(messages[: n + 1], generation_prompt=False)
        full = self.render(messages, generation_prompt=True)
        if not (with_reply.startswith(prev_text) and full.startswith(with_reply)):
            return None
        reply_text = with_reply[len(prev_text):]
        sampled = self.tokenizer.decode(session.completion_ids, skip_special_tokens=False)
        if not reply_text.startswith(sampled):
            return None
        tail = reply_text[len(sampled):]  # the template's end of the assistant turn
        if self.parse_special or not self.special.any_in(messages[n + 1:]):
            return session.prompt_ids + session.completion_ids + self.encode(tail + full[len(with_reply):])
        rest = self._encode_render(messages, full, len(with_reply), n + 1)
        return session.prompt_ids + session.completion_ids + self.encode(tail) + rest
