"""A session's capture through the router: GET or DELETE it on every replica that holds part of it.

Why more than one: a session the default policy moved off an overflowing home (`Registry.place`)
left the capture of its earlier calls there, and the trainer needs every call exactly as the
replica that served it recorded it. The router lists the session's homes in the order it lived
on them (never the same replica twice), so the concatenation of their captures is the session's.
A part that is gone (its replica died, or it was released) makes the GET fail, never return a
trace with calls missing in the middle; the orchestrator then re-runs the attempt.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
from fastapi.responses import Response

from burstrl.deadline import CallFailed, Reply, afetch
from burstrl.router.registry import Registry, RouteError


async def forward_trace(registry: Registry, lock: asyncio.Lock, client: httpx.AsyncClient, method: str,
                        session_id: str, request_headers: dict[str, str], deadline: float,
                        full: bool = False, key: str | None = None) -> Response:
    """Forward GET/DELETE of a session's trace to its replicas (each checks the token itself).

    `session_id` is the name the caller and its replicas know; `key` the registry's (a tenant's
    `<tenant>~<sid>`, `router.tenancy`; default `session_id`).

    `lock` is the router's: the registry is read and changed under it, never across I/O. Each replica's
    answer comes whole within `deadline` seconds (`burstrl.deadline.afetch`) or the call fails: a replica
    gone (no connection, or one that broke) is dropped with a 503, one too slow is a 504.

    A trace answered through the router carries `replica` (the home's URL) and `replicas` (every
    replica that recorded part of it, in order). A successful DELETE also drops the session from
    the router's maps; the parts left on earlier homes are released only after the home's release
    succeeded, best effort (a failure there only costs that replica memory until its session TTL)
    and counted. `full` asks each replica for whole prompts instead of deltas (`inference.capture`);
    either way each part's first record has no prefix, so the parts concatenate.
    """
    key = session_id if key is None else key
    async with lock:
        urls = registry.trace_homes(key)

    async def request(url: str) -> Reply:
        try:
            return await afetch(client, method, f"{url}/v1/traces/{session_id}", deadline=deadline,
                                headers=request_headers, params={"full": "true"} if full else None)
        except CallFailed as exc:
            if exc.timed_out:
                raise RouteError(504, f"replica {url} timed out: {exc.reason}", "server_error") from None
            if exc.kind not in ("refused", "broken"):
                raise RouteError(502, f"replica {url}: {exc.reason}", "server_error") from None
            async with lock:
                registry.mark_dead(url)
            raise RouteError(503, f"session {session_id!r}: replica {url} failed ({exc.reason})",
                             "server_error") from None

    home = urls[-1]
    if method == "DELETE":  # the home first: a refused release (a call running) must leave every part in place
        answer = await request(home)
        if answer.status != 200:
            return Response(answer.body, status_code=answer.status, media_type="application/json")
        data = {**_json(home, answer), "replica": home, "replicas": urls}
        for url in urls[:-1]:
            try:
                await request(url)
            except RouteError:
                registry.counters.trace_release_failures += 1
        async with lock:
            registry.forget(key)
        return _answer(data)
    answers = [await request(url) for url in urls]
    if answers[-1].status != 200:
        return Response(answers[-1].body, status_code=answers[-1].status, media_type="application/json")
    for url, answer in zip(urls[:-1], answers[:-1], strict=True):
        if answer.status != 200:
            raise RouteError(502, f"session {session_id!r}: the part of its capture on {url} is gone "
                                  f"({answer.status})", "server_error")
    parts = [_json(url, answer) for url, answer in zip(urls, answers, strict=True)]
    data = {**parts[-1], "replica": home, "replicas": urls}
    if len(parts) > 1:
        if not all(isinstance(part.get("calls"), list) for part in parts):
            raise RouteError(502, f"session {session_id!r}: a replica answered a trace without a list of calls",
                             "server_error")
        data["calls"] = [call for part in parts for call in part["calls"]]
        data["busy"] = any(bool(part.get("busy")) for part in parts)
        data.update(_merged_counts(parts))
    return _answer(data)


COUNTS = ("stored_tokens", "diverged_calls", "dropped_calls", "dropped_tokens")


def _merged_counts(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """The capture summary of a session recorded in parts: counts summed, the first drop's reason."""
    out: dict[str, Any] = {}
    for key in COUNTS:
        values = [part.get(key) or 0 for part in parts]
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
            raise RouteError(502, f"a replica answered a trace with a bad {key}", "server_error")
        out[key] = sum(values)
    out["dropped_reason"] = next((p.get("dropped_reason") for p in parts if p.get("dropped_reason")), None)
    return out


def _answer(data: dict[str, Any]) -> Response:
    return Response(json.dumps(data).encode(), status_code=200, media_type="application/json")


def _json(url: str, answer: Reply) -> dict[str, Any]:
    try:
        data = answer.json()
    except ValueError:
        raise RouteError(502, f"replica {url} answered a trace that is not JSON", "server_error") from None
    if not isinstance(data, dict):
        raise RouteError(502, f"replica {url} answered a trace that is not a JSON object", "server_error")
    return data
