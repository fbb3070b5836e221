"""OpenAI request parsing and response shapes, with vLLM/SGLang's token extensions.

Unknown request fields are ignored (as vLLM does), so any OpenAI client works unchanged; every
optional field we read accepts an explicit `null` (= its default), and a bad value is a 400 naming
it. A field we know but do not implement (beam search, structured output, ...) is a 400 when
set to anything but its no-op value: accepting and ignoring it would silently change what the
client asked for. Chat serves OpenAI tool calling (`tools`, `tool_choice` "auto"/"none",
`parallel_tool_calls`; `inference.tools`), completions refuse it. Extensions: request
`return_token_ids`, `session_id`, `top_k`, `min_p`, `ignore_eos`, `input_ids`, `min_tokens`,
`stop_token_ids`, `repetition_penalty`, `cache_salt`; response `choices[].token_ids`,
`prompt_token_ids`, `choices[].stop_reason`, `usage.prompt_tokens_details.cached_tokens`,
`meta_info.weight_version`.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, StrictInt

from burstrl.inference.tools import assistant_message
from burstrl.protocol.tenants import local

# A token id is an int on the wire, never a string, a bool or a float that pydantic's lax mode would
# turn into one (`["5", true, 7.0]` was accepted as [5, 1, 7]): what the client sent is what is sampled.
TokenId = StrictInt

if TYPE_CHECKING:  # parsing and shapes need no torch; only the replica's engine does
    from burstrl.inference.engine import Request
    from burstrl.inference.sampling import SamplingParams

MAX_JSON_DEPTH = 64
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's and vLLM's default for /v1/completions


def _none_or(*allowed: Any) -> Callable[[Any], bool]:
    return lambda v: v is None or v in allowed


def _text_format(v: Any) -> bool:
    return v is None or (isinstance(v, dict) and v.get("type") == "text")


# Known fields that change the output and are not implemented: 400 unless at their no-op value.
UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    "best_of": _none_or(1), "use_beam_search": _none_or(False), "length_penalty": _none_or(1, 1.0),
    "response_format": _text_format, "tools": _none_or([]), "tool_choice": _none_or("none"),
    "functions": _none_or([]), "function_call": _none_or("none"), "guided_json": _none_or(),
    "guided_regex": _none_or(), "guided_choice": _none_or(), "guided_grammar": _none_or(),
    "structured_outputs": _none_or(), "prompt_logprobs": _none_or(), "suffix": _none_or(""),
    "include_stop_str_in_output": _none_or(False), "skip_special_tokens": _none_or(True),
    "truncate_prompt_tokens": _none_or(), "allowed_token_ids": _none_or(), "bad_words": _none_or([]),
    "logits_processors": _none_or(), "echo": _none_or(False), "continue_final_message": _none_or(False),
    "add_generation_prompt": _none_or(True), "chat_template": _none_or(), "chat_template_kwargs": _none_or({}),
    "documents": _none_or(), "audio": _none_or(), "modalities": _none_or(["text"]), "prediction": _none_or(),
}


def unsupported_fields(body: dict[str, Any], implemented: frozenset[str] = frozenset()) -> list[str]:
    """Fields of `body` set to something this server would otherwise silently ignore; `implemented`
    names the ones the endpoint serves (chat: tools)."""
    return [k for k, ok in UNSUPPORTED.items() if k in body and k not in implemented and not ok(body[k])]


class SamplingFields(BaseModel):
    """The sampling options every generation endpoint takes, vLLM's names and meanings (OpenAI's
    completions and chat bodies carry them at the top level, the token-in generate endpoint in
    `sampling_params`); `sampling_params()` maps them to the engine's."""

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    n: int | None = None
    ignore_eos: bool | None = None
    min_tokens: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None


class _Common(SamplingFields):
    model_config = ConfigDict(extra="ignore")
    IMPLEMENTED: ClassVar[frozenset[str]] = frozenset()  # UNSUPPORTED fields this endpoint serves

    model: str
    stream: bool | None = None
    stream_options: dict[str, Any] | None = None
    return_token_ids: bool | None = None
    session_id: str | None = None
    # vLLM's field: prefix sharing (and the router's prefix index) only between requests of the same salt
    cache_salt: str | None = Field(None, min_length=1, max_length=256)


class ChatRequest(_Common):
    IMPLEMENTED: ClassVar[frozenset[str]] = frozenset({"tools", "tool_choice"})

    messages: list[dict[str, Any]]
    tools: Any = None  # checked by tools.tool_spec, whose errors name the field
    tool_choice: Any = None
    parallel_tool_calls: Any = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None


class CompletionRequest(_Common):
    prompt: str | list[TokenId] | list[str] | list[list[TokenId]] | None = None
    input_ids: list[TokenId] | None = None
    logprobs: int | None = None
    # vLLM's extension and default: a text prompt gets the tokenizer's special tokens (Gemma's <bos>;
    # without it Gemma 3 answers "\nAnswer:\nAnswer:" to a question). Token-id prompts are used as given.
    add_special_tokens: bool = True


def check_json(value: Any, max_depth: int = MAX_JSON_DEPTH) -> None:
    """Refuse JSON no handler should see: nesting past `max_depth`, strings that are not valid
    Unicode (a lone surrogate such as "\\ud800" is legal JSON but breaks every tokenizer)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > max_depth:
            raise ValueError(f"JSON nested deeper than {max_depth} levels")
        if isinstance(item, str):
            _check_text(item)
        elif isinstance(item, dict):
            for k, v in item.items():
                _check_text(k)
                stack.append((v, depth + 1))
        elif isinstance(item, list):
            stack.extend((v, depth + 1) for v in item)


def _check_text(text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("strings must be valid Unicode (lone surrogate found)") from None


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def sampling_params(req: _Common, max_tokens: int, top_logprobs: int, vocab_size: int) -> SamplingParams:
    """The engine's parameters for a parsed request; ValueError (a 400) names a bad value."""
    from burstrl.inference.sampling import SamplingParams

    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    bias = {}
    for key, value in (req.logit_bias or {}).items():
        if not key.lstrip("-").isdigit() or len(key) > 12:
            raise ValueError(f"logit_bias keys must be token ids, got {key[:20]!r}")
        bias[int(key)] = value
    params = SamplingParams(
        max_tokens=max_tokens, temperature=_or(req.temperature, 1.0), top_p=_or(req.top_p, 1.0),
        top_k=_or(req.top_k, 0), min_p=_or(req.min_p, 0.0), seed=req.seed, stop=stop,
        stop_token_ids=list(req.stop_token_ids or []), top_logprobs=top_logprobs,
        ignore_eos=bool(req.ignore_eos), min_tokens=_or(req.min_tokens, 0),
        presence_penalty=_or(req.presence_penalty, 0.0), frequency_penalty=_or(req.frequency_penalty, 0.0),
        repetition_penalty=_or(req.repetition_penalty, 1.0), logit_bias=bias)
    params.validate(vocab_size)
    return params


def _or(value: Any, default: Any) -> Any:
    return default if value is None else value


def json_logprob(logprob: float) -> float:
    """-inf (a token masked by top-k/top-p) is not JSON: report -9999.0 as vLLM does."""
    return max(logprob, -9999.0)


class TokenText:
    """Token ids -> text pieces for logprobs entries."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def piece(self, token: int) -> str:
        return self.tokenizer.decode([token], skip_special_tokens=False)

    def entry(self, token: int, logprob: float) -> dict[str, Any]:
        text = self.piece(token)
        return {"token": text, "logprob": json_logprob(logprob), "bytes": list(text.encode("utf-8"))}

    def chat_logprobs(self, req: Request, start: int, end: int) -> dict[str, Any]:
        content = []
        for i in range(start, end):
            item = self.entry(req.completion_ids[i], req.shown_logprobs[i])
            item["top_logprobs"] = ([self.entry(t, lp) for t, lp in req.shown_top[i]]
                                    if req.shown_top else [])
            content.append(item)
        return {"content": content}

    def completion_logprobs(self, req: Request, start: int, end: int, offset: int) -> dict[str, Any]:
        tokens, lps, tops, offsets = [], [], [], []
        for i in range(start, end):
            text = self.piece(req.completion_ids[i])
            tokens.append(text)
            lps.append(json_logprob(req.shown_logprobs[i]))
            tops.append({self.piece(t): json_logprob(lp) for t, lp in req.shown_top[i]} if req.shown_top else None)
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def usage(req: Request) -> dict[str, Any]:
    n_prompt, n_out = len(req.prompt_ids), len(req.completion_ids)
    return {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out,
            "prompt_tokens_details": {"cached_tokens": req.cached_tokens}}


def meta(req: Request) -> dict[str, Any]:
    """burstrl's `meta_info`, in the client's names (a tenant's session and version without its prefix)."""
    session = None if req.session.ephemeral else local(req.session.id)
    return {"weight_version": local(req.version), "session_id": session, "cached_tokens": req.cached_tokens}


def chat_message(req: Request) -> tuple[dict[str, Any], str | None]:
    """The assistant message returned for a finished chat call (its tool calls parsed out when it
    had tools) and its finish reason: "tool_calls" when a call parsed, as vLLM and OpenAI answer."""
    if req.text is None:
        return {"role": "assistant", "content": None}, req.finish_reason
    message = assistant_message(req.text, req.tools)
    return message, "tool_calls" if message.get("tool_calls") else req.finish_reason


def chat_response(req: Request, model: str, want_ids: bool, want_logprobs: bool, text: TokenText) -> dict[str, Any]:
    message, finish_reason = chat_message(req)
    choice: dict[str, Any] = {
        "index": 0,
        "message": message,
        "finish_reason": finish_reason,
        "stop_reason": req.stop_reason,
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
        "index": 0, "text": req.text, "finish_reason": req.finish_reason, "stop_reason": req.stop_reason,
        "logprobs": text.completion_logprobs(req, 0, len(req.completion_ids), 0) if want_logprobs else None,
    }
    body = {"id": req.id, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [choice], "usage": usage(req), "meta_info": meta(req)}
    if want_ids:
        choice["token_ids"] = list(req.completion_ids)
        choice["prompt_token_ids"] = list(req.prompt_ids)
        body["prompt_token_ids"] = list(req.prompt_ids)
    return body
