"""Reading a replica's load report (`/v1/loads`): its block summary and which placements it shows.

Why apart from the registry: a scrape's answer is a snapshot taken some time after it was sent,
while placements keep landing; deciding which of the router's own recent placements the answer
already reflects is a small rule of its own, and the block summary is untrusted input.
"""

from __future__ import annotations

from typing import Any

from burstrl.router.policies import NewSession, ReplicaView

MAX_SUMMARY_BLOCKS = 1 << 20  # a replica's block summary beyond this is not a cache, it is an attack


def shown(placement: NewSession, view: ReplicaView) -> bool:
    """Whether a scrape's answer reflects a placement: its session listed, its prompt's blocks cached."""
    listed = not placement.id or placement.id in view.live_sessions
    return listed and (not placement.prefix_hashes or placement.prefix_hashes[-1] in view.cached_blocks)


def block_summary(loads: dict[str, Any]) -> frozenset[int]:
    """The prefix block keys a replica reports cached (`/v1/loads` `prefix_blocks.hashes`); empty if none."""
    summary = loads.get("prefix_blocks")
    hashes = summary.get("hashes", []) if isinstance(summary, dict) else []
    if not isinstance(hashes, list) or len(hashes) > MAX_SUMMARY_BLOCKS:
        raise ValueError("prefix_blocks.hashes must be a list of at most 2^20 integers")
    return frozenset(h for h in hashes if isinstance(h, int) and not isinstance(h, bool))


# Scrapes an earlier placement may stay unshown before it goes: its call can still be queued or
# prefilling on a loaded replica (one scrape was too few: at scrape_s 0.3 on a loaded 2-core
# machine, a 517-token prompt's prefill outlasted two scrapes, the placement was forgotten, and
# the next session with that prompt went to the other replica). A call that failed is forgotten
# after this many scrapes.
HOLD_SCRAPES = 8


def keep_recent(view: ReplicaView, mark: tuple[ReplicaView, int] | None) -> None:
    """After a scrape, the placements its answer may not show yet stay recent (`Registry.apply_scrape`).

    Kept: those recorded after the scrape was sent (`mark`, from `Registry.scrape_mark`), and,
    for up to HOLD_SCRAPES scrapes, earlier ones the answer does not show (`shown`); `held_over`
    counts the scrapes each of the leading ones has stayed. `view.cached_blocks` and
    `view.live_sessions` must already hold the answer.
    """
    recent = view.recent_assignments
    if mark is None:  # the simulator and the soak scrape instantly: the answer shows everything
        view.recent_assignments, view.held_over = [], []
        return
    after = view.assigned - mark[1] if mark[0] is view else view.assigned  # a re-registered view: all later
    after = min(max(after, 0), len(recent))
    earlier = recent[:len(recent) - after]
    held = view.held_over + [0] * (len(earlier) - len(view.held_over))
    kept = [(s, n + 1) for s, n in zip(earlier, held, strict=False) if n < HOLD_SCRAPES and not shown(s, view)]
    view.recent_assignments = [s for s, _ in kept] + recent[len(recent) - after:]
    view.held_over = [n for _, n in kept]
