"""The verifiers v1 harness burstrl pins: verifiers' `null` chat + MCP-tool loop, run in-process.

Why not verifiers' own `null` harness: it is a PEP 723 script that verifiers prepares with
`uv sync --script` (uv and PyPI at the first rollout: impossible offline) and then runs as one
subprocess per rollout. This is the same loop (the MCP helpers are imported from that very script,
`verifiers.v1.harnesses.null.program`), run on the env's event loop: no uv, no process per rollout.
verifiers allows it (`Harness.launch`: "a harness may run its loop in-process ... as long as every
model call goes through `endpoint` + `secret`"), so the interception server still records every
turn on the trace and scores it exactly as for `null`.

Selecting it: verifiers resolves `agent.harness.id` by importing a module of that name that
exports a `Harness` subclass in `__all__` (`verifiers.v1.utils.loaders`), trying
`verifiers.v1.harnesses.<id>` first. A dotted id cannot work there (the namespaced probe fails on
the missing parent package), so importing this module also registers it under the top-level
module name `HARNESS_ID`; the adapter then pins `{"harness": {"id": HARNESS_ID}}`. Importing this
module imports verifiers (seconds of CPU): only `vf_v1` does, lazily.
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

import httpx
from openai import AsyncOpenAI
from verifiers.v1.dialects.chat import message_to_wire
from verifiers.v1.harnesses.null import NullHarness
from verifiers.v1.harnesses.null.program import call_mcp, connect_mcp
from verifiers.v1.runtimes import ProgramResult

from burstrl.protocol.http import default_ssl_context

HARNESS_ID = "burstrl_inproc_chat"
MCP_CONNECT_TIMEOUT_S = 60.0  # tool enumeration only, as in verifiers' null program


class InprocChatHarness(NullHarness):
    """`null`'s loop without its program: chat until a reply calls no tool, running the calls."""

    async def setup(self, runtime: Any) -> None:
        """Nothing to install (the `null` harness would `uv sync` its script here)."""

    async def launch(self, ctx: Any, trace: Any, runtime: Any, endpoint: str, secret: str,
                     mcp_urls: dict[str, str], data: Any) -> ProgramResult:
        messages = self._initial_messages(data)
        tools, dispatch, servers = await self._connect(mcp_urls)
        http = httpx.AsyncClient(verify=default_ssl_context(), timeout=httpx.Timeout(None, connect=5.0))
        async with AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0, http_client=http) as client:
            while True:
                extra = {"tools": tools} if tools else {}
                completion = await client.chat.completions.create(model=ctx.model, messages=messages, **extra)
                message = completion.choices[0].message
                messages.append(message.model_dump(exclude_none=True))
                if not message.tool_calls:
                    return ProgramResult(exit_code=0, stdout="", stderr="")
                for call in message.tool_calls:
                    messages.append(await _tool_message(call, servers, dispatch))

    def _initial_messages(self, data: Any) -> list[dict[str, Any]]:
        system, prompt = self.resolve_prompt(data)
        messages: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
        if isinstance(prompt, str):
            messages.append({"role": "user", "content": prompt})
        elif prompt is not None:
            messages.extend(message_to_wire(m) for m in prompt)
        return messages

    async def _connect(self, mcp_urls: dict[str, str]) -> tuple[list[dict], dict, dict]:
        if not mcp_urls:
            return [], {}, {}
        config = {"mcpServers": {name: {"url": url, "timeout": self.config.tool_timeout}
                                 for name, url in mcp_urls.items()}}
        async with asyncio.timeout(MCP_CONNECT_TIMEOUT_S):
            return await connect_mcp(config)


async def _tool_message(call: Any, servers: dict, dispatch: dict) -> dict[str, Any]:
    """The tool's answer to one call; a malformed call is answered with an error, as `null` does."""
    name = call.function.name
    try:
        args = json.loads(call.function.arguments or "{}")
    except json.JSONDecodeError as exc:
        return _tool_reply(call, f"error: invalid JSON in tool arguments ({exc}); resend the call with valid JSON")
    if not isinstance(args, dict):
        return _tool_reply(call, f"error: tool arguments must be a JSON object, got {type(args).__name__}")
    if name not in dispatch:
        return _tool_reply(call, f"error: unknown tool {name!r}")
    return _tool_reply(call, await call_mcp(servers, dispatch, name, args))


def _tool_reply(call: Any, content: Any) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": call.id, "content": content}


__all__ = ["InprocChatHarness"]

sys.modules.setdefault(HARNESS_ID, sys.modules[__name__])
