"""The launcher's polls end by their deadline, however slowly the router or a replica answers (issue 49, item 5).

`run._get_json` is the supervising loop's 1 Hz router poll and `fleet._live_sessions` the drain loop's
replica poll: before, httpx's per-read timeout let a peer dripping a byte per read hold either loop.
"""

from __future__ import annotations

import time

from burstrl.deadline import sync_client
from burstrl.launcher.fleet import _live_sessions
from burstrl.launcher.run import _get_json

from .test_deadline import DRIP_FOR, DRIP_S
from .test_orchestrator_deadlines import base  # noqa: F401 (the dripping server, a fixture)

SLACK = 1.2


def test_the_router_poll_ends_by_its_deadline(base: str) -> None:  # noqa: F811
    assert DRIP_FOR * DRIP_S > 2.0 + SLACK  # the drip outlasts the bound asserted below
    with sync_client(timeout=2.0) as client:
        start = time.monotonic()
        assert _get_json(client, base + "/drip-body") is None
        assert time.monotonic() - start < 2.0 + SLACK
        assert _get_json(client, base + "/ok") is None  # not JSON: None, as before


def test_the_drain_poll_ends_by_its_deadline(base: str) -> None:  # noqa: F811
    assert 3 * DRIP_FOR * DRIP_S > 5.0 + SLACK
    with sync_client() as client:
        start = time.monotonic()
        assert _live_sessions(client, base + "/drip-long") == 0
        assert time.monotonic() - start < 5.0 + SLACK
