"""Replay a production request trace (Mooncake's JSONL) in the router simulator, validated line by line.

Why validated here: a trace is outside input; a string where a hash id should be, a nested list,
a negative length or an empty file used to give a traceback, a hang (absolute epoch timestamps
made the simulator wait for hours of simulated time) or silently wrong figures. Every problem is
a `TraceError` naming the file and line.

Mooncake's hash ids name 512-token blocks and are chained (an id stands for its whole prefix), so
a request that continues an earlier conversation repeats that request's full blocks as its own
prefix. `sessions="infer"` groups such requests into one multi-turn session: a request continues
the latest earlier request whose full blocks it starts with and whose input and output it is at
least as long as (the next turn's prompt holds the previous prompt and reply), each request
continued at most once, and never through a block other conversations share (a system prompt). Turns keep their own arrival times (never before the previous turn ends).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from burstrl.router.sim import Call, TraceSession

MOONCAKE_BLOCK_TOKENS = 512
SESSION_MODES = ("request", "infer")


class TraceError(ValueError):
    """A trace that cannot be replayed; the message names the file and line."""


def _number(row: dict, key: str, where: str, integer: bool) -> float:
    value = row.get(key)
    if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
        kind = "an integer" if integer else "a number"
        raise TraceError(f"{where}: {key!r} must be {kind}, got {value!r}"[:300])
    if not math.isfinite(value) or value < 0:
        raise TraceError(f"{where}: {key!r} must be finite and >= 0, got {value!r}")
    return value


def parse_row(line: str, where: str) -> tuple[float, int, int, tuple[int, ...]]:
    """(timestamp ms, input_length, output_length, hash_ids) of one trace line."""
    try:
        row = json.loads(line)
    except (json.JSONDecodeError, RecursionError) as exc:
        raise TraceError(f"{where}: not JSON ({type(exc).__name__})") from None
    if not isinstance(row, dict):
        raise TraceError(f"{where}: a request must be a JSON object")
    stamp = _number(row, "timestamp", where, integer=False)
    n_in = int(_number(row, "input_length", where, integer=True))
    n_out = int(_number(row, "output_length", where, integer=True))
    hashes = row.get("hash_ids")
    if not isinstance(hashes, list) or any(isinstance(h, bool) or not isinstance(h, int) for h in hashes):
        raise TraceError(f"{where}: 'hash_ids' must be a flat list of integers, got {str(hashes)[:80]}")
    return stamp, n_in, n_out, tuple(hashes)


def read_mooncake(path: str | Path) -> list[tuple[float, int, int, tuple[int, ...]]]:
    """Validated rows sorted by timestamp (stable); raises TraceError on the first bad line or no rows."""
    rows = []
    with open(path, encoding="utf-8", errors="strict") as f:
        for n, line in enumerate(f, start=1):
            if line.strip():
                rows.append(parse_row(line, f"{path}:{n}"))
    if not rows:
        raise TraceError(f"{path}: empty trace (no requests)")
    rows.sort(key=lambda r: r[0])
    return rows


def infer_parents(rows: list[tuple[float, int, int, tuple[int, ...]]], block_tokens: int) -> list[int | None]:
    """For each row, the index of the earlier row it continues (None: a new session).

    A parent is the latest unclaimed row whose full blocks the request starts with, whose input and
    output it is at least as long as, and whose last full block no other conversation holds at that
    position (a block every conversation shares, a system prompt, says nothing about which one).
    """
    ends: dict[tuple[int, int], int] = {}  # (full blocks, last full block's id) -> latest unclaimed row
    holders: dict[tuple[int, int], int] = {}  # (position + 1, id) -> the one root holding it, -1: several
    roots: list[int] = []
    parents: list[int | None] = []
    for j, (_, n_in, _, hashes) in enumerate(rows):
        parent = None
        for i in range(len(hashes) - 1, -1, -1):
            key = (i + 1, hashes[i])
            candidate = ends.get(key)
            if candidate is not None and holders.get(key) != -1 and n_in >= rows[candidate][1] + rows[candidate][2]:
                parent = candidate
                del ends[key]
                break
        parents.append(parent)
        root = j if parent is None else roots[parent]
        roots.append(root)
        full = min(len(hashes), n_in // block_tokens)
        for i in range(full):
            key = (i + 1, hashes[i])
            holders[key] = root if holders.get(key, root) == root else -1
        if full:
            ends[(full, hashes[full - 1])] = j
    return parents


def load_mooncake(path: str | Path, sessions: str = "request", block_tokens: int = MOONCAKE_BLOCK_TOKENS,
                  rate_scale: float = 1.0) -> list[TraceSession]:
    """A Mooncake trace as simulator sessions: one per request, or multi-turn (`sessions="infer"`).

    Times are seconds from the first arrival, divided by `rate_scale` (4 = the same requests at 4x
    the rate).
    """
    if sessions not in SESSION_MODES:
        raise TraceError(f"sessions must be one of {', '.join(SESSION_MODES)}, got {sessions!r}")
    if not rate_scale > 0 or not math.isfinite(rate_scale):
        raise TraceError(f"rate_scale must be a finite number > 0, got {rate_scale!r}")
    if block_tokens < 1:
        raise TraceError(f"block_tokens must be >= 1, got {block_tokens!r}")
    rows = read_mooncake(path)
    t0 = rows[0][0]
    parents = infer_parents(rows, block_tokens) if sessions == "infer" else [None] * len(rows)
    owner: list[TraceSession] = []
    trace: list[TraceSession] = []
    for j, ((stamp, n_in, n_out, hashes), parent) in enumerate(zip(rows, parents, strict=True)):
        at = (stamp - t0) / 1000 / rate_scale
        call = Call(hashes, (), n_in, n_out, not_before_s=at)
        if parent is None:
            session = TraceSession(f"r{j}", "mooncake", at, [call])
            trace.append(session)
        else:
            session = owner[parent]
            session.calls.append(call)
        owner.append(session)
    return trace
