"""Server-sent events for streaming completions (OpenAI chunk shapes plus token ids).

Text is sent as it becomes stable: a trailing partial UTF-8 character is held back, and so are the
last characters that could still turn into a stop string (which is then cut, as OpenAI does).
If the client goes away the generator is cancelled and the request aborted, freeing its slot.
With `return_token_ids`, the prompt ids come where vLLM puts them: at the top level of the first
chunk for chat, in the first chunk's choice for completions. A request that fails in the engine
ends with an error event and no `[DONE]`, so a client never takes a cut stream for a whole one.

A chat call with tools (`inference.tools`) holds its text until the end: whether it is content or
tool calls is known only once the `<tool_call>` blocks are complete. Its last chunk carries the
whole message as OpenAI streams it (`delta.content`, `delta.tool_calls` with their `index`), with
the logprobs and token ids of every token.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from burstrl.inference import openai_api as api
from burstrl.inference.engine import Request
from burstrl.inference.replica import InferenceReplica
from burstrl.protocol.http import error_body


async def stream_response(rep: InferenceReplica, req: Request, events: asyncio.Queue[str], body: Any,
                          kind: str, want_logprobs: bool) -> AsyncIterator[bytes]:
    created = int(time.time())
    holdback = max((len(s) for s in req.params.stop), default=1) - 1
    sent_tokens, sent_text, finished = 0, "", False
    prompt_ids = {"prompt_token_ids": req.prompt_ids} if body.return_token_ids else {}
    hold = kind == "chat" and req.tools is not None
    try:
        if kind == "chat":
            first = _chunk(req, body, kind, created, {"role": "assistant", "content": ""}, None, [], None, {})
            yield _sse({**first, **prompt_ids})
        while not finished:
            event = await events.get()
            finished = event == "done"
            if req.error is not None:
                finished = True  # the engine is done with it: nothing to abort
                yield _sse(error_body(500, f"engine error: {req.error}", "server_error"))
                return
            if hold and not finished:
                continue
            n = len(req.completion_ids)
            if finished:
                text = req.text or ""
            else:
                text = rep.tokenizer.decode(req.completion_ids[:n], skip_special_tokens=True).rstrip("\ufffd")
                text = text[: len(text) - holdback] if holdback else text
            delta = text[len(sent_text):] if len(text) > len(sent_text) else ""
            if n == sent_tokens and not delta and not finished:
                continue
            logprobs = None
            if want_logprobs:
                logprobs = (rep.text.chat_logprobs(req, sent_tokens, n) if kind == "chat"
                            else rep.text.completion_logprobs(req, sent_tokens, n, len(sent_text)))
            ids = req.completion_ids[sent_tokens:n] if body.return_token_ids else None
            reason = req.finish_reason if finished else None
            content = {"content": delta} if kind == "chat" else delta
            if hold:
                content, reason = _whole_message(req)
            extra = {"stop_reason": req.stop_reason} if finished else {}
            if kind == "text" and sent_tokens == 0:
                extra.update(prompt_ids)
            yield _sse(_chunk(req, body, kind, created, content, logprobs, ids, reason, extra))
            sent_tokens, sent_text = n, sent_text + delta
        if finished and (body.stream_options or {}).get("include_usage"):
            yield _sse({"id": req.id, "object": _object(kind), "created": created, "model": body.model,
                        "choices": [], "usage": api.usage(req), "meta_info": api.meta(req)})
        yield b"data: [DONE]\n\n"
    finally:
        if not finished:
            rep.counters.client_disconnects += 1
            rep.engine.abort(req.id)


def _whole_message(req: Request) -> tuple[dict[str, Any], str | None]:
    """The delta of a held chat call: its content, and its tool calls indexed as OpenAI streams them."""
    message, reason = api.chat_message(req)
    delta: dict[str, Any] = {"content": message["content"]}
    if message.get("tool_calls"):
        delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(message["tool_calls"])]
    return delta, reason


def _object(kind: str) -> str:
    return "chat.completion.chunk" if kind == "chat" else "text_completion"


def _chunk(req: Request, body: Any, kind: str, created: int, content: Any, logprobs: Any,
           ids: list[int] | None, reason: str | None, extra: dict[str, Any]) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "logprobs": logprobs, "finish_reason": reason}
    if kind == "chat":
        choice["delta"] = content
    else:
        choice["text"] = content
    if ids is not None:
        choice["token_ids"] = ids
    choice.update(extra)
    return {"id": req.id, "object": _object(kind), "created": created, "model": body.model,
            "choices": [choice], "meta_info": api.meta(req)}


def _sse(data: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(data)}\n\n".encode()
