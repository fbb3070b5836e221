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
from typing import Any

import httpx

from burstrl.envs.base import Environment, Task
from burstrl.orchestrator.client import ReplicaFailure, SessionClient, fetch_trace, release
from burstrl.protocol.capture import REPLICA_CAP, expand_calls
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
    calls = _whole_calls(trace, client.calls, version)
    replica = str(trace.get("replica", ""))
    turns = [Turn(prompt_ids=c["prompt_ids"], completion_ids=c["completion_ids"], logprobs=c["logprobs"],
                  version=version_number(version), replica=replica) for c in calls]
    reward, reason, passed = outcome.reward, outcome.info.get("reason"), bool(outcome.passed)
    if trace.get("dropped_calls"):  # the rollout outgrew its session's capture cap: the model's doing
        reward, passed = 0.0, False
        reason = f"capture truncated: {trace['dropped_calls']} calls past the session's capture cap"
    return Rollout(id=rollout_id, turns=turns, reward=reward, reward_parts=outcome.parts,
                   status="failed" if reason else "complete", reason=reason,
                   timings={"rollout_s": t1 - t0, "total_s": time.monotonic() - t0},
                   passed=passed, calls=client.calls)


def _whole_calls(trace: dict[str, Any], made: int, version: str) -> list[dict[str, Any]]:
    """The trace's calls with whole prompts, checked against what the client did.

    A call missing from the trace (the session moved replicas mid-rollout), one on another version,
    or calls dropped by the replica's total capture cap (other sessions filled it) are infra faults:
    `ReplicaFailure`, the attempt re-runs. Calls dropped by the session's own cap are counted, not
    faults: the rollout made them (`run_attempt` scores it 0).
    """
    dropped = trace.get("dropped_calls") or 0
    if trace.get("dropped_reason") == REPLICA_CAP:
        raise ReplicaFailure(f"capture dropped {dropped} calls: the replica's total capture cap was full")
    try:
        calls = expand_calls(trace.get("calls", []))
    except ValueError as exc:
        raise ReplicaFailure(f"bad trace: {exc}") from None
    if len(calls) + dropped != made:
        raise ReplicaFailure(f"capture lost: {made} calls made, {len(calls)} in the trace "
                             f"(the session moved replicas mid-rollout)")
    if any(c["version"] != version for c in calls):
        raise ReplicaFailure(f"trace versions {sorted({c['version'] for c in calls})} != {version}")
    return calls
