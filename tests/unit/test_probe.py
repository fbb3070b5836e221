"""The start-up proof of the engine's paths (inference/probe.py) and sliding-window attention."""

from __future__ import annotations

import pytest
import torch

from burstrl.inference.dense import DecodeBatch, SessionKV
from burstrl.inference.generic import GenericRunner
from burstrl.inference.lora import ATTN_PROJ, MLP_PROJ, LoraAdapter, LoraBatch
from burstrl.inference.paged import KVPool, SequenceKV
from burstrl.inference.paged_attention import PagedDecode
from burstrl.inference.probe import (
    adapter_mismatch,
    fp32_reference,
    median_kl,
    mismatch,
    own_logprobs,
    probe_ids,
    reference_logprobs,
    select_runner,
)
from burstrl.inference.runner import ModelRunner, UnsupportedModel, _Norm, causal_attention

SHAPE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=128)


def test_a_qwen3_model_runs_on_the_fast_path() -> None:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    runner, err = select_runner(Qwen3ForCausalLM(Qwen3Config(**SHAPE)).eval())
    assert runner.path == "fast" and err < 1e-4


def test_silently_wrong_math_on_the_fast_path_is_caught_and_the_generic_path_serves() -> None:
    """Granite has every module the fast runner looks for, so it runs without an error, but its
    forward multiplies the embeddings and each residual branch by constants the fast runner does
    not know: other numbers. The probe sees them."""
    from transformers import GraniteConfig, GraniteForCausalLM

    torch.manual_seed(0)
    model = GraniteForCausalLM(GraniteConfig(**SHAPE, embedding_multiplier=3.0, residual_multiplier=0.5)).eval()
    ids = probe_ids(256)
    problem, err = mismatch(ModelRunner(model), reference_logprobs(model, ids), ids)
    assert problem is not None and "differ from the model's own forward" in problem and err > 0.01
    runner, err = select_runner(model)
    assert runner.path == "generic" and err < 1e-4


def test_a_named_path_is_the_only_one_tried() -> None:
    """`engine.path`: "generic" serves a model the fast runner could; "fast" refuses one it cannot."""
    from transformers import GraniteConfig, GraniteForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    runner, err = select_runner(Qwen3ForCausalLM(Qwen3Config(**SHAPE)).eval(), "generic")
    assert runner.path == "generic" and err < 1e-4
    granite = GraniteForCausalLM(GraniteConfig(**SHAPE, embedding_multiplier=3.0)).eval()
    with pytest.raises(UnsupportedModel, match="no engine path computes.*fast path's log-probabilities differ"):
        select_runner(granite, "fast")


def test_gemma_1s_norms_and_scaled_embeddings_run_on_the_fast_path() -> None:
    from transformers import GemmaConfig, GemmaForCausalLM

    torch.manual_seed(0)
    model = GemmaForCausalLM(GemmaConfig(**SHAPE)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    runner, err = select_runner(model)
    assert runner.path == "fast" and err < 1e-4


def gemma3(window: int) -> torch.nn.Module:
    """A random Gemma 3 with weights far from their init (norm weights near 0 would hide a norm
    computed as w instead of 1 + w), one sliding and one global layer."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    cfg = Gemma3TextConfig(**SHAPE, sliding_window=window, query_pre_attn_scalar=16, rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
        "full_attention": {"rope_type": "default", "rope_theta": 10000.0}},
        layer_types=["sliding_attention", "full_attention"])
    model = Gemma3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    return model


def test_gemma3_runs_on_the_fast_path_with_windows_shorter_than_the_probe() -> None:
    """Four norms as (1 + w) in float32, a rope table per layer type (bases 10 and 10k here, so a
    layer given the other's table is far off), sliding windows, q/k norms, scaled embeddings."""
    model = gemma3(4)
    runner, err = select_runner(model)
    assert runner.path == "fast" and err < 1e-4
    ids = probe_ids(256)
    reference = reference_logprobs(model, ids)  # before the generic runner takes over its attention
    problem, err = mismatch(GenericRunner(model), reference, ids)
    assert problem is None and err < 1e-4  # the generic path stays exact for what the fast one lacks


def test_an_engine_without_an_exact_path_refuses_to_build() -> None:
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    model = Gemma2ForCausalLM(Gemma2Config(**SHAPE, sliding_window=4, attn_implementation="eager")).eval()
    with pytest.raises(UnsupportedModel, match="no engine path computes this model.*softcapping"):
        select_runner(model)


def _windowed_reference(q, k, v, past: int, window: int, scale: float) -> torch.Tensor:
    t, total = q.shape[2], k.shape[2]
    rows = torch.arange(t)[:, None] + past
    keys = torch.arange(total)[None, :]
    allowed = (keys <= rows) & (keys > rows - window)
    k, v = k.repeat_interleave(q.shape[1] // k.shape[1], 1), v.repeat_interleave(q.shape[1] // v.shape[1], 1)
    scores = (q @ k.transpose(-1, -2) * scale).masked_fill(~allowed, float("-inf"))
    return scores.softmax(-1) @ v


@pytest.mark.parametrize("past", [0, 9])
def test_prefill_attention_sees_only_its_window(past: int) -> None:
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 4, 7, 8), torch.randn(1, 2, past + 7, 8), torch.randn(1, 2, past + 7, 8)
    got = causal_attention(q, k, v, past, 0.3, window=3)
    assert torch.allclose(got, _windowed_reference(q, k, v, past, 3, 0.3), atol=1e-5)
    assert not torch.allclose(got, causal_attention(q, k, v, past, 0.3), atol=1e-3)


def test_decode_attention_sees_only_each_rows_window() -> None:
    """Two rows of different lengths: each new query sees its last `window` keys, itself included."""
    torch.manual_seed(0)
    batch = DecodeBatch(layers=1, kv_heads=2, head_dim=8, dtype=torch.float32, device=torch.device("cpu"),
                        scale=0.3)
    kvs = []
    for n in (5, 11):
        kv = SessionKV(1, 2, 8, torch.float32, torch.device("cpu"), n)
        kv.k[0][:, :n], kv.v[0][:, :n] = torch.randn(2, n, 8), torch.randn(2, n, 8)
        kv.length = n
        batch.add(kv)
        kvs.append(kv)
    batch.prepare()
    q, k, v = torch.randn(2, 4, 1, 8), torch.randn(2, 2, 1, 8), torch.randn(2, 2, 1, 8)
    out = batch.attend(0, q, k, v, window=4)
    for row, kv in enumerate(kvs):
        n = kv.length
        keys = torch.cat([kv.k[0][None, :, :n], k[row:row + 1]], dim=2)
        values = torch.cat([kv.v[0][None, :, :n], v[row:row + 1]], dim=2)
        want = _windowed_reference(q[row:row + 1], keys, values, n, 4, 0.3)
        assert torch.allclose(out[row:row + 1], want, atol=1e-5)


def test_paged_decode_attention_sees_only_each_rows_window() -> None:
    """The engine's decode (paged, ragged rows): the same windows as the dense batch above."""
    torch.manual_seed(0)
    pool = KVPool(1, 2, 8, torch.float32, torch.device("cpu"), num_blocks=8, block_size=4, windows=[4])
    tables, keys, values = [], [], []
    for n in (5, 11):
        table = SequenceKV.new(pool)
        table.reserve(pool, n)
        slots = table.tables[0].slots(pool, n, torch.device("cpu"))
        keys.append(torch.randn(2, n, 8))
        values.append(torch.randn(2, n, 8))
        pool.k[0][:, slots], pool.v[0][:, slots] = keys[-1], values[-1]
        table.length = n
        tables.append(table)
    step = PagedDecode(pool, tables, 0.3)
    step.prepare()
    q, k, v = torch.randn(2, 4, 1, 8), torch.randn(2, 2, 1, 8), torch.randn(2, 2, 1, 8)
    out = step.attend(0, q, k, v, window=4)
    for row, table in enumerate(tables):
        n = table.length
        ks = torch.cat([keys[row][None], k[row:row + 1]], dim=2)
        vs = torch.cat([values[row][None], v[row:row + 1]], dim=2)
        want = _windowed_reference(q[row:row + 1], ks, vs, n, 4, 0.3)
        assert torch.allclose(out[row:row + 1], want, atol=1e-5)


def random_adapter(runner, seed: int = 0) -> LoraAdapter:
    """LoRA on every projection of every layer, rank 4, big enough to move the logits."""
    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for i, layer in enumerate(runner.layers):
        for name in (*ATTN_PROJ, *MLP_PROJ):
            module = getattr(layer.self_attn if name in ATTN_PROJ else layer.mlp, name)
            a = torch.randn(4, module.in_features, generator=gen) * 0.1
            b = torch.randn(module.out_features, 4, generator=gen) * 0.1
            weights[(i, name)] = (a, b, 2.0)
    return LoraAdapter(name="policy-v1", path="(test)", rank=4, weights=weights)


@pytest.mark.parametrize("path", ["fast", "generic"])
def test_a_lora_version_is_proven_on_first_load_on_either_path(path: str) -> None:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(**SHAPE)).eval()
    runner = ModelRunner(model) if path == "fast" else GenericRunner(model)
    adapter = random_adapter(runner)
    base = mismatch(runner, torch.zeros(1), probe_ids(256))  # what the engine computes without the adapter
    problem, err = adapter_mismatch(runner, adapter)
    assert problem is None and err < 1e-4
    assert mismatch(runner, torch.zeros(1), probe_ids(256)) == base  # the probe's hooks are gone


def test_an_engine_that_applies_a_lora_wrongly_is_caught_at_load(monkeypatch) -> None:
    """A bug in how the engine adds LoRA (here: v_proj's delta skipped) would serve, and capture
    logprobs of, another policy than the trainer's; the load-time probe refuses the version."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    runner = ModelRunner(Qwen3ForCausalLM(Qwen3Config(**SHAPE)).eval())
    add = LoraBatch.add_

    def skips_v(self, layer, name, x, y):
        if name != "v_proj":
            add(self, layer, name, x, y)

    monkeypatch.setattr(LoraBatch, "add_", skips_v)
    problem, err = adapter_mismatch(runner, random_adapter(runner))
    assert problem is not None and "differ from the model's own forward" in problem and err > 1e-3


@pytest.mark.parametrize("path", ["fast", "generic"])
def test_a_gemma3_lora_with_windows_is_proven_on_either_path(path: str) -> None:
    model = gemma3(6)
    runner = ModelRunner(model) if path == "fast" else GenericRunner(model)
    problem, err = adapter_mismatch(runner, random_adapter(runner))
    assert problem is None and err < 1e-4


# ---- 16-bit engines: proven against the float32 forward of the same weights ----

def qwen3() -> torch.nn.Module:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    return Qwen3ForCausalLM(Qwen3Config(**SHAPE)).eval()


def bf16_adapter(runner, seed: int = 0) -> LoraAdapter:
    """`random_adapter` in the served dtype, as the adapter registry loads a version."""
    adapter = random_adapter(runner, seed)
    adapter.weights = {k: (a.to(runner.dtype), b.to(runner.dtype), s) for k, (a, b, s) in adapter.weights.items()}
    return adapter


def test_a_bf16_models_reference_is_a_float32_copy_of_its_weights_made_for_the_probe_only() -> None:
    model = gemma3(4).to(torch.bfloat16)  # tied embeddings
    served = {n: p.detach().clone() for n, p in model.named_parameters()}
    with fp32_reference(model) as ref:
        assert ref is not model
        assert all(p.dtype == torch.float32 for p in ref.parameters())
        for name, p in ref.named_parameters():
            assert torch.equal(p, served[name].float()) and p.data_ptr() != model.get_parameter(name).data_ptr()
        assert ref.lm_head.weight is ref.model.embed_tokens.weight  # still tied: one copy
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert all(torch.equal(p, served[n]) for n, p in model.named_parameters())  # the served model is untouched
    fp32 = qwen3()
    with fp32_reference(fp32) as ref:
        assert ref is fp32  # nothing built for a float32 model
    assert own_logprobs(fp32, probe_ids(256)) is None


@pytest.mark.parametrize("path", ["fast", "generic"])
@pytest.mark.parametrize("arch", ["qwen3", "gemma3"])
def test_a_bf16_model_is_proven_on_either_path(arch: str, path: str) -> None:
    model = (qwen3() if arch == "qwen3" else gemma3(4)).to(torch.bfloat16)
    runner, err = select_runner(model, path)
    assert runner.path == path and runner.dtype == torch.bfloat16 and 0 < err < 0.5


@pytest.mark.parametrize("wrong", ["rope", "norm", "weights"])
def test_a_wrong_path_is_refused_in_bf16(wrong: str) -> None:
    """bf16 rounding moves every log-probability, so the 16-bit bound is loose (a median KL within
    4x HF's own bf16 forward's), but not so loose that a wrong model passes: a layer given the other
    rope table, a Gemma norm computed as w instead of 1 + w, one layer's weights perturbed by 10%."""
    model = gemma3(4).to(torch.bfloat16)
    ids = probe_ids(256)
    reference, own = reference_logprobs(model, ids), own_logprobs(model, ids)
    runner = ModelRunner(model)
    assert mismatch(runner, reference, ids, own=own)[0] is None
    if wrong == "rope":
        runner.fused[0].rope = runner.fused[1].rope
    elif wrong == "norm":
        norm = runner.fused[1].mlp_norm
        runner.fused[1].mlp_norm = _Norm(norm.weight - 1.0, norm.eps, norm.upcast)
    else:
        w = runner.layers[1].self_attn.o_proj.weight
        with torch.no_grad():
            w.add_(torch.randn(w.shape, generator=torch.Generator().manual_seed(0)).to(w.dtype) * w.float().std() * 0.1)
    problem, err = mismatch(runner, reference, ids, own=own)
    assert problem is not None and "median KL" in problem and "bfloat16" in problem


def test_the_16_bit_bound_is_capped_and_nan_is_refused() -> None:
    """HF's own bf16 forward far off (here: garbage) widens the bound only up to the cap; a path
    that computes NaN is refused whatever the bound."""
    model = gemma3(4).to(torch.bfloat16)
    ids = probe_ids(256)
    reference = reference_logprobs(model, ids)
    runner = ModelRunner(model)
    problem, err = mismatch(runner, reference, ids, own=torch.zeros_like(reference))
    assert problem is None and err < 0.5
    assert median_kl(reference, reference) == 0.0
    with torch.no_grad():
        runner.layers[1].mlp.down_proj.weight[0, 0] = float("nan")
    problem, err = mismatch(runner, reference, ids, own=torch.zeros_like(reference))
    assert problem is not None and "median KL nan" in problem and "at most 0.05" in problem


@pytest.mark.parametrize("path", ["fast", "generic"])
def test_a_lora_version_is_proven_in_bf16_and_a_wrongly_applied_one_refused(path: str, monkeypatch) -> None:
    model = gemma3(6).to(torch.bfloat16)
    runner = ModelRunner(model) if path == "fast" else GenericRunner(model)
    adapter = bf16_adapter(runner)
    problem, err = adapter_mismatch(runner, adapter)
    assert problem is None and err < 0.5
    add = LoraBatch.add_

    def skips_v(self, layer, name, x, y):
        if name != "v_proj":
            add(self, layer, name, x, y)

    monkeypatch.setattr(LoraBatch, "add_", skips_v)
    problem, err = adapter_mismatch(runner, adapter)
    assert problem is not None and "median KL" in problem
