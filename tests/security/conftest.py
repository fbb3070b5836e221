"""Security suite: attacks from inside a sandbox that must fail (issue 15).

`BACKENDS` names every backend the suite runs against; `open_backend` makes one with a short
state dir under /tmp (the socket path must fit in 107 bytes) or skips with the runtime's own
error where it cannot run here (e.g. runsc not installed), measured at test time. CI names the
backends it installed in $BURSTRL_REQUIRE_BACKENDS: those fail instead of skipping, so a suite
that silently stopped running on a backend cannot pass there.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

BACKENDS = ["namespace", "oci-runc", "oci-runsc"]


def open_backend(kind: str) -> tuple[Any, Path]:
    """(backend, state dir) for `kind` ("namespace" or "oci-<runtime>"); skips where it cannot run."""
    from burstrl.sandbox.backends import make_backend

    required = kind in os.environ.get("BURSTRL_REQUIRE_BACKENDS", "").split(",")
    skip = pytest.fail if required else pytest.skip
    if shutil.which("bwrap") is None:
        skip("bubblewrap (bwrap) is not installed")
    state = Path(tempfile.mkdtemp(prefix="sbx", dir="/tmp"))
    if kind == "namespace":
        return make_backend("namespace", state_dir=state), state
    from burstrl.sandbox.backends.oci import runtime_works

    runtime = kind.removeprefix("oci-")
    ok, reason = runtime_works(runtime, state)
    if not ok:
        shutil.rmtree(state, ignore_errors=True)
        skip(reason)
    return make_backend("oci", state_dir=state, runtime=runtime), state


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> Iterator[Any]:
    """Each backend in turn, shared by a module's tests."""
    backend, state = open_backend(request.param)
    yield backend
    shutil.rmtree(state, ignore_errors=True)
