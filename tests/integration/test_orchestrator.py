"""The orchestrator's attempt against a real router and real replicas: full capture, or a clear failure.

The invariant under test: an attempt is only returned when the trace it read back holds every call
the environment made, all on the group's version; when the session's replica dies mid-rollout the
router re-homes it (later calls succeed elsewhere) but the capture is incomplete, and the attempt
must fail with ReplicaFailure so the orchestrator re-runs it under a new id.

The tests share one router and two replicas (starting them is most of this module's time) and run
in file order: the replica-death test kills one of them, so it comes last.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from burstrl.envs.base import ChatClient, Outcome, Task
from burstrl.envs.toy_multi import MultiToyEnv
from burstrl.orchestrator.attempt import run_attempt
from burstrl.orchestrator.client import ReplicaFailure, VersionGone, assign
from tests.http_client import HTTP

from .conftest import ADMIN_TOKEN, routed_replicas

pytestmark = pytest.mark.slow  # real processes: `make test` runs it, `make test-fast` (<= 2 min) does not

TOKEN = "orchestrator-test-cluster-token"


@pytest.fixture(scope="module")
def cluster(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    with routed_replicas(tiny_model_dir, tmp_path_factory.mktemp("orchestrator"), 2,
                         router_args=("--cluster_token", TOKEN, "--scrape_s", "0.5")) as cluster:
        yield cluster


class KillHomeAfterFirstCall(MultiToyEnv):
    """The multi-turn env, except that after the first call it kills the replica serving the session."""

    def __init__(self, servers, router_url: str) -> None:
        self.servers, self.router_url = servers, router_url

    async def rollout(self, client: ChatClient, task: Task) -> Outcome:
        original = client.chat

        async def chat(messages, max_tokens=None):
            reply = await original(messages, max_tokens)
            if client.calls == 1:
                trace = HTTP.get(f"{self.router_url}/v1/traces/{client.session_id}",
                                 headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=10).json()
                next(s for s in self.servers if s.url == trace["replica"]).replica.kill()
            return reply

        client.chat = chat
        return await super().rollout(client, task)


def attempt(router_url: str, env, task: Task, sid: str):
    async def go():
        async with httpx.AsyncClient(timeout=60) as http:
            version = await assign(http, router_url, sid)
            return await run_attempt(http, router_url, env, task, sid, version, 1.0, 4, 7, ADMIN_TOKEN)
    return asyncio.run(go())


def test_an_attempt_returns_every_captured_call_and_releases_the_session(cluster) -> None:
    router, servers = cluster
    env = MultiToyEnv()
    task = env.make_tasks(1, seed=3, difficulty=3)[0]
    rollout = attempt(router.url, env, task, "attempt-ok")
    assert rollout.id == "attempt-ok" and len(rollout.turns) == 3
    assert {t.version for t in rollout.turns} == {0}
    assert rollout.turns[0].replica in {s.url for s in servers}
    for earlier, later in zip(rollout.turns, rollout.turns[1:], strict=False):  # token continuity across calls
        assert later.prompt_ids[:len(earlier.prompt_ids) + len(earlier.completion_ids)] == \
            earlier.prompt_ids + earlier.completion_ids
    assert rollout.calls == 3 and 0.0 <= rollout.reward <= 1.0
    assert HTTP.get(f"{router.url}/v1/traces/attempt-ok",
                    headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=10).status_code == 404  # released


def test_a_version_no_replica_serves_is_version_gone(cluster) -> None:
    router, _ = cluster

    async def go():
        async with httpx.AsyncClient(timeout=60) as http:
            from burstrl.orchestrator.client import SessionClient

            client = SessionClient(http, router.url, "s-gone", "policy-v99", 1.0, 4, 0)
            await client.chat([{"role": "user", "content": "hi"}])
    with pytest.raises(VersionGone):
        asyncio.run(go())


class HostileSdkEnv(MultiToyEnv):
    """An ecosystem-style env: its own openai SDK (`envs.ecosystem.common.openai_client`) names
    another session, another version and another session in the body; the session's transport pins
    all three back, so the attempt's capture holds every call on the group's version."""

    async def rollout(self, client: ChatClient, task: Task) -> Outcome:
        from burstrl.envs.ecosystem.common import openai_client

        sdk = openai_client(client)
        other = {"extra_headers": {"X-Session-ID": "someone-else"}, "extra_body": {"session_id": "other"}}
        messages = [{"role": "user", "content": "hi"}]
        first = await sdk.chat.completions.create(model="policy-v99", messages=messages, max_tokens=3, **other)
        messages += [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": "again"}]
        stream = await sdk.chat.completions.create(model="base", messages=messages, max_tokens=3, stream=True, **other)
        async for _ in stream:
            pass
        await sdk.close()
        client.raise_failure()
        return Outcome(reward=0.5)


def test_an_sdk_env_is_pinned_to_the_session_and_version_and_counted(cluster) -> None:
    router, _ = cluster
    task = MultiToyEnv().make_tasks(1, seed=5, difficulty=1)[0]
    rollout = attempt(router.url, HostileSdkEnv(), task, "attempt-sdk")
    assert rollout.calls == 2 and len(rollout.turns) == 2 and {t.version for t in rollout.turns} == {0}
    assert rollout.turns[1].prompt_ids[:len(rollout.turns[0].prompt_ids)] == rollout.turns[0].prompt_ids
    assert HTTP.get(f"{router.url}/v1/traces/someone-else", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
                    timeout=10).status_code == 404  # nothing was captured under the SDK's own id


def test_an_sdk_call_on_a_version_no_replica_serves_is_version_gone(cluster) -> None:
    from burstrl.envs.ecosystem.common import openai_client
    from burstrl.orchestrator.client import SessionClient

    router, _ = cluster

    async def go():
        async with httpx.AsyncClient(timeout=60) as http:
            client = SessionClient(http, router.url, "s-sdk-gone", "policy-v99", 1.0, 4, 0)
            sdk = openai_client(client)
            with pytest.raises(Exception, match="404"):
                await sdk.chat.completions.create(model="base", messages=[{"role": "user", "content": "hi"}])
            await sdk.close()
            client.raise_failure()
    with pytest.raises(VersionGone, match="call 1: 404"):
        asyncio.run(go())


def test_an_sdk_call_the_fleet_fails_is_a_replica_failure() -> None:
    from burstrl.envs.ecosystem.common import openai_client
    from burstrl.orchestrator.client import SessionClient

    async def go():
        async with httpx.AsyncClient(timeout=10) as http:
            client = SessionClient(http, "http://127.0.0.1:9", "s-dead", "base", 1.0, 4, 0)  # port 9: nobody
            sdk = openai_client(client)
            with pytest.raises(Exception, match="Connection error"):  # what the environment sees (and may swallow)
                await sdk.chat.completions.create(model="base", messages=[{"role": "user", "content": "hi"}])
            await sdk.close()
            assert client.calls == 0
            client.raise_failure()
    with pytest.raises(ReplicaFailure, match="call 1: ConnectError"):
        asyncio.run(go())


def test_a_replica_dying_mid_rollout_fails_the_attempt_instead_of_storing_half_a_capture(cluster) -> None:
    router, servers = cluster
    env = KillHomeAfterFirstCall(servers, router.url)
    task = MultiToyEnv().make_tasks(1, seed=4, difficulty=3)[0]
    with pytest.raises(ReplicaFailure, match="capture lost: 3 calls made, 2 in the trace"):
        attempt(router.url, env, task, "attempt-moved")
    # the next attempt of the group runs on the survivor and is complete
    rollout = attempt(router.url, MultiToyEnv(), task, "attempt-retry")
    assert len(rollout.turns) == 3
