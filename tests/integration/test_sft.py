import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from burstrl.envs import toy, toy_warm
from burstrl.envs.toy_warm import ensure_warm_model
from burstrl.model.hf import eos_token_ids, load_model, load_tokenizer
from burstrl.trainer import sft as sft_mod
from burstrl.trainer.sft import (
    IGNORE,
    SFTDataError,
    encode_conversation,
    load_conversations,
    sft,
)


def _demos(tmp_path: Path, n: int = 48) -> Path:
    return toy.write_jsonl(toy.demonstrations(toy.make_tasks(n, seed=0)), tmp_path / "demos.jsonl")


def _labelled_spans(tokenizer, example) -> list[str]:
    """Decode each run of consecutive labelled positions."""
    spans, current = [], []
    for token, label in zip(example.input_ids, example.labels, strict=False):
        if label == IGNORE:
            if current:
                spans.append(current)
            current = []
        else:
            assert label == token
            current.append(token)
    if current:
        spans.append(current)
    return [tokenizer.decode(span) for span in spans]


def test_loss_mask_is_exactly_the_assistant_replies_and_their_end_token(tiny_model_dir):
    tokenizer = load_tokenizer(tiny_model_dir)
    chat = [
        {"role": "system", "content": "Copy."},
        {"role": "user", "content": "Repeat the letter: K"},
        {"role": "assistant", "content": "K"},
        {"role": "user", "content": "Repeat the letters: QZ"},
        {"role": "assistant", "content": "Q Z, done"},
    ]
    example = encode_conversation(tokenizer, chat)
    assert example.input_ids == tokenizer.apply_chat_template(chat, tokenize=True, return_dict=False)
    assert _labelled_spans(tokenizer, example) == ["K<|im_end|>", "Q Z, done<|im_end|>"]
    # The newline after each <|im_end|> is the template's, never generated: not trained on.
    reply_tokens = len(tokenizer.encode("K")) + len(tokenizer.encode("Q Z, done")) + 2
    assert sum(label != IGNORE for label in example.labels) == reply_tokens


def test_sft_lowers_the_loss_and_writes_a_loadable_model(tiny_model_dir, tmp_path):
    out = sft(tiny_model_dir, _demos(tmp_path), tmp_path / "out", steps=30, lr=1e-3, batch_size=8,
              log_every=10, device="cpu")
    recipe = json.loads((out / sft_mod.SFT_MARKER).read_text())
    assert recipe["steps"] == 30 and recipe["examples"] == 48
    assert recipe["final_loss"] < 0.7 * recipe["first_loss"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.tmp-")]

    tokenizer = load_tokenizer(out)
    model = load_model(out, "float32", "cpu")
    base = load_model(tiny_model_dir, "float32", "cpu")
    assert eos_token_ids(out, tokenizer) == eos_token_ids(tiny_model_dir, tokenizer)
    examples = [encode_conversation(tokenizer, c) for c in load_conversations(tmp_path / "demos.jsonl")]
    batch = sft_mod.collate(examples, tokenizer.pad_token_id, torch.device("cpu"))
    with torch.no_grad():
        assert model(**batch).loss < base(**batch).loss
    with pytest.raises(FileExistsError):  # never overwrites a model by accident
        sft(tiny_model_dir, tmp_path / "demos.jsonl", out, steps=1)


def test_sft_lora_writes_a_peft_adapter_the_engine_loads(tiny_model_dir, tmp_path):
    from burstrl.inference.lora import load_adapter

    out = sft(tiny_model_dir, _demos(tmp_path, 16), tmp_path / "adapter", steps=3, lr=1e-3,
              batch_size=4, lora=True, device="cpu")
    assert (out / "adapter_config.json").is_file() and not (out / "config.json").exists()
    adapter = load_adapter("sft", out, num_layers=4, dtype=torch.float32, device=torch.device("cpu"))
    assert adapter.rank == 8
    assert any(b.abs().sum() > 0 for _, b, _ in adapter.weights.values())  # B moved off zero


def _burstrl(*args: str) -> subprocess.CompletedProcess:
    script = Path(sys.executable).parent / "burstrl"
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "burstrl.cli"]
    env = {**os.environ, "NO_COLOR": "1", "COLUMNS": "200"}
    return subprocess.run(cmd + list(args), capture_output=True, text=True, timeout=120, env=env)


@pytest.mark.slow  # a `burstrl sft` process: ~5-10 s
def test_cli_names_the_bad_line_and_exits_2(tiny_model_dir, tmp_path):
    good = json.dumps(toy.demonstrations(toy.make_tasks(1, seed=0))[0])
    data = tmp_path / "bad.jsonl"
    data.write_text(f"{good}\n\n{good}\n{{not json\n")
    result = _burstrl("sft", "--model", str(tiny_model_dir), "--data", str(data),
                      "--out", str(tmp_path / "o"))
    assert result.returncode == 2
    assert f"{data}:4:" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    "text, error",
    [
        ('{"messages": [{"role": "user", "content": "hi"}]}\n', ":1: no assistant message"),
        ('{"messages": [{"role": "assistant"}]}\n', ":1: each message needs a string role and string"),
        ('[1, 2]\n', ':1: expected an object with a "messages" list'),
        ("\n\n", ": no demonstrations"),
    ],
)
def test_bad_demonstrations_are_named(tmp_path, text, error):
    data = tmp_path / "d.jsonl"
    data.write_text(text)
    with pytest.raises(SFTDataError, match=re.escape(f"{data}{error}")):
        load_conversations(data)
    with pytest.raises(SFTDataError, match="no such file"):
        load_conversations(tmp_path / "missing.jsonl")


@pytest.mark.slow  # a `burstrl sft` process: ~5-10 s
def test_cli_sft_writes_a_model(tiny_model_dir, tmp_path):
    result = _burstrl("sft", "--model", str(tiny_model_dir), "--data", str(_demos(tmp_path, 8)),
                      "--out", str(tmp_path / "o"), "--steps", "2", "--batch-size", "4", "--log-every", "1")
    assert result.returncode == 0, result.stderr
    assert "step 2/2 loss" in result.stderr
    assert (tmp_path / "o" / "model.safetensors").is_file()


def test_warm_model_lands_in_its_target_band_and_is_cached(warm_model, tiny_model_dir, tmp_path):
    """The suite's shared warm model (built once per cache by `ensure_warm_model`, the code under
    test) is in its band; a copy of it is found cached, and publishing over it behaves."""
    marker = json.loads((warm_model / toy_warm.WARM_MARKER).read_text())
    assert 0.2 <= marker["mean_reward"] <= 0.6
    assert marker["base_mean_reward"] < 0.1
    assert marker["sampled_groups_with_variance"] > 0.5  # GRPO gets a signal from most groups

    out = tmp_path / "warm"
    shutil.copytree(warm_model, out)
    start = time.perf_counter()
    assert ensure_warm_model(tiny_model_dir, out) == out  # cached: no training
    assert time.perf_counter() - start < 2

    # A racing builder that finishes second uses the winner's identical model; a different
    # recipe in the way is an error, not an overwrite.
    model, tokenizer = load_model(out, "float32", "cpu"), load_tokenizer(out)
    assert toy_warm._publish_warm(model, tokenizer, out, marker, stale=False) == out
    with pytest.raises(FileExistsError):
        toy_warm._publish_warm(model, tokenizer, out, {**marker, "recipe": {"other": 1}}, stale=False)
    assert [p.name for p in tmp_path.iterdir()] == ["warm"]


def test_warm_model_never_overwrites_a_directory_it_did_not_build(tiny_model_dir, tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError):
        ensure_warm_model(tiny_model_dir, tmp_path / "mine")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"
