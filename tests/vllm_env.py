"""vLLM's environment for the replica-on-vLLM tests: present, or a skip that says so.

`.ci/run` makes it (`make vllm`) and sets BURSTRL_REQUIRE_VLLM, so in CI a missing environment is
a failure, never a silent skip.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from burstrl.config.vllm import VllmSection
from burstrl.inference.vllm.process import VllmStartError, vllm_python


def require_vllm() -> str:
    """vLLM's interpreter; skips the test (fails it under BURSTRL_REQUIRE_VLLM) when there is none."""
    try:
        return vllm_python(VllmSection())
    except VllmStartError:
        if os.environ.get("BURSTRL_REQUIRE_VLLM"):
            pytest.fail("BURSTRL_REQUIRE_VLLM is set but vLLM's environment is missing (make vllm)")
        pytest.skip("vLLM's environment is missing: run `make vllm`")


@contextlib.contextmanager
def vllm_slot() -> Iterator[None]:
    """Held while a test runs a vLLM server: one at a time on this machine, across xdist workers
    (and suites).

    Why: a vLLM replica of Gemma holds ~5 GiB (its worker's weights, KV and buffers, its API
    server), and its OpenMP threads spin on the cores they are bound to. Three at once took the
    24 GiB machine to Ray's memory monitor, which killed a Ray test's actors (CI of 17de2e8), and
    two at once took longer than the same two one after the other (435 s + 556 s vs 221 s + 273 s).
    """
    path = Path(tempfile.gettempdir()) / f"burstrl-tests-vllm-{os.getuid()}.lock"
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # released when the file closes, and by the kernel if the worker dies
        yield
