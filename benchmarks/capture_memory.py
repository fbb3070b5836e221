"""Capture memory benchmark: what a long session's capture holds, as deltas against whole prompts.

Issue 36, finding 4: every call stored its whole prompt ids as Python lists, so a session of N calls
held O(N^2) ids (400 one-token calls stored 1.6M ids, ~130 KB of RSS per call). Captures are now
deltas in `array`s (`burstrl.inference.capture`). This replays the issue's session against both
layouts side by side in one process, in the replica's own `SessionTable`:

- `deltas`: `SessionTable.capture` as the replica runs it (each record keeps the ids after the part
  it shares with the previous call's prompt + completion);
- `whole_lists`: the layout before the fix, rebuilt here: per call a record holding `list(prompt)`,
  `list(completion)` and `list(logprobs)`.

Session: a first prompt of `--prompt` ids, then `--calls` calls of one sampled id each, every prompt
extending the last by that id and one new one (an agent's tool turn at its smallest). Memory is
`tracemalloc`'s traced bytes after the session minus before (Python allocations only, no RSS noise);
ids stored are counted from the records.

    .venv/bin/python benchmarks/capture_memory.py               # the issue's 400 calls, 4k-id prompt
    .venv/bin/python benchmarks/capture_memory.py --calls 2000
"""

from __future__ import annotations

import argparse
import json
import tracemalloc
from collections.abc import Callable

from burstrl.inference.capture import new_record
from burstrl.inference.sessions import SessionTable


def session_prompts(first: int, calls: int) -> list[tuple[list[int], list[int]]]:
    """(prompt, completion) per call; each prompt = the last prompt + its completion + one new id."""
    out, prompt = [], list(range(100, 100 + first))
    for i in range(calls):
        completion = [7 + i % 13]
        out.append((prompt, completion))
        prompt = [*prompt, *completion, 30 + i % 17]
    return out


def deltas(session: list[tuple[list[int], list[int]]]) -> tuple[int, object]:
    table = SessionTable(ttl_s=3600)
    for i, (prompt, completion) in enumerate(session):
        s = table.begin("s", "base", f"r{i}")
        table.capture(s, new_record(f"r{i}", "base", prompt, completion, [-0.5] * len(completion),
                                    finish_reason="length", cached_tokens=0, timings={}, created=0.0))
        table.end(s)
    return table.captured_tokens, table


def whole_lists(session: list[tuple[list[int], list[int]]]) -> tuple[int, object]:
    records = [{"prompt_ids": list(p), "completion_ids": list(c), "logprobs": [-0.5] * len(c)} for p, c in session]
    return sum(len(r["prompt_ids"]) + len(r["completion_ids"]) for r in records), records


def measure(store: Callable[[list], tuple[int, object]], session: list) -> dict[str, float]:
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    ids, kept = store(session)
    grown = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    del kept
    return {"ids_stored": ids, "bytes": grown, "bytes_per_call": grown / len(session)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=400)
    ap.add_argument("--prompt", type=int, default=4000)
    args = ap.parse_args()
    session = session_prompts(args.prompt, args.calls)
    out = {"calls": args.calls, "first_prompt_ids": args.prompt,
           "deltas": measure(deltas, session), "whole_lists": measure(whole_lists, session)}
    out["ratio_bytes_whole_over_deltas"] = out["whole_lists"]["bytes"] / out["deltas"]["bytes"]
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
