"""OpenAI request parsing and response shapes, with vLLM/SGLang's token extensions.

Unknown request fields are ignored (as vLLM does), so any OpenAI client works unchanged; fields we
read are validated and a bad value is a 400 naming it. Extensions: request `return_token_ids`,
`session_id`, `top_k`, `ignore_eos`, `input_ids`; response `choices[].token_ids`,
`prompt_token_ids`, `usage.prompt_tokens_details.cached_tokens`, `meta_info.weight_version`.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from pydantic import BaseModel, ConfigDict

from burstrl.inference.engine import Request
from burstrl.inference.sampling import SamplingParams

SESSION_HEADERS = ("x-session-id", "x-smg-routing-key", "x-dynamo-session-id")


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    n: int = 1
    return_token_ids: bool = False
    session_id: str | None = None
    ignore_eos: bool = False


class ChatRequest(_Common):
    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


class CompletionRequest(_Common):
    prompt: str | list[int] | None = None
    input_ids: list[int] | None = None
    logprobs: int | None = None
    echo: bool = False
    max_tokens: int | None = 16


class BodyTooLarge(ValueError):
    """A request body over the server's limit (answered with a 413)."""


async def read_body(request: Any, limit: int) -> bytes:
    """The request body, refused as soon as it (or its declared length) passes `limit` bytes."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise BodyTooLarge(f"request body over {limit} bytes")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise BodyTooLarge(f"request body over {limit} bytes")
    return bytes(body)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def sampling_params(req: _Common, max_tokens: int, top_logprobs: int) -> SamplingParams:
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    params = SamplingParams(max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p,
                            top_k=req.top_k, seed=req.seed, stop=stop, top_logprobs=top_logprobs,
                            ignore_eos=req.ignore_eos)
    params.validate()
    return params


def error_body(status: int, message: str, kind: str = "invalid_request_error") -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": None, "code": status}}


class TokenText:
    """Token ids -> text pieces for logprobs entries."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def piece(self, token: int) -> str:
        return self.tokenizer.decode([token], skip_special_tokens=False)

    def entry(self, token: int, logprob: float) -> dict[str, Any]:
        text = self.piece(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    def chat_logprobs(self, req: Request, start: int, end: int) -> dict[str, Any]:
        content = []
        for i in range(start, end):
            item = self.entry(req.completion_ids[i], req.logprobs[i])
            item["top_logprobs"] = ([self.entry(t, lp) for t, lp in req.top_logprobs[i]]
                                    if req.top_logprobs else [])
            content.append(item)
        return {"content": content}

    def completion_logprobs(self, req: Request, start: int, end: int, offset: int) -> dict[str, Any]:
        tokens, lps, tops, offsets = [], [], [], []
        for i in range(start, end):
            text = self.piece(req.completion_ids[i])
            tokens.append(text)
            lps.append(req.logprobs[i])
            tops.append({self.piece(t): lp for t, lp in req.top_logprobs[i]} if req.top_logprobs else None)
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def usage(req: Request) -> dict[str, Any]:
    n_prompt, n_out = len(req.prompt_ids), len(req.completion_ids)
    return {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out,
            "prompt_tokens_details": {"cached_tokens": req.cached_tokens}}


def meta(req: Request) -> dict[str, Any]:
    session = None if req.session.ephemeral else req.session.id
    return {"weight_version": req.version, "session_id": session, "cached_tokens": req.cached_tokens}


def chat_response(req: Request, model: str, want_ids: bool, want_logprobs: bool, text: TokenText) -> dict[str, Any]:
    choice: dict[str, Any] = {
        "index": 0,
        "message": {"role": "assistant", "content": req.text},
        "finish_reason": req.finish_reason,
        "logprobs": text.chat_logprobs(req, 0, len(req.completion_ids)) if want_logprobs else None,
    }
    body = {"id": req.id, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [choice], "usage": usage(req), "meta_info": meta(req)}
    if want_ids:
        choice["token_ids"] = list(req.completion_ids)
        choice["prompt_token_ids"] = list(req.prompt_ids)
        body["prompt_token_ids"] = list(req.prompt_ids)
    return body


def completion_response(req: Request, model: str, want_ids: bool, want_logprobs: bool, text: TokenText) -> dict[str, Any]:
    choice: dict[str, Any] = {
        "index": 0, "text": req.text, "finish_reason": req.finish_reason,
        "logprobs": text.completion_logprobs(req, 0, len(req.completion_ids), 0) if want_logprobs else None,
    }
    body = {"id": req.id, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [choice], "usage": usage(req), "meta_info": meta(req)}
    if want_ids:
        choice["token_ids"] = list(req.completion_ids)
        choice["prompt_token_ids"] = list(req.prompt_ids)
        body["prompt_token_ids"] = list(req.prompt_ids)
    return body


def models_list(names: list[str], root: str) -> dict[str, Any]:
    now = int(time.time())
    data = [{"id": n, "object": "model", "created": now, "owned_by": "burstrl",
             "root": root, "parent": None if n == "base" else "base"} for n in names]
    return {"object": "list", "data": data}

