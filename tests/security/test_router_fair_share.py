"""A tenant's flood of sessions cannot push another tenant below its share (issue 51, fair shares).

A real router process with tenancy and admission on (`--max_sessions_per_replica 2` in front of two
stand-in replicas: 4 session places) and tenants `run-a` (weight 1, at most 10 sessions) and `run-b`
(weight 3). Sessions are opened by a first call through the router and released by a trace DELETE
through it, as a harness does. The honest control (`run-c` alone takes every place) shows the places
are real and not reserved, so the flood test cannot pass because nothing was admitted at all.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from burstrl.protocol import process
from burstrl.protocol.process import RoleProcess
from burstrl.protocol.tenants import tenant_token
from burstrl.router.standin import StandInReplica
from tests.http_client import HTTP

KEY = "router-fair-share-key"
CLUSTER = "router-fair-share-cluster"
A, B, C = (tenant_token(KEY, name) for name in ("run-a", "run-b", "run-c"))
PLACES = 4  # 2 per replica x 2 replicas
TENANTS = {"run-a": {"max_sessions": 10}, "run-b": {"weight": 3}}


@contextlib.contextmanager
def tenant_router(work: Path, replicas: list[StandInReplica], *args: str) -> Iterator[RoleProcess]:
    """A router with the tenant key in front of `replicas` (stand-ins), stopped with them."""
    proc = None
    try:
        proc = process.start_router(work, "--cluster_token", CLUSTER, "--tenant_key", KEY, "--replicas",
                                    json.dumps([r.url for r in replicas]), "--scrape_s", "0.2", *args)
        yield proc
    finally:
        if proc is not None:
            proc.stop()
        for r in replicas:
            r.close()


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RoleProcess]:
    with tenant_router(tmp_path_factory.mktemp("router-fair-share"), [StandInReplica(), StandInReplica()],
                       "--max_sessions_per_replica", "2", "--tenants", json.dumps(TENANTS),
                       "--admission_timeout_s", "90") as proc:
        yield proc


def open_session(router: RoleProcess, token: str, sid: str) -> httpx.Response:
    """A session's first call (it waits while no place is free)."""
    body = {"model": "latest", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "session_id": sid}
    return HTTP.post(router.url + "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {token}"},
                     timeout=120)


def release(router: RoleProcess, token: str, sid: str) -> None:
    answer = HTTP.delete(router.url + f"/v1/traces/{sid}", headers={"authorization": f"Bearer {token}"}, timeout=30)
    assert answer.status_code == 200, answer.text


def admission(router: RoleProcess) -> dict[str, Any]:
    stats = HTTP.get(router.url + "/v1/stats", timeout=10).json()
    return {**stats["admission"], **{k: v for k, v in stats["totals"].items() if k.startswith("admi")}}


def wait_for(check: Callable[[], bool], what: str, timeout: float = 30.0) -> float:
    """Seconds until `check()` holds; fails the test after `timeout`."""
    start = time.monotonic()
    while not check():
        assert time.monotonic() - start < timeout, f"timed out waiting for {what}"
        time.sleep(0.05)
    return time.monotonic() - start


def test_alone_a_tenant_takes_every_place(router: RoleProcess) -> None:
    """Honest control: no share is reserved for tenants with no work; a 5th session waits for a place."""
    with ThreadPoolExecutor(PLACES + 1) as pool:
        opened = list(pool.map(lambda i: open_session(router, C, f"c-{i}"), range(PLACES)))
        assert [r.status_code for r in opened] == [200] * PLACES
        assert admission(router)["live"] == PLACES and admission(router)["waiting"] == 0
        fifth = pool.submit(open_session, router, C, "c-extra")
        wait_for(lambda: admission(router)["waiting"] == 1, "the 5th session to queue")
        assert not fifth.done()
        release(router, C, "c-0")
        assert fifth.result(timeout=30).status_code == 200
    for sid in ["c-1", "c-2", "c-3", "c-extra"]:
        release(router, C, sid)
    assert admission(router)["live"] == 0


def test_flood_cannot_starve_a_tenant_below_its_share(router: RoleProcess) -> None:
    held = [f"a-held-{i}" for i in range(PLACES)]
    with ThreadPoolExecutor(12) as pool:
        assert [r.status_code for r in pool.map(lambda s: open_session(router, A, s), held)] == [200] * PLACES
        flood = {pool.submit(open_session, router, A, f"a-flood-{i}"): f"a-flood-{i}" for i in range(6)}
        wait_for(lambda: admission(router)["waiting"] == 6, "A's flood to queue")
        over = open_session(router, A, "a-over")  # 4 live + 6 waiting = A's max_sessions
        assert over.status_code == 429 and "max_sessions" in over.json()["error"]["message"], over.text
        mine = {pool.submit(open_session, router, B, f"b-{i}"): f"b-{i}" for i in range(4)}
        wait_for(lambda: admission(router)["waiting"] == 10, "B's sessions to queue")
        admitted = admission(router)["admitted"]
        first_b = None
        for n, sid in enumerate(held, start=1):
            release(router, A, sid)
            wait_for(lambda n=n: admission(router)["admitted"] == admitted + n, "a freed place to be given")
            wait_for(lambda n=n: sum(f.done() for f in [*flood, *mine]) == n, "the admitted call to answer")
            if first_b is None and any(f.done() for f in mine):
                first_b = n
        assert first_b == 1, "the first freed place must go to B (0 live) over A's older flood (3 live)"
        b_done = [mine[f] for f in mine if f.done()]
        a_done = [flood[f] for f in flood if f.done()]
        assert len(b_done) == 3 and len(a_done) == 1, (b_done, a_done)  # weight 3 of 4: 3 of the 4 places
        assert all(f.result().status_code == 200 for f in [*flood, *mine] if f.done())
        _drain(router, {**{f: (A, s) for f, s in flood.items()}, **{f: (B, s) for f, s in mine.items()}})
    assert admission(router)["live"] == 0 and admission(router)["waiting"] == 0


def _drain(router: RoleProcess, calls: dict[Future[httpx.Response], tuple[str, str]]) -> None:
    """Release every admitted session until every waiter was admitted, then those too."""
    released: set[str] = set()
    deadline = time.monotonic() + 60
    while len(released) < len(calls):
        assert time.monotonic() < deadline, "waiters were not admitted as places freed"
        for future, (token, sid) in calls.items():
            if future.done() and sid not in released:
                assert future.result().status_code == 200
                release(router, token, sid)
                released.add(sid)
        time.sleep(0.05)


# --- KV-token quotas (router.tenants.<name>.max_kv_tokens) ----------------------------------------

KV_CAP = 100_000  # run-a's KV quota: 3 long sessions (30 003 projected tokens each) and one short one
LONG = {"model": "latest", "prompt": [5, 6, 7], "max_tokens": 30_000}  # token-in: projected 3 + 30 000 tokens


@pytest.fixture(scope="module")
def kv_router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RoleProcess]:
    """No session places (nothing waits), only run-a's KV quota; run-b is uncapped."""
    replicas = [StandInReplica(capacity_tokens=1_000_000), StandInReplica(capacity_tokens=1_000_000)]
    with tenant_router(tmp_path_factory.mktemp("router-kv-quota"), replicas,
                       "--tenants", json.dumps({"run-a": {"max_kv_tokens": KV_CAP}})) as proc:
        yield proc


def open_long(router: RoleProcess, token: str, sid: str) -> httpx.Response:
    return HTTP.post(router.url + "/v1/completions", json={**LONG, "session_id": sid},
                     headers={"authorization": f"Bearer {token}"}, timeout=60)


def kv_refusals(router: RoleProcess) -> int:
    text = HTTP.get(router.url + "/metrics", timeout=10).text
    return int(next(line.split()[1] for line in text.splitlines()
                    if line.startswith("burstrl_router_admission_kv_quota_refusals_total ")))


def test_flood_of_long_sessions_is_refused_past_the_kv_quota(kv_router: RoleProcess) -> None:
    """run-a floods long sessions at once: 3 fit its KV quota and every other one is a 429 naming
    max_kv_tokens (concurrent calls cannot race past it), while run-b is admitted throughout. Known
    sessions keep calling; a released long session frees room for another."""
    with ThreadPoolExecutor(16) as pool:
        flood = list(pool.map(lambda i: open_long(kv_router, A, f"a-long-{i}"), range(12)))
        theirs = list(pool.map(lambda i: open_long(kv_router, B, f"b-long-{i}"), range(8)))  # honest control
    admitted = [i for i, r in enumerate(flood) if r.status_code == 200]
    assert len(admitted) == 3, [r.status_code for r in flood]
    for r in flood:
        if r.status_code != 200:
            assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error", r.text
            assert "router.tenants.run-a.max_kv_tokens = 100000" in r.json()["error"]["message"], r.text
    assert [r.status_code for r in theirs] == [200] * 8
    assert kv_refusals(kv_router) == 9

    chat = {"model": "latest", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    short = [HTTP.post(kv_router.url + "/v1/chat/completions", json={**chat, "session_id": f"a-short-{i}"},
                       headers={"authorization": f"Bearer {A}"}, timeout=60) for i in range(2)]
    assert [r.status_code for r in short] == [200, 429], "a short session (8192 projected) fits what is left"
    assign = HTTP.post(kv_router.url + "/v1/assign", json={"session_id": "a-hinted", "expected_tokens": 200_000},
                       headers={"authorization": f"Bearer {A}"}, timeout=30)
    assert assign.status_code == 429 and "max_kv_tokens" in assign.text, assign.text
    again = open_long(kv_router, A, f"a-long-{admitted[0]}")  # a known session's call always passes
    assert again.status_code == 200, again.text

    release(kv_router, A, f"a-long-{admitted[0]}")
    assert open_long(kv_router, A, "a-long-after").status_code == 200
    assert open_long(kv_router, A, "a-long-over").status_code == 429
    assert open_long(kv_router, B, "b-long-after").status_code == 200
    assert kv_refusals(kv_router) == 12
