"""The start-up proof of the engine's paths (inference/probe.py) and sliding-window attention."""

from __future__ import annotations

import pytest
import torch

from burstrl.inference.dense import DecodeBatch, SessionKV
from burstrl.inference.paged import BlockTable, KVPool, PagedDecode
from burstrl.inference.probe import mismatch, probe_ids, reference_logprobs, select_runner
from burstrl.inference.runner import ModelRunner, UnsupportedModel, causal_attention

SHAPE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=128)


def test_a_qwen3_model_runs_on_the_fast_path() -> None:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    runner, err = select_runner(Qwen3ForCausalLM(Qwen3Config(**SHAPE)).eval())
    assert runner.path == "fast" and err < 1e-4


def test_silently_wrong_math_on_the_fast_path_is_caught_and_the_generic_path_serves() -> None:
    """Gemma (1) has every module the fast runner looks for, so it runs without an error, but its
    norms are (1 + w) and its embeddings are scaled: other numbers. The probe sees them."""
    from transformers import GemmaConfig, GemmaForCausalLM

    torch.manual_seed(0)
    model = GemmaForCausalLM(GemmaConfig(**SHAPE)).eval()
    ids = probe_ids(256)
    problem, err = mismatch(ModelRunner(model), reference_logprobs(model, ids), ids)
    assert problem is not None and "differ from the model's own forward" in problem and err > 0.01
    runner, err = select_runner(model)
    assert runner.path == "generic" and err < 1e-4


def test_gemma3_sliding_windows_shorter_than_the_probe_are_exact_on_the_generic_path() -> None:
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    cfg = Gemma3TextConfig(**SHAPE, sliding_window=4, query_pre_attn_scalar=16,
                           layer_types=["sliding_attention", "full_attention"])
    runner, err = select_runner(Gemma3ForCausalLM(cfg).eval())
    assert runner.path == "generic" and err < 1e-4


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
    pool = KVPool(1, 2, 8, torch.float32, torch.device("cpu"), num_blocks=8, block_size=4)
    tables, keys, values = [], [], []
    for n in (5, 11):
        table = BlockTable()
        table.reserve(pool, n)
        slots = table.slots(pool, n, torch.device("cpu"))
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
