"""Prefix block hashes that mean the same in every process: the router's prefix index and the replica's
cache summary (`GET /v1/loads` `prefix_blocks`) speak them.

Why not the replica's own `inference.prefix.block_hashes`: it seeds its chain with Python's `hash` of
a string, which differs per process (hash randomisation), so a router could never match it. Here a
block is keyed by BLAKE2b over the previous key and the block's token ids, seeded by the version name
(keys and values depend on the weights that computed them), so equal keys mean an equal prefix on an
equal version, in any process.
"""

from __future__ import annotations

import hashlib
from array import array

BLOCK_TOKENS = 32  # the replica's prefix-cache block (inference/prefix.py BLOCK)


def prefix_block_hashes(tokens: list[int], version: str, max_blocks: int | None = None,
                        block: int = BLOCK_TOKENS) -> list[int]:
    """Chained 63-bit keys of the full `block`-token blocks of `tokens` (at most `max_blocks`), seeded by `version`."""
    n = len(tokens) // block
    if max_blocks is not None:
        n = min(n, max_blocks)
    prev = hashlib.blake2b(version.encode(), digest_size=8).digest()
    out = []
    for i in range(n):
        ids = array("q", tokens[i * block:(i + 1) * block])
        prev = hashlib.blake2b(prev + ids.tobytes(), digest_size=8).digest()
        out.append(int.from_bytes(prev, "little") >> 1)
    return out


def cache_scope(version: str, salt: str | None) -> str:
    """The seed of a prompt's block keys: its version, and its `cache_salt` when it has one, so the
    router's prefix index never matches a salted prompt against another salt's (or no salt's) blocks,
    as the replica's cache never shares them."""
    return version if not salt else f"{version}\x00cache_salt:{salt}"
