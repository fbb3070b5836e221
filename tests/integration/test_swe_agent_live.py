"""The bash agent and the mini-swe-agent bridge against a live replica (the tiny model) and real sandboxes.

The tiny model cannot code: any outcome is fine. What must hold is the plumbing: every model call
of an attempt is captured under the attempt's session, and the agent's calls are token-continuous.
"""

from __future__ import annotations

import asyncio
import shutil
import uuid

import httpx
import pytest

from burstrl.envs.swe.agent import AgentLimits, run_agent
from burstrl.orchestrator.client import SessionClient
from burstrl.protocol.capture import expand_calls
from tests.http_client import HTTP

from .conftest import ADMIN_TOKEN

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap (bwrap) is not installed")]


async def _attempt(url: str, sandbox, task, session_id: str):
    async with httpx.AsyncClient(timeout=120) as http:
        client = SessionClient(http, url, session_id, "base", temperature=1.0, max_tokens=64, seed=0)
        result = await run_agent(client, sandbox, task,
                                 AgentLimits(max_turns=3, max_tokens_per_call=64, max_seconds=120))
        trace = (await http.get(f"{url}/v1/traces/{session_id}",
                                 headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})).json()
    return client, result, trace


def test_agent_attempt_is_captured(server, calc_sandbox, calc_task):
    session_id = f"swe-agent-{uuid.uuid4().hex[:8]}"
    client, result, trace = asyncio.run(_attempt(server.url, calc_sandbox, calc_task, session_id))
    assert result.exit_reason in ("submitted", "max_turns", "max_tokens", "timeout", "format_errors")
    assert 1 <= result.turns <= 3 and client.calls == result.turns == len(result.transcript)
    calls = trace["calls"]
    assert len(calls) == result.turns and all(c["completion_ids"] for c in calls)
    assert all(len(c["logprobs"]) == len(c["completion_ids"]) for c in calls)
    # Token continuity: each call's prompt starts with the previous call's prompt + sampled ids.
    # The replica stores each such call as a delta: only the ids after that head (inference.capture).
    whole = expand_calls(calls)
    for prev, call, delta, turn in zip(whole, whole[1:], calls[1:], result.transcript[1:], strict=False):
        if not turn["context_elided"]:
            head = prev["prompt_ids"] + prev["completion_ids"]
            assert call["prompt_ids"][:len(head)] == head
            assert delta["prefix_tokens"] == len(head) and not delta["diverged"]


def test_minisweagent_bridge_runs_an_attempt(server, calc_sandbox, calc_task):
    pytest.importorskip("minisweagent")
    from burstrl.envs.swe.bridge import run_minisweagent

    session_id = f"mswea-{uuid.uuid4().hex[:8]}"
    out = run_minisweagent(calc_task, calc_sandbox, server.url, "base", session_id, step_limit=3,
                           max_tokens=64, max_seconds=120)
    assert out["exit_status"] and 1 <= out["model_calls"] <= 3
    assert out["messages"][0]["role"] == "system" and "add(2, 3)" in out["messages"][1]["content"]
    trace = HTTP.get(f"{server.url}/v1/traces/{session_id}", headers=server.admin(), timeout=30).json()
    assert len(trace["calls"]) == out["model_calls"]
