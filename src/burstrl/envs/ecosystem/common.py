"""What the ecosystem adapters share: an OpenAI client that calls the router as one session."""

from __future__ import annotations

from typing import Any

from burstrl.envs.base import SessionChatClient


def openai_client(client: SessionChatClient) -> Any:
    """An `openai.AsyncOpenAI` at the router whose every generation call is `client`'s session on
    its version, counted (`SessionClient.sdk_http`). No retries: a failed call is the fleet's, and
    the attempt re-runs whole (`client.raise_failure()` after the rollout)."""
    from openai import AsyncOpenAI

    return AsyncOpenAI(base_url=f"{client.router}/v1", api_key="burstrl", max_retries=0,
                       http_client=client.sdk_http())
