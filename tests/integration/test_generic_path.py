"""The generic path (the model's own forward, for architectures the fast runner lacks): proven at
start, served exactly.

The models are random-init and tiny (the tiny model's tokenizer): a Gemma 3 with a 6-token
sliding window on every other layer, served with `--engine.path generic` (the fast runner proves
Gemma 3 too; test_gemma.py serves the real model on it), so two turns of a session run well past
the window, and a Gemma 2, whose attention logit softcapping no engine path computes, so its
replica must refuse to start.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from burstrl.model.lora import make_random_adapter
from burstrl.protocol import process
from tests.http_client import HTTP

from .conftest import Server, reference_logprobs, start_server, stop_server

pytestmark = pytest.mark.slow
SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=1, head_dim=32, max_position_embeddings=1024, initializer_range=0.1)


def make_model(kind: str, tiny_model_dir: Path, out: Path, **config: object) -> Path:
    """A random `kind` ("gemma3" or "gemma2") model with the tiny model's tokenizer and chat template
    (`config`: fields over SHAPE's)."""
    from transformers import AutoTokenizer, Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    ids = dict(vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
               pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    if kind == "gemma3":
        cfg = Gemma3TextConfig(**{**SHAPE, **config}, **ids, sliding_window=6, query_pre_attn_scalar=32,
                               layer_types=["sliding_attention", "full_attention"] * 2)
        model = Gemma3ForCausalLM(cfg)
    else:
        model = Gemma2ForCausalLM(Gemma2Config(**{**SHAPE, **config}, **ids, sliding_window=6, query_pre_attn_scalar=32))
    model.save_pretrained(out)
    tok.save_pretrained(out)
    shutil.copy(tiny_model_dir / "chat_template.jinja", out / "chat_template.jinja")
    return out


@pytest.fixture(scope="module")
def gemma3(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model("gemma3", tiny_model_dir, tmp_path_factory.mktemp("gemma3"))


@pytest.fixture(scope="module")
def server(gemma3: Path, tmp_path_factory: pytest.TempPathFactory):
    adapter = make_random_adapter(gemma3, tmp_path_factory.mktemp("gemma3-lora") / "policy-v1", seed=1)
    srv = start_server(gemma3, tmp_path_factory.mktemp("gemma3-replica"), "--engine.path", "generic")
    r = HTTP.post(srv.url + "/v1/load_lora_adapter", headers=srv.admin(), timeout=60,
                  json={"lora_name": "policy-v1", "lora_path": str(adapter)})
    assert r.status_code == 200, r.text
    srv.adapter = adapter
    yield srv
    stop_server(srv)


@pytest.mark.parametrize("version", ["base", "policy-v1"])
def test_gemma3_sessions_past_the_window_capture_exact_logprobs(server: Server, gemma3: Path,
                                                               version: str) -> None:
    """Two sampled turns of one session (the second prefills only its suffix, from the session
    cache), 40+ tokens against a 6-token window, base and a LoRA version: |dlogp| < 1e-4."""
    assert HTTP.get(server.url + "/v1/models", timeout=30).json()["engine_path"] == "generic"
    session, messages = f"g3-{version}", [{"role": "user", "content": "Tell me about the robot."}]
    for turn in range(2):
        body = {"model": version, "messages": messages, "session_id": session, "return_token_ids": True,
                "logprobs": True, "max_tokens": 24, "temperature": 1.0, "seed": turn, "ignore_eos": True}
        r = HTTP.post(server.url + "/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        messages += [r.json()["choices"][0]["message"], {"role": "user", "content": "And then?"}]
    calls = server.get(f"/v1/traces/{session}?full=true")["calls"]
    assert calls[1]["cached_tokens"] > 6 and len(calls[1]["prompt_ids"]) > 40
    for call in calls:
        ids = call["prompt_ids"] + call["completion_ids"]
        want = reference_logprobs(gemma3, server.adapter if version != "base" else None, ids, len(call["prompt_ids"]))
        assert (torch.tensor(call["logprobs"]) - want).abs().max().item() < 1e-4


def test_a_model_no_path_computes_is_refused_before_ready(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Gemma 2's attention softcapping: the fast path computes other numbers, the generic path's
    attention refuses it (on the one-token forward that reads the layers' windows), so the replica exits naming both instead of ever reporting ready."""
    model = make_model("gemma2", tiny_model_dir, tmp_path / "gemma2")
    with pytest.raises(RuntimeError) as err:
        process.start_replica(model, tmp_path / "replica", "--engine.num_threads", "1")
    text = str(err.value) + (tmp_path / "replica" / "serve.log").read_text()
    assert "no engine path computes this model" in text
    assert "fast: attention logit softcapping is not supported" in text
    assert "generic: attention logit softcapping is not supported by the engine's attention" in text
