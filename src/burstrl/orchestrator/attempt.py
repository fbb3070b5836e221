"""One attempt at a task: the environment's rollout through a session, then its captured calls.

Why the capture is read back from the replica and not rebuilt from responses: the replica recorded
exactly the ids it fed and sampled, and the logprobs of the distribution it sampled from; the
trainer needs those, not a re-tokenization. An attempt is only trainable if the trace holds every
call the environment made, all on the group's version: a replica that died mid-rollout took part
of the capture with it (the router re-homed the session and later calls went elsewhere), so such
an attempt is a `ReplicaFailure` and is re-run under a new id, never stored half-captured.

An attempt the model wrecked (it killed or filled its sandbox: the environment's outcome has a
`reason`) is stored like any other, with its reward 0 and status `failed`: the model's failure,
trained on, never re-run.
"""

from __future__ import annotations

import time

import httpx

from burstrl.envs.base import Environment, Task
from burstrl.orchestrator.client import ReplicaFailure, SessionClient, fetch_trace, release
from burstrl.protocol.versions import version_number
from burstrl.store.types import Rollout, Turn


async def run_attempt(http: httpx.AsyncClient, router: str, env: Environment, task: Task, rollout_id: str,
                      version: str, temperature: float, max_tokens: int, seed: int,
                      admin_token: str) -> Rollout:
    """Roll out `task` once on `version` as session `rollout_id`; the graded, fully captured rollout."""
    t0 = time.monotonic()
    client = SessionClient(http, router, rollout_id, version, temperature, max_tokens, seed)
    try:
        outcome = await env.rollout(client, task)
        t1 = time.monotonic()
        trace = await fetch_trace(http, router, rollout_id, admin_token)
    finally:
        await release(http, router, rollout_id, admin_token)
    calls = trace.get("calls", [])
    if len(calls) != client.calls:
        raise ReplicaFailure(f"capture lost: {client.calls} calls made, {len(calls)} in the trace "
                             f"(the session moved replicas mid-rollout)")
    if any(c["version"] != version for c in calls):
        raise ReplicaFailure(f"trace versions {sorted({c['version'] for c in calls})} != {version}")
    replica = str(trace.get("replica", ""))
    turns = [Turn(prompt_ids=c["prompt_ids"], completion_ids=c["completion_ids"], logprobs=c["logprobs"],
                  version=version_number(version), replica=replica) for c in calls]
    return Rollout(id=rollout_id, turns=turns, reward=outcome.reward, reward_parts=outcome.parts,
                   status="failed" if outcome.info.get("reason") else "complete", reason=outcome.info.get("reason"),
                   timings={"rollout_s": t1 - t0, "total_s": time.monotonic() - t0},
                   passed=bool(outcome.passed), calls=client.calls)
