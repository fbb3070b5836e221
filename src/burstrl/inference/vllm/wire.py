"""What the replica sends to vLLM's token-in endpoint and how its answer becomes a call's tokens.

`POST /inference/v1/generate` takes prompt token ids and vLLM's SamplingParams and streams token ids
with their logprobs (SSE). With `--logprobs-mode processed_logprobs` those are the logprobs of the
distribution each token was sampled from (after temperature, penalties, top-k/p): exactly what the
own engine captures, so the trainer's importance ratios mean the same on both engines.
"""

from __future__ import annotations

import json
import math
from collections.abc import AsyncIterator
from typing import Any

from burstrl.inference.request import Request

MAX_EVENT_BYTES = 16 << 20  # one SSE event; a generation's chunk is a few KB


class WireError(RuntimeError):
    """vLLM's answer broke the protocol (malformed event, ids and logprobs that do not pair up)."""


def generate_body(req: Request, lora: str | None, eos_ids: set[int]) -> dict[str, Any]:
    """The request body. EOS ids go in as stop ids unless `ignore_eos`, so both engines end on the same
    ids (`engine.eos_token_ids`, not vLLM's own generation config); `wire.apply` maps them back."""
    p = req.params
    stop_ids = set(p.stop_token_ids) | (set() if p.ignore_eos else eos_ids)
    sampling: dict[str, Any] = {
        "max_tokens": p.max_tokens, "temperature": p.temperature, "top_p": p.top_p, "min_p": p.min_p,
        "seed": p.seed, "stop": list(p.stop), "stop_token_ids": sorted(stop_ids), "ignore_eos": p.ignore_eos,
        "min_tokens": p.min_tokens, "presence_penalty": p.presence_penalty,
        "frequency_penalty": p.frequency_penalty, "repetition_penalty": p.repetition_penalty,
        # vLLM returns the sampled token first, then the top-k: one more so k alternatives remain
        "logprobs": p.top_logprobs + 1 if p.top_logprobs else 0,
        "skip_special_tokens": True,
    }
    if p.top_k > 0:
        sampling["top_k"] = p.top_k
    if p.logit_bias:
        sampling["logit_bias"] = {str(k): v for k, v in p.logit_bias.items()}
    body: dict[str, Any] = {"request_id": req.id, "token_ids": req.prompt_ids, "sampling_params": sampling,
                            "stream": True, "stream_options": {"include_usage": True}}
    if lora is not None:
        body["model"] = lora
    if req.cache_salt is not None:
        body["cache_salt"] = req.cache_salt
    return body


async def sse_events(chunks: AsyncIterator[bytes]) -> AsyncIterator[dict[str, Any]]:
    """Each `data:` event as JSON, until `[DONE]`; WireError past MAX_EVENT_BYTES or on bad JSON."""
    buf = b""
    async for chunk in chunks:
        buf += chunk
        while b"\n\n" in buf:
            event, buf = buf.split(b"\n\n", 1)
            data = b"".join(line[5:].strip() for line in event.split(b"\n") if line.startswith(b"data:"))
            if not data:
                continue
            if data == b"[DONE]":
                return
            try:
                yield json.loads(data)
            except ValueError:
                raise WireError(f"vLLM sent a malformed event: {data[:200]!r}") from None
        if len(buf) > MAX_EVENT_BYTES:
            raise WireError(f"vLLM sent an event over {MAX_EVENT_BYTES} bytes")


def apply(req: Request, event: dict[str, Any], eos_ids: set[int], vocab_size: int) -> int:
    """Add one event's tokens to `req` (ids, logprobs, top-k); returns how many tokens it added."""
    added = 0
    for choice in event.get("choices") or []:
        ids = choice.get("token_ids") or []
        content = (choice.get("logprobs") or {}).get("content") or []
        if len(ids) != len(content):
            raise WireError(f"vLLM sent {len(ids)} token ids with {len(content)} logprobs")
        for token, entry in zip(ids, content, strict=True):
            _append(req, token, entry, vocab_size)
            added += 1
        if choice.get("finish_reason"):
            req.finish_reason = str(choice["finish_reason"])
            stop = choice.get("stop_reason")
            # an EOS id we added as a stop id is an EOS stop, as on the own engine (stop_reason None)
            req.stop_reason = None if stop in eos_ids and stop not in req.params.stop_token_ids else stop
    usage = event.get("usage") or {}
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    if isinstance(cached, int) and cached >= 0:
        req.cached_tokens = cached
    return added


def _append(req: Request, token: Any, entry: dict[str, Any], vocab_size: int) -> None:
    logprob = entry.get("logprob")
    if type(token) is not int or not 0 <= token < vocab_size or entry.get("token_id") != token:
        raise WireError(f"vLLM sent token {token!r} with logprob entry for {entry.get('token_id')!r}")
    if not isinstance(logprob, (int, float)) or math.isnan(logprob) or logprob > 1e-6:
        raise WireError(f"vLLM sent logprob {logprob!r} for token {token}")
    logprob = max(float(logprob), -1e30)  # -inf (a token outside top-k/p) stays representable in JSON
    req.logprobs.append(logprob)
    req.shown_logprobs.append(logprob)  # before completion_ids: streaming readers index by its length
    k = req.params.top_logprobs
    if k:
        top = sorted((e for e in entry.get("top_logprobs") or [] if (e.get("rank") or k + 1) <= k),
                     key=lambda e: e["rank"])
        pairs = [(int(e["token_id"]), float(e["logprob"])) for e in top[:k]]
        req.top_logprobs.append(pairs)
        req.shown_top.append(pairs)
    req.completion_ids.append(token)
