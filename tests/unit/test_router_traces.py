"""The router's trace GET/DELETE over a session's homes, against replicas answered in-process
(`httpx.MockTransport`): what a replica says decides what the router does with the other parts."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from burstrl.router.registry import Registry, RouteError
from burstrl.router.traces import forward_trace


def moved_session() -> tuple[Registry, str, str]:
    """A registry whose session `s` moved on overflow from `old` to `new`."""
    reg = Registry(policy="kv", k=2, seed=0)
    for url in ("http://old:1", "http://new:1"):
        reg.add(url)
        reg.apply_scrape(url, {"max_total_num_tokens": 10_000, "versions": ["base"], "sessions": []},
                         {"data": [{"id": "base"}]})
    old = reg.place("s", "base").id
    new = next(u for u in reg.replicas if u != old)
    sessions = [{"session_id": "s", "tokens": 0, "context_tokens": 3000, "busy": False},
                *[{"session_id": f"c{i}", "tokens": 4000} for i in range(3)]]
    reg.apply_scrape(old, {"max_total_num_tokens": 10_000, "versions": ["base"], "sessions": sessions},
                     {"data": [{"id": "base"}]})
    assert reg.place("s", "base").id == new and reg.trace_homes("s") == [old, new]
    return reg, old, new


def forward(reg: Registry, method: str, answers: dict[tuple[str, str], httpx.Response], seen: list) -> httpx.Response:
    def handler(request: httpx.Request) -> httpx.Response:
        key = (request.method, f"{request.url.scheme}://{request.url.host}:{request.url.port}")
        seen.append(key)
        return answers[key]

    async def go() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            try:
                r = await forward_trace(reg, asyncio.Lock(), client, method, "s", {}, deadline=30)
            except RouteError as err:
                return httpx.Response(err.status, json={"error": err.message})
            return httpx.Response(r.status_code, content=r.body)

    return asyncio.run(go())


def trace(*calls: int) -> httpx.Response:
    return httpx.Response(200, json={"session_id": "s", "busy": False, "calls": [{"n": c} for c in calls]})


def test_get_concatenates_the_parts_in_order_and_a_gone_part_is_an_error() -> None:
    reg, old, new = moved_session()
    got = forward(reg, "GET", {("GET", old): trace(1, 2), ("GET", new): trace(3)}, [])
    assert got.status_code == 200 and [c["n"] for c in got.json()["calls"]] == [1, 2, 3]
    assert got.json()["replicas"] == [old, new] and got.json()["replica"] == new
    missing = forward(reg, "GET", {("GET", old): httpx.Response(404, json={}), ("GET", new): trace(3)}, [])
    assert missing.status_code == 502 and old in missing.json()["error"]
    garbled = forward(reg, "GET", {("GET", old): httpx.Response(200, json={"calls": "x"}), ("GET", new): trace(3)}, [])
    assert garbled.status_code == 502


def test_a_refused_release_at_the_home_leaves_every_part_in_place() -> None:
    reg, old, new = moved_session()
    seen: list = []
    busy = httpx.Response(409, json={"error": {"message": "session 's' has a call running"}})
    refused = forward(reg, "DELETE", {("DELETE", new): busy}, seen)
    assert refused.status_code == 409 and seen == [("DELETE", new)]  # the old part was not touched
    assert reg.trace_homes("s") == [old, new]  # and the router still knows where they are
    seen.clear()
    released = forward(reg, "DELETE", {("DELETE", new): httpx.Response(200, json={"released": True}),
                                       ("DELETE", old): httpx.Response(404, json={})}, seen)
    assert released.status_code == 200 and json.loads(released.content)["replicas"] == [old, new]
    assert seen == [("DELETE", new), ("DELETE", old)] and "s" not in reg.homes


def test_a_sample_of_an_n_call_continues_where_its_group_lives() -> None:
    """`<sid>/i` (sample i of a call with n > 1, a session of its own on the replica) goes where
    `<sid>` was placed, pinned to its version; a plain `/`-named session is placed as any other."""
    reg = Registry(policy="kv", k=2, seed=0)
    for url in ("http://a:1", "http://b:1", "http://c:1"):
        reg.add(url)
        reg.apply_scrape(url, {"max_total_num_tokens": 10_000, "versions": ["base", "policy-v1"], "sessions": []},
                         {"data": [{"id": "base"}, {"id": "policy-v1"}]})
    home = reg.place("g", reg.resolve("g", "policy-v1")).id
    for i in range(8):
        assert reg.resolve(f"g/{i}", None) == "policy-v1"  # `latest` is the group's pinned version
        assert reg.place(f"g/{i}", "policy-v1").id == home
        assert reg.trace_homes(f"g/{i}") == [home]
    with pytest.raises(RouteError) as err:
        reg.resolve("g/3", "base")
    assert err.value.status == 409
    placed = {reg.place(f"other/x{i}", "base").id for i in range(12)}  # not a sample: placed by the policy
    assert len(placed) > 1
