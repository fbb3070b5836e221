"""The HTTP conventions shared by the replica and the router (both OpenAI-compatible servers).

Why here: the router proxies the replicas' API, so both must read a session from the same headers,
accept the same session ids, answer errors and `/v1/models` in the same shape, refuse oversized
bodies the same way and check bearer tokens the same way; each kept its own copy before.
"""

from __future__ import annotations

import functools
import hmac
import re
import ssl
import time
from collections.abc import Mapping
from typing import Any

SESSION_HEADER = "X-Session-ID"  # what our own clients send
SESSION_HEADERS = ("x-session-id", "x-smg-routing-key", "x-dynamo-session-id")  # what servers read
SESSION_ID = re.compile(r"[A-Za-z0-9._:@/-]{1,128}")  # used with fullmatch


def session_id_from(value: Any, headers: Mapping[str, str]) -> str | None:
    """The session of a call: `value` (the body's `session_id`) if a non-empty string, else the
    first session header set, else None. Not validated: callers check it against SESSION_ID."""
    if isinstance(value, str) and value:
        return value
    return next((headers[name] for name in SESSION_HEADERS if headers.get(name)), None)


def error_body(status: int, message: str, kind: str = "invalid_request_error") -> dict[str, Any]:
    """OpenAI's error shape: `{"error": {"message", "type", "param", "code"}}`."""
    return {"error": {"message": message, "type": kind, "param": None, "code": status}}


def models_list(names: list[str], root: str, base: str = "base", roots: dict[str, str] | None = None,
                max_model_len: int | None = None) -> dict[str, Any]:
    """`/v1/models` as vLLM answers it: adapters name the served base model as `parent` and
    their own path as `root`; the base model has no parent and its path as root. `max_model_len`
    (a replica's context length) is vLLM's extension, which verifiers' client reads before it sends."""
    now = int(time.time())
    extra = {} if max_model_len is None else {"max_model_len": max_model_len}
    data = [{"id": n, "object": "model", "created": now, "owned_by": "burstrl",
             "root": (roots or {}).get(n, root), "parent": None if n == base else base, **extra} for n in names]
    return {"object": "list", "data": data}


class BodyTooLarge(ValueError):
    """A request body over the server's limit (answered with a 413)."""


async def read_body(request: Any, limit: int) -> bytes:
    """The body of a Starlette request, refused as soon as it (or its declared length) passes `limit` bytes."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise BodyTooLarge(f"request body over {limit} bytes")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise BodyTooLarge(f"request body over {limit} bytes")
    return bytes(body)


def bearer_matches(headers: Mapping[str, str], *tokens: str) -> bool:
    """Whether `Authorization: Bearer T` names one of `tokens` (compared in constant time).

    An empty token never matches: a role without a token configured accepts nobody.
    """
    scheme, _, given = headers.get("authorization", "").partition(" ")
    return scheme.lower() == "bearer" and any(
        t and hmac.compare_digest(given.encode(), t.encode()) for t in tokens)


@functools.cache
def default_ssl_context() -> ssl.SSLContext:
    """One verifying TLS context for the process's short-lived HTTP clients.

    Why shared: httpx builds a new one (reading the CA bundle, ~25 ms of CPU) for every client or
    transport it makes, and the orchestrator makes one per attempt for an environment's own SDK;
    measured, that was most of the per-episode overhead of the verifiers adapters
    (benchmarks/ecosystem_overhead.py). A context may be shared by clients and threads.
    """
    return ssl.create_default_context()
