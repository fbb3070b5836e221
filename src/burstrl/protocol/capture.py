"""The trace's wire shape: each call's prompt as a delta against the call before it.

A replica records call k's prompt as `prefix_tokens` (how many leading ids it shares with call k-1's
prompt + completion) and `prompt_ids` (the ids after them), so a rollout's trace is linear in its
length, not quadratic (`inference.capture`). Readers that need whole prompts (the orchestrator
building turns, tests comparing logprobs) rebuild them here; a trace fetched with `?full=true` has
`prefix_tokens` 0 everywhere and passes through unchanged.
"""

from __future__ import annotations

from typing import Any

SESSION_CAP = "session"  # dropped_reason: the session's own records grew past its cap
REPLICA_CAP = "replica"  # dropped_reason: all sessions' records together filled the replica's cap


def expand_calls(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Copies of `calls` with whole `prompt_ids`; ValueError names a record that does not fit its
    predecessor (a prefix longer than what came before, or ids that are not lists)."""
    out, prev = [], []
    for i, call in enumerate(calls):
        prefix = call.get("prefix_tokens", 0)
        prompt, completion = call.get("prompt_ids"), call.get("completion_ids")
        if not (isinstance(prefix, int) and 0 <= prefix <= len(prev)):
            raise ValueError(f"trace call {i}: prefix_tokens {prefix!r} does not fit the {len(prev)} ids before it")
        if not (isinstance(prompt, list) and isinstance(completion, list)):
            raise ValueError(f"trace call {i}: prompt_ids and completion_ids must be lists")
        whole = prev[:prefix] + prompt
        out.append({**call, "prompt_ids": whole, "prefix_tokens": 0})
        prev = whole + completion
    return out
