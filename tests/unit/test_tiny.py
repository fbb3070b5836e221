import json

import pytest
import torch

from burstrl.model import hf
from burstrl.model.tiny import ENDOFTEXT, IM_END, IM_START, RECIPE_FILE, ensure_tiny_model, make_tiny_model


def test_loads_through_hf_path(tiny_model_dir):
    model = hf.load_model(tiny_model_dir)
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert not model.training
    assert model.dtype == torch.float32 and model.device.type == "cpu"
    assert model.config.num_hidden_layers == 4 and model.config.hidden_size == 128
    assert 0.8e6 < model.num_parameters() < 1.3e6


def test_forward_gives_logits(tiny_model_dir):
    model = hf.load_model(tiny_model_dir)
    tokenizer = hf.load_tokenizer(tiny_model_dir)
    ids = tokenizer.encode("1 + 2 = 3")
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), model.config.vocab_size)
    assert model.config.vocab_size == len(tokenizer) == 2048


def test_special_tokens_are_single_ids(tiny_model_dir):
    tokenizer = hf.load_tokenizer(tiny_model_dir)
    ids = [tokenizer.convert_tokens_to_ids(t) for t in (ENDOFTEXT, IM_START, IM_END)]
    for token, token_id in zip((ENDOFTEXT, IM_START, IM_END), ids, strict=False):
        assert tokenizer.encode(token) == [token_id]
    assert tokenizer.eos_token == IM_END and tokenizer.pad_token == ENDOFTEXT
    assert hf.eos_token_ids(tiny_model_dir, tokenizer) == [ids[2], ids[0]]
    assert hf.eos_token_ids(hf.load_model(tiny_model_dir), tokenizer) == [ids[2], ids[0]]


def test_chat_template_is_chatml(tiny_model_dir):
    tokenizer = hf.load_tokenizer(tiny_model_dir)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": [{"type": "text", "text": "And 3 + 3?"}]},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n"
        "<|im_start|>assistant\n4<|im_end|>\n"
        "<|im_start|>user\nAnd 3 + 3?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    no_prompt = tokenizer.apply_chat_template(messages[:1], tokenize=False)
    assert no_prompt == "<|im_start|>system\nBe brief.<|im_end|>\n"


def test_decode_round_trips_any_text(tiny_model_dir):
    tokenizer = hf.load_tokenizer(tiny_model_dir)
    for text in ["Hello , world . it 's  ok\t\n", "ünïcödé 日本語 🤖 \u200b\r\n", "x = [1, 2]  # ok\n    return x", ""]:
        assert tokenizer.decode(tokenizer.encode(text)) == text


def test_digits_are_single_tokens(tiny_model_dir):
    tokenizer = hf.load_tokenizer(tiny_model_dir)
    assert len(tokenizer.encode("12345")) == 5


def test_make_is_deterministic_and_atomic(tmp_path):
    a = make_tiny_model(tmp_path / "a", layers=1, hidden=64, vocab=512, seed=3)
    b = make_tiny_model(tmp_path / "b", layers=1, hidden=64, vocab=512, seed=3)
    for path in a.iterdir():
        assert path.read_bytes() == (b / path.name).read_bytes(), path.name
    with pytest.raises(FileExistsError):
        make_tiny_model(a, layers=1, hidden=64, vocab=512)
    c = make_tiny_model(a, layers=1, hidden=64, vocab=512, seed=4, force=True)
    assert (c / "model.safetensors").read_bytes() != (b / "model.safetensors").read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b"]


def test_ensure_reuses_and_replaces_stale(tmp_path):
    out = ensure_tiny_model(tmp_path / "m", layers=1, hidden=64, vocab=512)
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    assert ensure_tiny_model(out, layers=1, hidden=64, vocab=512) == out
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp
    recipe = json.loads((out / RECIPE_FILE).read_text())
    (out / RECIPE_FILE).write_text(json.dumps({**recipe, "recipe": -1}))
    ensure_tiny_model(out, layers=1, hidden=64, vocab=512)
    assert json.loads((out / RECIPE_FILE).read_text()) == recipe
