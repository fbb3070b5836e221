"""Message content is text: a special token's string typed into content never becomes that token.

Why: tokenizing a rendered chat prompt as one string turns every special-token string in it into the
special token, wherever it came from. A tool output or task text holding `<|im_end|>\\n<|im_start|>system`
then forges a turn boundary and a system turn, and capture records the forged ids as if the template
had written them. In RL the tool outputs are written by the policy's own actions, so the policy could
rewrite its own prompt's structure. vLLM parses them by default; here the template's structure tokens
come from the template alone (`content_special_tokens = "text"`, the default), and "parse" keeps
vLLM's behaviour for a deployment that wants it.

How: content that holds no special-token string is tokenized exactly as before (the whole render in
one call), so ordinary prompts keep their ids. Content that does is located in the render: the
template is rendered again with each content replaced by a unique marker, the render is split at the
markers into the template's own pieces, and each content's span is found between them (as written,
or trimmed, which is what templates do to content). Template pieces are tokenized with special tokens,
content spans with `split_special_tokens`. A template that transforms content in another way cannot be
matched: such a request is refused (400) rather than tokenized unsafely.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Callable
from typing import Any

UNMATCHED = ("message content holds special-token text, and this chat template transforms content in a way "
             "that cannot be matched to keep it as text; remove the special-token text")
Span = tuple[int, int]  # [start, end) in the rendered text
Render = Callable[[list[dict[str, Any]], bool], str]


class PlainTextError(ValueError):
    """Content holding special-token text that this template's render does not let us keep as text."""


class SpecialText:
    """Finds special-token strings in text and tokenizes a render with content spans kept as text."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        specials = {t.content for t in decoder.values() if getattr(t, "special", False) and t.content}
        self._pattern = re.compile(trie_pattern(specials)) if specials else None

    def found_in(self, text: str) -> bool:
        """Whether `text` holds a special token's string."""
        return self._pattern is not None and self._pattern.search(text) is not None

    def any_in(self, messages: list[dict[str, Any]]) -> bool:
        return any(self.found_in(m["content"]) for m in messages)

    def encode(self, text: str, spans: list[Span]) -> list[int]:
        """Token ids of `text`: the template's pieces with special tokens, `spans` (sorted) as plain text."""
        ids: list[int] = []
        pos = 0
        for start, end in spans:
            ids += self._ids(text[pos:start], special=True)
            ids += self._ids(text[start:end], special=False)
            pos = end
        return ids + self._ids(text[pos:], special=True)

    def _ids(self, text: str, special: bool) -> list[int]:
        if not text:
            return []
        return self.tokenizer.encode(text, add_special_tokens=False, split_special_tokens=not special)


def trie_pattern(words: set[str]) -> str:
    """A regex matching any of `words`, nested by common prefix.

    Why not `a|b|c...`: Gemma's tokenizer has 6,249 special tokens, nearly all starting with `<`; a flat
    alternation tries each at every `<` (4.4 s for 900k characters of `<a `), a trie rejects a
    position at its first unmatched character (5 ms).
    """
    trie: dict[str, Any] = {}
    for word in words:
        node = trie
        for ch in word:
            node = node.setdefault(ch, {})
        node[""] = {}  # a word ends here

    def build(node: dict[str, Any]) -> str:
        alts = [re.escape(ch) + build(child) for ch, child in sorted(node.items()) if ch]
        if not alts:
            return ""
        body = alts[0] if len(alts) == 1 else "(?:" + "|".join(alts) + ")"
        return f"(?:{body})?" if "" in node else body

    return build(trie)


def content_spans(render: Render, messages: list[dict[str, Any]], generation_prompt: bool, text: str) -> list[Span]:
    """Where each message's content lies in `text` (= `render(messages, generation_prompt)`).

    PlainTextError when the template's render cannot be matched piece by piece.
    """
    nonce = secrets.token_hex(8)
    # Empty content holds no special text and is not marked: templates test it (Qwen writes a newline
    # before an assistant's tool calls only after non-empty content), so a marker there would change the render.
    marked = [{**m, "content": f"\ue000{nonce}:{i}\ue001"} if m["content"] else m for i, m in enumerate(messages)]
    pieces = re.split(f"\ue000{nonce}:([0-9]+)\ue001", render(marked, generation_prompt))
    # pieces = [template, index, template, index, ..., template]
    spans, pos = [], 0
    for k in range(0, len(pieces) - 1, 2):
        pos = _expect(text, pos, pieces[k])
        content = messages[int(pieces[k + 1])]["content"]
        end = _match_content(text, pos, content, pieces[k + 2])
        spans.append((pos, end))
        pos = end
    if text[pos:] != pieces[-1]:
        raise PlainTextError(UNMATCHED)
    return spans


def _expect(text: str, pos: int, piece: str) -> int:
    if not text.startswith(piece, pos):
        raise PlainTextError(UNMATCHED)
    return pos + len(piece)


def _match_content(text: str, pos: int, content: str, following: str) -> int:
    """The end of `content` (as written or trimmed by the template) at `pos`, followed by `following`."""
    for form in dict.fromkeys((content, content.strip(), content.lstrip(), content.rstrip())):
        end = pos + len(form)
        if text.startswith(form, pos) and text.startswith(following, end):
            return end
    raise PlainTextError(UNMATCHED)
