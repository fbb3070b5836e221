"""Gemma 3 270M served in bf16 by the built-in engine (issue 50, "bf16 on both engines").

The start probe's reference is the fp32 forward of the served weights and its 16-bit bound is set
against HF's own bf16 forward (inference/probe.py): a bf16 replica starts, serves, captures
logprobs near the fp32 forward, loads a LoRA version (proven in bf16 too); and the same probe
still refuses a wrong path on the real model.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.http_client import HTTP

from .conftest import Server, start_server, stop_server
from .test_gemma import captured_vs_reference, complete

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(gemma_model: Path, tmp_path_factory: pytest.TempPathFactory):
    srv = start_server(gemma_model, tmp_path_factory.mktemp("gemma-bf16-replica"),
                       "--model.dtype", "bfloat16", "--engine.max_total_num_tokens", "2048")
    yield srv
    stop_server(srv)


def test_a_bf16_gemma_replica_starts_serves_and_captures_near_the_fp32_forward(
        server: Server, gemma_model: Path, tmp_path: Path) -> None:
    from peft import get_peft_model

    from burstrl.model.hf import load_model
    from burstrl.model.lora import lora_config

    assert HTTP.get(server.url + "/v1/models", timeout=30).json()["engine_path"] == "fast"
    answer = complete(server, "Question: What is 12 + 7?\nAnswer:", max_tokens=12, temperature=0)
    assert "19" in answer["choices"][0]["text"], answer["choices"][0]["text"]
    complete(server, "def fibonacci(n):\n   ", session="bf16-a", max_tokens=24, temperature=1.0, seed=1)
    calls = server.get("/v1/traces/bf16-a?full=true")["calls"]
    fp32 = load_model(gemma_model, "float32", "cpu")
    assert captured_vs_reference(fp32, calls) < 1.0  # bf16 rounding, not another model (fp32: < 1e-4)
    torch.manual_seed(1)
    peft = get_peft_model(fp32, lora_config(8, init_random=True), adapter_name="policy-v1")
    with torch.no_grad():
        for name, param in peft.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.02)
    peft.save_pretrained(str(tmp_path))
    r = HTTP.post(server.url + "/v1/load_lora_adapter", headers=server.admin(), timeout=600,
                  json={"lora_name": "policy-v1", "lora_path": str(tmp_path / "policy-v1")})  # PEFT's folder
    assert r.status_code == 200, r.text  # proven against the fp32 forward with the adapter


def test_the_bf16_probe_refuses_a_wrong_rope_on_gemma(gemma_model: Path) -> None:
    """The bf16 bound is loose enough for the real model's rounding and tight enough that one
    layer given the other layer type's rope table is refused."""
    from burstrl.inference.probe import mismatch, own_logprobs, probe_ids, reference_logprobs
    from burstrl.inference.runner import ModelRunner
    from burstrl.model.hf import load_model

    model = load_model(gemma_model, "bfloat16", "cpu")
    ids = probe_ids(model.config.vocab_size)
    reference, own = reference_logprobs(model, ids), own_logprobs(model, ids)
    runner = ModelRunner(model)
    assert mismatch(runner, reference, ids, own=own)[0] is None
    first = runner.fused[0]
    first.rope = next(f.rope for f in runner.fused if f.rope != first.rope)
    problem, _ = mismatch(runner, reference, ids, own=own)
    assert problem is not None and "median KL" in problem
