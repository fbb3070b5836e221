"""Prefix keys of text and chat prompts, which the router can match only against its own placements.

Why: the router holds no tokenizer, so a text or chat prompt has no token blocks (`protocol.blocks`)
and was placed by load alone. A GRPO group starts G sessions with the same first prompt at once;
spread over replicas, each sibling re-prefills what the replica's prefix cache would have copied
from another (a shared fleet of 3 replicas fell from 0.334 to 0.198 prefix hit rate). Here such a
prompt is serialized canonically (what the replica renders into the prompt, in its order: `tools`
before the messages, then each message) and cut into fixed chunks of characters, each keyed by
BLAKE2b chained over the chunks before it, like token blocks: equal leading keys mean an equal
prefix of the rendering's input, so `KvAwarePolicy` sends a sibling where the first went.

What these keys never match: replicas' block summaries (those hold token blocks; the seed carries
a tag no token scope has, so a collision is a 2^-63 accident that costs one placement). They match
only the router's `recent_assignments`, which `loads.shown` never sees cached, so a text placement
stays matchable for `loads.HOLD_SCRAPES` scrapes: a group submitted together is matched; a later
group of the same prompt after that is placed by load.

Bounded work on hostile bodies: the serialization stops at MAX_CHUNKS chunks of characters
(strings are cut before they are escaped, containers are walked lazily and only MAX_DEPTH deep,
objects with more than MAX_SORTED_KEYS keys keep their order rather than being sorted).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from typing import Any

CHUNK_CHARS = 128  # characters per key
CHUNK_TOKENS = 32  # rough tokens per chunk (~4 characters a token), so the policy's cost stays in tokens
MAX_CHUNKS = 512  # ~16k tokens of prompt: enough to tell GRPO groups apart, bounded work per placement
MAX_DEPTH = 32  # deeper values are serialized as a marker (no prompt the replica renders is this deep)
MAX_SORTED_KEYS = 256  # larger objects keep their order: sorting a hostile 1M-key object is not bounded
CHAT, TEXT = "chat", "text"  # a chat body and a text prompt never share keys (they render differently)


def chat_parts(body: dict[str, Any]) -> list[Any] | None:
    """What of a chat body the replica renders into the prompt, in render order; None if not a chat body.

    `tools` go into the template before the messages, unless `tool_choice` is "none" (then they are not
    rendered: `inference.tools.tool_spec`). The template options (`chat_template`, `add_generation_prompt`,
    ...) are refused by the replica unless left at their defaults, so they cannot change the prompt.
    """
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return None
    tools = body.get("tools") if body.get("tool_choice") != "none" else None
    return [{"tools": tools}, *messages] if tools else list(messages)


def text_prompt(body: dict[str, Any]) -> list[Any] | None:
    """A completion's text prompt (a string, or a one-string batch) and whether special tokens are
    added (`add_special_tokens`, default true: a BOS changes every token after it); None if not text."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str):
        return None
    return [{"add_special_tokens": body.get("add_special_tokens", True) is not False}, prompt]


def text_prefix_keys(body: dict[str, Any], scope: str, max_chunks: int = MAX_CHUNKS,
                     chunk: int = CHUNK_CHARS) -> tuple[int, ...]:
    """Chained 63-bit keys of the chat or text prompt of `body` (empty if it has neither), seeded by
    `scope` (`protocol.blocks.cache_scope`: version and cache salt, a tenant's scoped) and the kind.

    The last chunk may be partial: a GRPO prompt is often shorter than a few chunks, and siblings
    send it identically, so its tail identifies it too. Each part ends with a newline, so a
    conversation's keys are a prefix of the keys of the same conversation with a message more
    (all but its last, partial chunk).
    """
    parts, kind = chat_parts(body), CHAT
    if parts is None:
        parts, kind = text_prompt(body), TEXT
    if parts is None or max_chunks <= 0:
        return ()
    text = serialize(parts, max_chunks * chunk)
    prev = hashlib.blake2b(f"{scope}\x00text-keys:{kind}".encode(), digest_size=8).digest()
    out = []
    for start in range(0, len(text), chunk):
        prev = hashlib.blake2b(prev + text[start:start + chunk].encode("utf-8", "surrogatepass"),
                               digest_size=8).digest()
        out.append(int.from_bytes(prev, "little") >> 1)
    return tuple(out)


def serialize(parts: list[Any], limit: int) -> str:
    """Each part as canonical JSON and a newline, the whole cut at `limit` characters (work bounded by it)."""
    out: list[str] = []
    n = 0
    for part in parts:
        for piece in _pieces(part, limit - n, 0):
            out.append(piece)
            n += len(piece)
            if n >= limit:
                return "".join(out)[:limit]
        out.append("\n")
        n += 1
        if n >= limit:
            break
    return "".join(out)[:limit]


def _pieces(value: Any, budget: int, depth: int) -> Iterator[str]:
    """Canonical JSON of `value` (sorted keys, no spaces) in pieces; a string longer than `budget` is cut
    first (its escaped form is at least as long, so the cut text is the prefix the caller keeps)."""
    if isinstance(value, str):
        yield json.dumps(value[:max(budget, 1)], ensure_ascii=False)
    elif depth >= MAX_DEPTH:
        yield '"\x00deep"'
    elif isinstance(value, dict):
        yield from _object(value, budget, depth)
    elif isinstance(value, list):
        yield "["
        for i, item in enumerate(value):
            yield "," if i else ""
            yield from _pieces(item, budget, depth + 1)
        yield "]"
    else:
        yield json.dumps(value)


def _object(value: dict[str, Any], budget: int, depth: int) -> Iterator[str]:
    """An object's pieces, keys sorted unless there are too many to sort cheaply."""
    keys = sorted(value) if len(value) <= MAX_SORTED_KEYS else value
    yield "{"
    for i, key in enumerate(keys):
        yield ("," if i else "") + json.dumps(str(key)[:max(budget, 1)], ensure_ascii=False) + ":"
        yield from _pieces(value[key], budget, depth + 1)
    yield "}"
