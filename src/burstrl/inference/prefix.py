"""Find an idle session whose cached tokens start like a new prompt (cross-session prefix reuse).

Why: rollouts of one GRPO group share their whole first prompt, and every rollout of a run shares
the system prompt. A session's first call can then copy another session's keys/values for the
common prefix instead of recomputing them (a copy is far cheaper than a prefill), as SGLang's radix
cache and vLLM's prefix caching do. Sessions keep their own storage, so sharing is a copy, never an
alias: eviction and truncation of one session never touch another.

Index: each full block of BLOCK tokens of an idle cache is keyed by a hash chained over all the
blocks before it, so one dict lookup per prompt block finds a session that holds that whole prefix.
The chain starts from the cache's namespace: keys and values depend on the adapter version that
computed them (LoRA touches k/v), so a block is only ever shared between requests on the same
version. Hash collisions are harmless: the caller verifies the namespace and the common prefix
token by token.
"""

from __future__ import annotations

BLOCK = 32
KvNamespace = int | tuple[int, str]  # an adapter's uid, with a request's cache_salt when it has one


def block_hashes(tokens: list[int], limit: int | None = None, namespace: KvNamespace = 0) -> list[int]:
    """Chained hashes of the full BLOCK-token blocks of tokens[:limit], seeded by the namespace."""
    n = len(tokens) if limit is None else min(limit, len(tokens))
    out, prev = [], hash(("kv-namespace", namespace))
    for start in range(0, n - BLOCK + 1, BLOCK):
        prev = hash((prev, tuple(tokens[start:start + BLOCK])))
        out.append(prev)
    return out


class PrefixIndex:
    """Block hash -> the idle sessions whose cache holds that block (with everything before it)."""

    def __init__(self) -> None:
        self._owners: dict[int, dict[str, None]] = {}  # insertion-ordered set
        self._hashes: dict[str, list[int]] = {}

    def add(self, session_id: str, tokens: list[int], namespace: KvNamespace = 0) -> None:
        hashes = block_hashes(tokens, namespace=namespace)
        self._hashes[session_id] = hashes
        for h in hashes:
            self._owners.setdefault(h, {})[session_id] = None

    def remove(self, session_id: str) -> None:
        for h in self._hashes.pop(session_id, []):
            owners = self._owners.get(h)
            if owners is not None:
                owners.pop(session_id, None)
                if not owners:
                    del self._owners[h]

    def longest(self, prompt: list[int], namespace: KvNamespace = 0) -> tuple[str | None, int]:
        """(a session of `namespace` holding the most leading blocks of `prompt`, how many blocks)."""
        best, blocks = None, 0
        for i, h in enumerate(block_hashes(prompt, namespace=namespace)):
            owners = self._owners.get(h)
            if not owners:
                break
            best, blocks = next(reversed(owners)), i + 1  # the most recently added owner
        return best, blocks
