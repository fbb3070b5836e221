"""vLLM's token-in/token-out endpoint, `POST /inference/v1/generate`, as verifiers' train client calls it.

Why: verifiers (v1 `TrainClient`, through `renderers.client.generate`) renders prompts itself and
sends token ids, `{model, token_ids, sampling_params, cache_salt?}` with the session in an
`X-Session-ID` header, and reads `{request_id, choices: [{token_ids, logprobs: {content: [{token,
logprob}]}, finish_reason}]}` back (plus `usage` when present). It checks every logprob entry's
`token` to be `"token_id:<id>"` of the sampled id (vLLM's `return_tokens_as_token_ids`) and refuses
a logprob of -9999.0 (vLLM's "no evidence" clamp), so entries carry exactly that.

The call is a completions call with a token-id prompt: `to_completion` turns it into the
`openai_api.CompletionRequest` the replica's `/v1/completions` path runs (`server._generate`), so
sessions, the continuity check, `cache_salt` scoping, capture, adapter and version resolution,
limits and errors are the same code, not a copy.

`sampling_params` is strict where `/v1/completions` ignores unknown fields: an unknown key, or a
known one this server does not implement set to anything but its no-op value, is a 400 naming the
key. Silently ignoring a key would sample from another distribution than the trainer believes
(its importance ratios would be wrong without any error). Keys that only shape text or outputs this
endpoint never returns (`skip_special_tokens`, `detokenize`, `routed_experts_prompt_start`, ...)
are accepted at any value: the client sets `skip_special_tokens=false` on every call.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from burstrl.inference import openai_api as api
from burstrl.inference.api_common import ApiError, first_error
from burstrl.inference.limits import RequestLimits, check_common, check_prompt

if TYPE_CHECKING:
    from burstrl.inference.engine import Request

PATH = "/inference/v1/generate"
MAX_LOGPROBS = 20  # the engine's top_logprobs bound


def _none_or(*allowed: Any) -> Callable[[Any], bool]:
    return lambda v: v is None or v in allowed


# vLLM SamplingParams keys that change what is sampled or returned and are not implemented here:
# accepted only at their no-op value.
NOOP_SAMPLING: dict[str, Callable[[Any], bool]] = {
    "best_of": _none_or(1), "prompt_logprobs": _none_or(), "flat_logprobs": _none_or(False),
    "include_stop_str_in_output": _none_or(False), "structured_outputs": _none_or(),
    "guided_decoding": _none_or(), "allowed_token_ids": _none_or(), "bad_words": _none_or([]),
    "logits_processors": _none_or(), "truncate_prompt_tokens": _none_or(), "extra_args": _none_or({}),
    "output_kind": _none_or(), "skip_reading_prefix_cache": _none_or(False),
}
# Top-level fields of vLLM's GenerateRequest that this endpoint does not implement.
NOOP_FIELDS: dict[str, Callable[[Any], bool]] = {
    "stream": _none_or(False), "stream_options": _none_or(), "features": _none_or(),
    "content_parts": _none_or([]), "priority": _none_or(0), "kv_transfer_params": _none_or(),
    "request_id": _none_or(),  # the replica names its calls (the id the trace records)
}


class GenerateSampling(api.SamplingFields):
    """The `sampling_params` keys served (mapped as /v1/completions maps them; an absent max_tokens
    is the rest of the context, as vLLM's server defaults it)."""

    model_config = ConfigDict(extra="forbid")

    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # top alternatives besides the sampled token
    # No effect on what is sampled or returned here (no text, no routed experts): any value.
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    detokenize: bool | None = None
    routed_experts_prompt_start: int | None = None


SERVED = tuple(GenerateSampling.model_fields)
TEXT_ONLY = ("skip_special_tokens", "spaces_between_special_tokens", "detokenize", "routed_experts_prompt_start")


class GenerateRequest(BaseModel):
    """The body: vLLM's `GenerateRequest` fields that verifiers sends, plus burstrl's `session_id`."""

    model_config = ConfigDict(extra="ignore")  # as vLLM and /v1/completions: unknown top-level fields pass

    model: str
    token_ids: list[api.TokenId]
    sampling_params: GenerateSampling = Field(default_factory=GenerateSampling)
    cache_salt: str | None = Field(None, min_length=1, max_length=256)
    session_id: str | None = None  # else the X-Session-ID (or another session) header
    return_token_ids: bool | None = None  # completion ids are always returned


def check_generate(data: dict[str, Any], limits: RequestLimits) -> None:
    """Sizes of a generate body (parsed JSON, not yet validated), as `limits.check_completion`'s."""
    check_common(data, limits)
    sampling = data.get("sampling_params")
    if isinstance(sampling, dict):
        check_common(sampling, limits)
    check_prompt("token_ids", data.get("token_ids"), limits)


def parse_generate(data: dict[str, Any]) -> GenerateRequest:
    """The validated body; 400s name the field (`sampling_params.<key>` for sampling keys)."""
    _refuse(data, NOOP_FIELDS, "")
    misplaced = [k for k in data if k in SERVED or k in NOOP_SAMPLING]
    if misplaced:  # vLLM would ignore it: the call would sample with the default instead
        raise ApiError(400, f"{misplaced[0]} belongs in sampling_params on {PATH}")
    try:
        body = GenerateRequest.model_validate({**data, "sampling_params": _served_sampling(data)})
    except ValidationError as exc:
        raise ApiError(400, first_error(exc.errors())) from None
    if not body.token_ids:
        raise ApiError(400, "token_ids must hold at least one token id")
    return body


def _served_sampling(data: dict[str, Any]) -> dict[str, Any]:
    """`sampling_params` less its no-op keys; a 400 naming any key not served or not at its no-op value."""
    sampling = data.get("sampling_params")
    if sampling is None:
        return {}
    if not isinstance(sampling, dict):
        raise ApiError(400, "sampling_params must be a JSON object")
    unknown = [k for k in sampling if k not in SERVED and k not in NOOP_SAMPLING]
    if unknown:
        raise ApiError(400, f"sampling_params.{unknown[0]} is not supported by this server; served keys: "
                            f"{', '.join(SERVED)}")
    _refuse(sampling, NOOP_SAMPLING, "sampling_params.")
    return {k: v for k, v in sampling.items() if k in SERVED}


def _refuse(data: dict[str, Any], noop: dict[str, Callable[[Any], bool]], prefix: str) -> None:
    bad = [k for k, ok in noop.items() if k in data and not ok(data[k])]
    if bad:
        raise ApiError(400, f"{prefix}{bad[0]} is not supported by this server on {PATH} (only its default)")


def to_completion(body: GenerateRequest) -> api.CompletionRequest:
    """The /v1/completions request this call is: its token ids as `input_ids`, its sampling keys flat."""
    sampling = body.sampling_params.model_dump(exclude_none=True, exclude=set(TEXT_ONLY))
    try:
        return api.CompletionRequest.model_validate({
            **sampling, "model": body.model, "input_ids": body.token_ids, "cache_salt": body.cache_salt,
            "session_id": body.session_id, "return_token_ids": True, "add_special_tokens": False})
    except ValidationError as exc:  # unreachable for a validated body; a 400 all the same
        raise ApiError(400, first_error(exc.errors())) from None


def generate_response(req: Request, model: str, want_ids: bool, want_logprobs: bool,
                      text: api.TokenText) -> dict[str, Any]:
    """vLLM's `GenerateResponse` for a finished call, plus `usage` and `meta_info` as /v1/completions has.

    `want_ids` and `text` are unused (the ids are always returned, no text is): the signature is the
    one `server._generate` gives every response builder.
    """
    choice = {"index": 0, "token_ids": list(req.completion_ids), "finish_reason": req.finish_reason,
              "stop_reason": req.stop_reason, "logprobs": _logprobs(req) if want_logprobs else None}
    return {"request_id": req.id, "model": model, "choices": [choice], "prompt_logprobs": None,
            "usage": api.usage(req), "meta_info": api.meta(req)}


def _logprobs(req: Request) -> dict[str, Any]:
    """`{content: [{token: "token_id:<id>", logprob, top_logprobs}]}`, as vLLM's with token ids as tokens."""
    content = []
    for i, token in enumerate(req.completion_ids):
        top = req.shown_top[i] if req.shown_top else []
        content.append({"token": f"token_id:{token}", "logprob": api.json_logprob(req.shown_logprobs[i]),
                        "top_logprobs": [{"token": f"token_id:{t}", "logprob": api.json_logprob(lp)}
                                         for t, lp in top]})
    return {"content": content}
