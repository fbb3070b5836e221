"""vLLM's environment for the replica-on-vLLM tests: present, or a skip that says so.

`.ci/run` makes it (`make vllm`) and sets BURSTRL_REQUIRE_VLLM, so in CI a missing environment is
a failure, never a silent skip.
"""

from __future__ import annotations

import os

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
