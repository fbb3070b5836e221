"""Activation checkpointing modes on a tiny Qwen3 + LoRA: same gradients, L / 2L / L attention calls, memory."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from burstrl.trainer import recompute
from burstrl.trainer.memory import PeakMemory

MODES = ("none", "full", "attention")


def lora_model(model_dir: Path, mode: str, attention: str = "sdpa"):
    from peft import get_peft_model

    from burstrl.model.hf import load_model
    from burstrl.model.lora import lora_config

    torch.manual_seed(0)  # the same random LoRA A and B in every mode (B != 0: A gets gradients too)
    model = get_peft_model(load_model(model_dir, "float32", "cpu", attention), lora_config(8, init_random=True))
    model.train()
    return model, recompute.apply(model, mode)


def batch(seq: int, rows: int = 2, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(3, 2000, (rows, seq), generator=torch.Generator().manual_seed(seed))
    attn = torch.ones(rows, seq, dtype=torch.long)
    if rows > 1:
        attn[1, seq * 3 // 4:] = 0  # right padding, as the trainer packs
    return ids, attn


def train_step(model, rec: recompute.Recompute, ids: torch.Tensor, attn: torch.Tensor) -> None:
    rec.begin()
    logits = model(input_ids=ids, attention_mask=attn, use_cache=False).logits
    rec.verify()
    logp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])[..., 0]
    (-(logp * attn[:, 1:]).sum()).backward()


def lora_grads(model) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("attention", ["sdpa", "burstrl"])
def test_gradients_are_identical_in_every_mode(tiny_model_dir: Path, attention: str) -> None:
    ids, attn = batch(96)
    grads = {}
    for mode in MODES:
        model, rec = lora_model(tiny_model_dir, mode, attention)
        train_step(model, rec, ids, attn)
        grads[mode] = lora_grads(model)
    assert grads["none"] and all(g.abs().sum() > 0 for g in grads["none"].values())
    for mode in ("full", "attention"):
        assert grads[mode].keys() == grads["none"].keys()
        for name, g in grads["none"].items():
            assert torch.equal(grads[mode][name], g), f"{mode}: {name} differs"


@pytest.mark.parametrize("attention", ["sdpa", "burstrl"])
def test_attention_runs_once_per_layer_except_under_full_checkpointing(tiny_model_dir: Path, attention: str) -> None:
    ids, attn = batch(64)
    layers = 4
    calls, saved = {}, {}
    for mode in MODES:
        model, rec = lora_model(tiny_model_dir, mode, attention)
        calls[mode] = recompute.count_attention_calls(lambda model=model, rec=rec: train_step(model, rec, ids, attn))
        saved[mode] = rec.saved
    assert calls == {"none": layers, "full": 2 * layers, "attention": layers}
    assert saved == {"none": 0, "full": 0, "attention": layers}


def test_an_attention_kernel_the_policy_cannot_see_fails_loudly(tiny_model_dir: Path) -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    ids, attn = batch(32)
    model, rec = lora_model(tiny_model_dir, "attention")
    with sdpa_kernel(SDPBackend.MATH):  # SDPA as matmul + softmax: no attention op to keep
        with pytest.raises(recompute.RecomputeError, match="saved 0 attention outputs in one forward, expected 4"):
            train_step(model, rec, ids, attn)
    full, rec_full = lora_model(tiny_model_dir, "full")
    with sdpa_kernel(SDPBackend.MATH):
        train_step(full, rec_full, ids, attn)  # nothing to verify without the selective policy


def test_mode_switches_and_bad_modes(tiny_model_dir: Path) -> None:
    model, rec = lora_model(tiny_model_dir, "attention")
    assert rec.layers == 4 and model.get_base_model().is_activation_checkpointing
    assert recompute.apply(model, "none").layers == 0 and not model.get_base_model().is_activation_checkpointing
    with pytest.raises(ValueError, match="unknown activation_checkpointing 'selective'"):
        recompute.apply(model, "selective")


@pytest.mark.slow  # a forward and backward of 2048 and 4096 tokens per mode: ~25 s each
@pytest.mark.parametrize("seq", [2048, 4096])
def test_attention_keeps_out_and_lse_per_layer_on_top_of_full(tiny_model_dir: Path, seq: int) -> None:
    ids, attn = batch(seq, rows=1)
    peak = {}
    for mode in MODES:
        model, rec = lora_model(tiny_model_dir, mode)
        with PeakMemory() as mem:
            train_step(model, rec, ids, attn)
        peak[mode] = mem.peak
    layers, heads, head_dim = 4, 4, 32
    expected = (layers - 1) * seq * heads * (4 * head_dim + 4)  # out (fp32) + lse per layer
    extra = peak["attention"] - peak["full"]
    assert 0.5 * expected <= extra <= 1.5 * expected, (peak, expected)
    assert peak["none"] > 1.5 * peak["attention"]


def test_peak_memory_counts_what_the_code_allocates_and_frees() -> None:
    keep = torch.zeros(1000)  # made before: not counted
    with PeakMemory() as mem:
        a = torch.ones(1 << 20)  # 4 MiB
        b = a * 2  # 4 MiB
        a.add_(1)  # in place: nothing new
        view = b[:10]
        del a
        c = keep + 1  # 4000 B
    assert mem.peak == 2 * (4 << 20)
    assert mem.live == (4 << 20) + 4000
    del b, view, c
    assert mem.live == 0


@pytest.mark.gpu
@pytest.mark.parametrize("attention", ["sdpa", "burstrl"])
def test_on_cuda_in_bf16_attention_keeps_one_output_per_layer_and_matches_none(tiny_model_dir: Path,
                                                                               attention: str) -> None:
    """CUDA's SDPA ops (flash / efficient / cuDNN) and the custom op are seen and kept; grads agree."""
    from peft import get_peft_model

    from burstrl.model.hf import load_model
    from burstrl.model.lora import lora_config

    ids, attn = batch(512, rows=1)
    ids, attn = ids.cuda(), attn.cuda()
    grads = {}
    for mode in MODES:
        torch.manual_seed(0)
        model = get_peft_model(load_model(tiny_model_dir, "bfloat16", "cuda", attention),
                               lora_config(8, init_random=True)).train()
        rec = recompute.apply(model, mode)
        calls = recompute.count_attention_calls(lambda model=model, rec=rec: train_step(model, rec, ids, attn))
        assert calls == (8 if mode == "full" else 4) and rec.saved == (4 if mode == "attention" else 0)
        grads[mode] = lora_grads(model)
    for name, g in grads["none"].items():
        assert torch.allclose(grads["attention"][name].float(), g.float(), atol=1e-2, rtol=1e-2), name


@pytest.fixture(scope="module")
def tiny_gemma3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random Gemma 3 text model: a 6-token sliding window on layer 0 (shorter than the batch), global layer 1."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    cfg = Gemma3TextConfig(vocab_size=2048, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=1, head_dim=16, max_position_embeddings=256,
                           sliding_window=6, query_pre_attn_scalar=16,
                           layer_types=["sliding_attention", "full_attention"])
    out = tmp_path_factory.mktemp("gemma3")
    Gemma3ForCausalLM(cfg).save_pretrained(out)
    return out


def test_sliding_windows_keep_gradients_exact_under_attention_recompute(tiny_gemma3_dir: Path) -> None:
    """Gemma 3's module names take the trainer's LoRA; the burstrl attention op (what "attention"
    checkpointing keeps) honours the sliding window: its gradients equal sdpa attention's, and
    recomputing changes nothing."""
    ids, attn = batch(40)
    grads = {}
    for attention, mode in (("sdpa", "none"), ("burstrl", "none"), ("burstrl", "attention")):
        model, rec = lora_model(tiny_gemma3_dir, mode, attention)
        train_step(model, rec, ids, attn)
        grads[attention, mode] = lora_grads(model)
    ref = grads["sdpa", "none"]
    assert len(ref) == 2 * 7 * 2 and all(g.abs().sum() > 0 for g in ref.values())  # A and B on all 7 projections
    for name, g in ref.items():
        assert torch.equal(grads["burstrl", "attention"][name], grads["burstrl", "none"][name]), name
        assert torch.allclose(grads["burstrl", "none"][name], g, rtol=1e-4, atol=1e-6), name
