"""What every replica route shares: its error type, body reading and parsing, and its checks.

Why a module of its own: the generation routes (`server`), the adapter routes (`admin_routes`) and
the app's error handlers all need them; here they depend on nothing but the replica, so the route
modules import them instead of `server.py` passing its helpers around. A route finds its replica
on `request.app.state.replica` (set by `server.build_app`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from fastapi import Request
from pydantic import BaseModel, ValidationError

from burstrl.inference import openai_api as api
from burstrl.inference.limits import RequestLimits, check_json_size
from burstrl.inference.replica import InferenceReplica
from burstrl.protocol.http import BodyTooLarge, bearer_matches, read_body


class ApiError(Exception):
    """An error answered in OpenAI's shape with `status` (a 4xx for the caller's mistakes)."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind


def replica_of(request: Request) -> InferenceReplica:
    """The replica this app serves."""
    return request.app.state.replica


def require_admin(rep: InferenceReplica, request: Request) -> None:
    if not bearer_matches(request.headers, rep.admin_token):
        raise ApiError(401, "admin endpoint: missing or wrong bearer token", "authentication_error")


def is_reader(rep: InferenceReplica, request: Request) -> bool:
    """Whether the caller may read traces and session loads: the admin or the cluster token."""
    return bearer_matches(request.headers, rep.admin_token, rep.cluster_token)


def require_reader(rep: InferenceReplica, request: Request) -> None:
    if not is_reader(rep, request):
        raise ApiError(401, "traces need the admin or cluster bearer token", "authentication_error")


def require_engine(rep: InferenceReplica) -> None:
    """A replica whose engine died must leave rotation: its health and load endpoints fail."""
    if not rep.engine.alive:
        raise ApiError(503, f"engine is not running: {rep.engine.error or 'stopped'}", "server_error")


async def read_json(request: Request, limit: int) -> Any:
    """The body as JSON: 413 past `limit` bytes, 400 if malformed, too deep or not valid Unicode."""
    body = await read_limited(request, limit)
    with _as_api_errors(api.MAX_JSON_DEPTH):
        data = json.loads(body)
        api.check_json(data)
    return data


def decode_request(raw: bytes, limits: RequestLimits, check: Callable[[dict[str, Any], RequestLimits], None]) -> Any:
    """A generation request's body as JSON, each size checked before the work it bounds.

    Runs on a request worker (`inference.workers`): JSON values counted on the raw bytes before
    `json.loads` builds them, then `check` (`limits.check_chat`/`check_completion`) on the parsed
    body before its strings and lists are walked (`check_json`), validated or tokenized. Every
    failure is a 400 naming what failed; the result still goes through `parse`.
    """
    with _as_api_errors(limits.max_json_depth):
        check_json_size(raw, limits)
        data = json.loads(raw)
        if isinstance(data, dict):
            check(data, limits)
        api.check_json(data, limits.max_json_depth)
    return data


@contextmanager
def _as_api_errors(max_depth: int) -> Iterator[None]:
    """Errors of reading a JSON body as the caller's 400s."""
    try:
        yield
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"malformed JSON body: {exc}") from None
    except RecursionError:
        raise ApiError(400, f"JSON nested deeper than {max_depth} levels") from None
    except ValueError as exc:  # a limit (LimitError), check_json's depth or surrogate
        raise ApiError(400, str(exc)) from None


async def read_limited(request: Request, limit: int) -> bytes:
    """The raw body, a 413 past `limit` bytes."""
    try:
        return await read_body(request, limit)
    except BodyTooLarge as exc:
        raise ApiError(413, str(exc)) from None


def parse(cls: type[BaseModel], data: Any) -> Any:
    """`data` validated as `cls`; fields we know but do not implement are a 400 naming them."""
    if not isinstance(data, dict):
        raise ApiError(400, "request body must be a JSON object")
    bad = api.unsupported_fields(data, getattr(cls, "IMPLEMENTED", frozenset()))
    if bad:
        raise ApiError(400, f"not supported by this server: {', '.join(bad)} (see the README's "
                            "vLLM compatibility table)")
    try:
        return cls.model_validate(data)
    except ValidationError as exc:
        raise ApiError(400, first_error(exc.errors())) from None


def first_error(errors: Any) -> str:
    """`loc: msg` of the first of pydantic's validation errors."""
    err = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    key = ".".join(str(p) for p in err.get("loc", ()))
    return f"{key}: {err.get('msg', 'invalid')}"
