"""The real model: Gemma 3 270M (pretrained, imported from its GGUF package) served by one replica.

One replica serves the module (its start, with the probe, is most of the cost). What it shows: the
engine picks a proven path for a real checkpoint (the generic one: Gemma 3's layout is not the fast
runner's), greedy text is the pretrained model's, and captured logprobs equal an fp32 HF forward
over a session that runs past the 512-token sliding window (the second call prefills only its
suffix from the session cache).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.http_client import HTTP

from .conftest import Server, sampled_logprobs, start_server, stop_server

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(gemma_model: Path, tmp_path_factory: pytest.TempPathFactory):
    srv = start_server(gemma_model, tmp_path_factory.mktemp("gemma-replica"),
                       "--engine.max_total_num_tokens", "4096")
    yield srv
    stop_server(srv)


def complete(server: Server, prompt: str, session: str | None = None, **kw) -> dict:
    body = {"model": "base", "prompt": prompt, "logprobs": 1, "return_token_ids": True, **kw}
    if session:
        body["session_id"] = session
    r = HTTP.post(server.url + "/v1/completions", json=body, timeout=600)
    assert r.status_code == 200, r.text
    return r.json()


def test_gemma_runs_on_a_proven_path_and_writes_what_the_pretrained_model_writes(server: Server) -> None:
    assert HTTP.get(server.url + "/v1/models", timeout=30).json()["engine_path"] == "generic"
    answer = complete(server, "Question: What is 12 + 7?\nAnswer:", max_tokens=12, temperature=0)
    assert "19" in answer["choices"][0]["text"], answer["choices"][0]["text"]


def test_gemma_captured_logprobs_equal_an_fp32_forward_past_the_window(server: Server, gemma_model: Path) -> None:
    story = " ".join(f"Line {i}: the robot counted {i * 7 % 13} bolts." for i in range(60))  # ~600 tokens
    first = complete(server, story, session="gemma-window", max_tokens=12, temperature=1.0, seed=1)
    second_prompt = story + first["choices"][0]["text"] + " Then the robot said:"
    complete(server, second_prompt, session="gemma-window", max_tokens=12, temperature=1.0, seed=2)
    calls = server.get("/v1/traces/gemma-window")["calls"]
    assert len(calls[0]["prompt_ids"]) > 512 and calls[1]["cached_tokens"] > 512

    from burstrl.model.hf import load_model

    model = load_model(gemma_model, "float32", "cpu")
    for call in calls:
        want = sampled_logprobs(model, call["prompt_ids"] + call["completion_ids"], len(call["prompt_ids"]))
        assert (torch.tensor(call["logprobs"]) - want).abs().max().item() < 1e-4
