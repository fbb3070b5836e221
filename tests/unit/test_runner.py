import copy
import json

import pytest
import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from burstrl.inference.dense import DecodeBatch, PackedPrefillAttention, SessionKV
from burstrl.inference.lora import AdapterError, LoraBatch, load_adapter
from burstrl.inference.runner import ModelRunner, UnsupportedModel, causal_attention

CPU = torch.device("cpu")
VOCAB = 256
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, initializer_range=0.1)


def _qwen3() -> Qwen3ForCausalLM:
    torch.manual_seed(0)
    return Qwen3ForCausalLM(Qwen3Config(head_dim=16, **SHAPE)).eval()


def _llama() -> LlamaForCausalLM:
    torch.manual_seed(1)
    return LlamaForCausalLM(LlamaConfig(**SHAPE)).eval()


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def model(request):
    return _qwen3() if request.param == "qwen3" else _llama()


@pytest.fixture(scope="module")
def qwen3():
    return _qwen3()


def _ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (n,), generator=g).tolist()


@torch.no_grad()
def _hf_logits(model: nn.Module, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([ids])).logits[0].float()  # [T, V]


def _new_kv(runner: ModelRunner) -> SessionKV:
    return SessionKV(runner.num_layers, runner.num_kv_heads, runner.head_dim, runner.dtype, runner.device, 4)


def _prefill(runner: ModelRunner, kv: SessionKV, ids: list[int], lora: LoraBatch | None = None,
             all_logits: bool = True) -> torch.Tensor:
    att = PackedPrefillAttention([kv], [len(ids)], runner.scaling)
    positions = torch.arange(kv.length, kv.length + len(ids))[None]
    logits = runner.forward(torch.tensor([ids]), positions, att, lora, all_logits=all_logits)
    att.commit()
    return logits[0]


class FullCausal:
    """No cache: every row is a whole sequence of the same length (a batched prefill)."""

    def __init__(self, scale: float) -> None:
        self.scale = scale

    def attend(self, layer, q, k, v, window=None):
        return causal_attention(q, k, v, 0, self.scale, window)


# ---- base model ----

def test_prefill_empty_cache_matches_hf(model):
    runner = ModelRunner(model)
    ids = _ids(13, seed=1)
    kv = _new_kv(runner)
    got = _prefill(runner, kv, ids)
    want = _hf_logits(model, ids)
    assert got.dtype == torch.float32 and got.shape == (13, VOCAB)
    assert torch.allclose(got, want, atol=1e-5)
    assert kv.length == 13
    last = runner.forward(torch.tensor([ids]), torch.arange(13)[None], FullCausal(runner.scaling))
    assert last.shape == (1, VOCAB)
    assert torch.allclose(last[0], want[-1], atol=1e-5)


def test_prefill_suffix_over_cached_prefix_matches_hf(model):
    runner = ModelRunner(model)
    ids = _ids(20, seed=2)
    want = _hf_logits(model, ids)
    kv = _new_kv(runner)
    _prefill(runner, kv, ids[:7])
    got = _prefill(runner, kv, ids[7:16])
    assert torch.allclose(got, want[7:16], atol=1e-5)
    got = _prefill(runner, kv, ids[16:17])  # a single token
    assert torch.allclose(got, want[16:17], atol=1e-5)
    assert kv.length == 17
    kv.truncate(10)  # reuse a shorter prefix, then diverge
    other = ids[:10] + _ids(5, seed=3)
    got = _prefill(runner, kv, other[10:])
    assert torch.allclose(got, _hf_logits(model, other)[10:], atol=1e-5)


def test_batched_prefill_matches_hf(model):
    runner = ModelRunner(model)
    rows = [_ids(9, seed=s) for s in (4, 5, 6)]
    got = runner.forward(torch.tensor(rows), torch.arange(9)[None].repeat(3, 1),
                         FullCausal(runner.scaling), all_logits=True)
    for r, ids in enumerate(rows):
        assert torch.allclose(got[r], _hf_logits(model, ids), atol=1e-5)


def test_decode_batch_of_different_lengths_matches_hf(model):
    runner = ModelRunner(model)
    batch = DecodeBatch(runner.num_layers, runner.num_kv_heads, runner.head_dim, runner.dtype,
                        runner.device, runner.scaling)
    prompts = [_ids(n, seed=10 + n) for n in (3, 11, 6)]
    steps = 5
    extra = [_ids(steps, seed=20 + i) for i in range(3)]
    more = [_ids(3, seed=30), None, _ids(3, seed=31)]  # row 1 leaves after `steps`
    tail = _ids(2, seed=40)  # row 1's next call, a prefill over its cached prefix
    fulls = [prompts[0] + extra[0] + more[0], prompts[1] + extra[1] + tail, prompts[2] + extra[2] + more[2]]
    want = [_hf_logits(model, full) for full in fulls]  # causal: position t sees fulls[r][:t + 1]
    kvs = []
    for prompt in prompts:
        kv = _new_kv(runner)
        _prefill(runner, kv, prompt)
        kvs.append(kv)
        batch.add(kv)
    for s in range(steps):
        batch.prepare()
        ids = torch.tensor([[e[s]] for e in extra])
        positions = batch.lens[:, None].clone()
        logits = runner.forward(ids, positions, batch)
        batch.advance()
        for r in range(3):
            assert torch.allclose(logits[r], want[r][len(prompts[r]) + s], atol=1e-5), (s, r)
    # a row leaves mid-way (its cache copied out), the others keep decoding correctly
    batch.remove(1, kvs[1])
    assert kvs[1].length == len(prompts[1]) + steps
    rows = [0, 2]
    for s in range(3):
        batch.prepare()
        logits = runner.forward(torch.tensor([[more[r][s]] for r in rows]), batch.lens[:, None].clone(), batch)
        batch.advance()
        for i, r in enumerate(rows):
            assert torch.allclose(logits[i], want[r][len(prompts[r]) + steps + s], atol=1e-5), (s, r)
    got = _prefill(runner, kvs[1], tail)
    assert torch.allclose(got, want[1][-2:], atol=1e-5)


# ---- LoRA ----

def _peft(base: nn.Module, tmp_path, name: str, seed: int, **kw):
    torch.manual_seed(seed)
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights=False,
                     lora_dropout=0.0, **kw)
    peft_model = get_peft_model(copy.deepcopy(base), cfg).eval()
    path = tmp_path / name
    peft_model.save_pretrained(path)
    return peft_model, path


@pytest.fixture(scope="module")
def adapters(qwen3, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("adapters")
    a_model, a_path = _peft(qwen3, tmp, "a", seed=1)
    b_model, b_path = _peft(qwen3, tmp, "b", seed=2, use_rslora=True)
    n = qwen3.config.num_hidden_layers
    a = load_adapter("a", a_path, n, torch.float32, CPU)
    b = load_adapter("b", b_path, n, torch.float32, CPU)
    return {"a": (a_model, a_path, a), "b": (b_model, b_path, b)}


def test_load_adapter_reads_peft_files(adapters):
    _, path, a = adapters["a"]
    assert a.rank == 4 and a.name == "a" and a.path == str(path)
    assert len(a.weights) == 2 * len(TARGETS)
    A, B, scale = a.weights[(0, "q_proj")]
    assert A.shape == (4, 64) and B.shape[1] == 4 and scale == 2.0
    assert B.abs().sum() > 0
    assert adapters["b"][2].weights[(1, "down_proj")][2] == pytest.approx(8 / 2)  # rsLoRA: alpha/sqrt(r)


@pytest.mark.parametrize("which", ["a", "b"])
def test_lora_prefill_matches_peft(qwen3, adapters, which):
    peft_model, _, adapter = adapters[which]
    runner = ModelRunner(qwen3)
    ids = _ids(12, seed=50)
    want = _hf_logits(peft_model, ids)
    assert not torch.allclose(want, _hf_logits(qwen3, ids), atol=1e-2)  # the adapter matters
    kv = _new_kv(runner)
    got = _prefill(runner, kv, ids[:8], LoraBatch([adapter]))
    assert torch.allclose(got, want[:8], atol=1e-5)
    got = _prefill(runner, kv, ids[8:], LoraBatch([adapter]))
    assert torch.allclose(got, want[8:], atol=1e-5)


def test_base_model_untouched_by_lora(qwen3, adapters):
    runner = ModelRunner(qwen3)
    ids = _ids(6, seed=51)
    _prefill(runner, _new_kv(runner), ids, LoraBatch([adapters["a"][2]]))
    got = _prefill(runner, _new_kv(runner), ids, None)
    assert torch.allclose(got, _hf_logits(qwen3, ids), atol=1e-5)
    assert LoraBatch([None, None]).empty


def test_mixed_lora_batched_prefill_equals_rows_alone(qwen3, adapters):
    runner = ModelRunner(qwen3)
    a, b = adapters["a"][2], adapters["b"][2]
    rows = [_ids(7, seed=s) for s in (60, 61, 62, 63)]
    which = [a, None, b, a]
    got = runner.forward(torch.tensor(rows), torch.arange(7)[None].repeat(4, 1),
                         FullCausal(runner.scaling), LoraBatch(which), all_logits=True)
    refs = {id(a): adapters["a"][0], id(b): adapters["b"][0], id(None): qwen3}
    for r, ids in enumerate(rows):
        alone = _prefill(runner, _new_kv(runner), ids, LoraBatch([which[r]]) if which[r] else None)
        assert torch.allclose(got[r], alone, atol=1e-5), r
        assert torch.allclose(got[r], _hf_logits(refs[id(which[r])], ids), atol=1e-5), r


def test_mixed_lora_decode_batch_equals_rows_alone(qwen3, adapters):
    runner = ModelRunner(qwen3)
    a, b = adapters["a"][2], adapters["b"][2]
    which = [a, None, b]
    refs = [adapters["a"][0], qwen3, adapters["b"][0]]
    batch = DecodeBatch(runner.num_layers, runner.num_kv_heads, runner.head_dim, runner.dtype,
                        runner.device, runner.scaling)
    prompts = [_ids(n, seed=70 + n) for n in (5, 2, 9)]
    steps = 4
    nxt = [_ids(steps, seed=80 + r) for r in range(3)]
    alone, want = [], []
    for r, (prompt, adapter) in enumerate(zip(prompts, which, strict=False)):
        lora = LoraBatch([adapter]) if adapter else None
        kv = _new_kv(runner)
        _prefill(runner, kv, prompt, lora)
        batch.add(kv)
        alone.append(_prefill(runner, _new_kv(runner), prompt + nxt[r], lora))
        want.append(_hf_logits(refs[r], prompt + nxt[r]))
    lora = LoraBatch(which)
    for s in range(steps):
        batch.prepare()
        logits = runner.forward(torch.tensor([[n[s]] for n in nxt]), batch.lens[:, None].clone(), batch, lora)
        batch.advance()
        for r in range(3):
            t = len(prompts[r]) + s
            assert torch.allclose(logits[r], alone[r][t], atol=1e-5), (s, r)
            assert torch.allclose(logits[r], want[r][t], atol=1e-5), (s, r)


def test_packed_prefill_of_mixed_sessions_equals_each_alone(qwen3, adapters):
    """Three requests (different cached prefixes and versions) in one packed forward."""
    runner = ModelRunner(qwen3)
    a, b = adapters["a"][2], adapters["b"][2]
    which = [a, None, b]
    refs = [adapters["a"][0], qwen3, adapters["b"][0]]
    cached = [_ids(n, seed=90 + n) for n in (6, 0, 3)]
    new = [_ids(n, seed=95 + n) for n in (4, 7, 1)]
    kvs = []
    for prefix, adapter in zip(cached, which, strict=False):
        kv = _new_kv(runner)
        if prefix:
            _prefill(runner, kv, prefix, LoraBatch([adapter]) if adapter else None)
        kvs.append(kv)
    att = PackedPrefillAttention(kvs, [len(n) for n in new], runner.scaling)
    ids = torch.tensor([[t for n in new for t in n]])
    positions = torch.cat([torch.arange(len(c), len(c) + len(n)) for c, n in zip(cached, new, strict=False)])[None]
    lora = LoraBatch([w for w, n in zip(which, new, strict=False) for _ in n], per_token=True)
    got = runner.forward(ids, positions, att, lora, select=torch.tensor(att.last_positions))
    att.commit()
    for r in range(3):
        assert kvs[r].length == len(cached[r]) + len(new[r])
        want = _hf_logits(refs[r], cached[r] + new[r])[-1]
        assert torch.allclose(got[r], want, atol=1e-5), r


def test_lora_subset_of_targets_matches_peft(qwen3, tmp_path):
    torch.manual_seed(3)
    cfg = LoraConfig(r=2, lora_alpha=3, target_modules=["v_proj", "up_proj"], init_lora_weights=False,
                     layers_to_transform=[1])
    peft_model = get_peft_model(copy.deepcopy(qwen3), cfg).eval()
    peft_model.save_pretrained(tmp_path)
    adapter = load_adapter("sub", tmp_path, 2, torch.float32, CPU)
    assert set(adapter.weights) == {(1, "v_proj"), (1, "up_proj")}
    runner = ModelRunner(qwen3)
    ids = _ids(8, seed=90)
    got = _prefill(runner, _new_kv(runner), ids, LoraBatch([adapter]))
    assert torch.allclose(got, _hf_logits(peft_model, ids), atol=1e-5)


def test_mix_of_same_scale_versions_and_a_partial_adapter_equals_each_alone(qwen3, adapters, tmp_path):
    """The concatenated path (several adapters in one batch) with equal scales (a 0/1 mask and
    alpha = the scale), an adapter on two targets of one layer only, and a base row: each row's
    logits as that row alone gets them, decoded and in a packed prefill."""
    from burstrl.inference.lora import LoraStacks

    runner = ModelRunner(qwen3)
    a = adapters["a"][2]
    a2 = load_adapter("a2", adapters["a"][1], 2, torch.float32, CPU)  # same files: a distinct version
    torch.manual_seed(4)
    cfg = LoraConfig(r=2, lora_alpha=4, target_modules=["v_proj", "up_proj"], init_lora_weights=False,
                     layers_to_transform=[1])
    get_peft_model(copy.deepcopy(qwen3), cfg).eval().save_pretrained(tmp_path / "sub")
    sub = load_adapter("sub", tmp_path / "sub", 2, torch.float32, CPU)
    which = [a, None, a2, sub, a]
    stacks = LoraStacks(size=1)
    prompts = [_ids(n, seed=60 + n) for n in (3, 5, 2, 6, 4)]
    att = PackedPrefillAttention([_new_kv(runner) for _ in which], [len(p) for p in prompts], runner.scaling)
    ids = torch.tensor([[t for p in prompts for t in p]])
    positions = torch.cat([torch.arange(len(p)) for p in prompts])[None]
    lora = LoraBatch([w for w, p in zip(which, prompts, strict=True) for _ in p], per_token=True, stacks=stacks)
    assert lora.concat is not None
    got = runner.forward(ids, positions, att, lora, select=torch.tensor(att.last_positions))
    for r, (prompt, adapter) in enumerate(zip(prompts, which, strict=True)):
        alone = _prefill(runner, _new_kv(runner), prompt, LoraBatch([adapter]) if adapter else None)
        assert torch.allclose(got[r], alone[-1], atol=1e-5), r
    again = LoraBatch([a, sub, a2], stacks=stacks)
    assert again.concat is lora.concat  # the same set of adapters, in any order, is not copied again
    assert LoraBatch([sub, a], stacks=stacks).concat is not lora.concat and len(stacks.mixes) == 1


# ---- refusals ----

def test_unsupported_model_without_layout():
    with pytest.raises(UnsupportedModel):
        ModelRunner(nn.Linear(4, 4))

    class NoLayers(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = nn.Module()
            self.lm_head = nn.Linear(4, 4)

    with pytest.raises(UnsupportedModel, match="layers"):
        ModelRunner(NoLayers())


def test_unsupported_model_layer_without_projections():
    model = _qwen3()
    del model.model.layers[1].mlp.gate_proj
    with pytest.raises(UnsupportedModel, match="layer 1 lacks mlp.gate_proj"):
        ModelRunner(model)


def test_qwen3_sliding_windows_run_on_the_fast_path():
    """Each layer's attention names its window (`sliding_window`, None on global layers); a
    4-token window is far shorter than the probe, so a window ignored would fail it."""
    from burstrl.inference.probe import select_runner

    torch.manual_seed(0)
    cfg = Qwen3Config(head_dim=16, use_sliding_window=True, sliding_window=4, max_window_layers=1, **SHAPE)
    model = Qwen3ForCausalLM(cfg).eval()
    assert [layer.self_attn.sliding_window for layer in model.model.layers] == [None, 4]
    runner, err = select_runner(model)
    assert runner.path == "fast" and err < 1e-4


def test_a_window_the_layers_do_not_name_is_refused_by_the_fast_runner():
    """Mistral passes its window at call time, not per layer: the fast runner refuses rather than
    guess, and the generic path (the model's own attention call) serves it exactly."""
    from transformers import MistralConfig, MistralForCausalLM

    from burstrl.inference.probe import select_runner

    torch.manual_seed(0)
    model = MistralForCausalLM(MistralConfig(head_dim=16, sliding_window=4, **SHAPE)).eval()
    with pytest.raises(UnsupportedModel, match="sliding"):
        ModelRunner(model)
    runner, err = select_runner(model)
    assert runner.path == "generic" and err < 1e-4


def _copy_adapter(src, dst):
    dst.mkdir()
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        (dst / name).write_bytes((src / name).read_bytes())
    return dst


def _edit_config(path, **changes):
    cfg = json.loads((path / "adapter_config.json").read_text())
    cfg.update(changes)
    (path / "adapter_config.json").write_text(json.dumps(cfg))


def _load(path, layers=2):
    return load_adapter("x", path, layers, torch.float32, CPU)


def test_load_adapter_refuses_dora(qwen3, tmp_path):
    torch.manual_seed(0)
    cfg = LoraConfig(r=2, target_modules=["q_proj"], use_dora=True, init_lora_weights=False)
    get_peft_model(copy.deepcopy(qwen3), cfg).save_pretrained(tmp_path / "dora")
    with pytest.raises(AdapterError, match="use_dora"):
        _load(tmp_path / "dora")


@pytest.mark.parametrize("changes, word", [
    ({"use_dora": True}, "use_dora"),
    ({"lora_bias": True}, "lora_bias"),
    ({"rank_pattern": {"q_proj": 8}}, "rank_pattern"),
    ({"alpha_pattern": {"q_proj": 8}}, "alpha_pattern"),
    ({"peft_type": "IA3"}, "peft_type"),
    ({"alora_invocation_tokens": [7, 8]}, "alora_invocation_tokens"),
    ({"layer_replication": [[0, 2], [1, 2]]}, "layer_replication"),
    ({"target_parameters": ["mlp.experts.gate_up_proj"]}, "target_parameters"),
])
def test_load_adapter_refuses_config_variants(adapters, tmp_path, changes, word):
    path = _copy_adapter(adapters["a"][1], tmp_path / "x")
    _edit_config(path, **changes)
    with pytest.raises(AdapterError, match=word):
        _load(path)


def test_load_adapter_refuses_missing_files(adapters, tmp_path):
    for missing in ("adapter_config.json", "adapter_model.safetensors"):
        path = _copy_adapter(adapters["a"][1], tmp_path / missing)
        (path / missing).unlink()
        with pytest.raises(AdapterError, match="expected adapter_config.json"):
            _load(path)
    with pytest.raises(AdapterError):
        _load(tmp_path / "nowhere")


def _edit_tensors(path, fn):
    tensors = load_file(str(path / "adapter_model.safetensors"))
    fn(tensors)
    save_file(tensors, str(path / "adapter_model.safetensors"))


@pytest.mark.parametrize("key", [
    "base_model.model.model.embed_tokens.lora_A.weight",
    "base_model.model.lm_head.lora_A.weight",
    "base_model.model.model.layers.0.self_attn.q_norm.lora_A.weight",
    "base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector",
    "base_model.model.model.layers.5.self_attn.q_proj.lora_A.weight",  # beyond num_layers
])
def test_load_adapter_refuses_unknown_tensor_names(adapters, tmp_path, key):
    path = _copy_adapter(adapters["a"][1], tmp_path / "x")
    _edit_tensors(path, lambda t: t.__setitem__(key, torch.zeros(4, 64)))
    with pytest.raises(AdapterError, match="unsupported adapter tensor"):
        _load(path)


def test_load_adapter_refuses_half_pairs_and_bad_rank(adapters, tmp_path):
    path = _copy_adapter(adapters["a"][1], tmp_path / "half")
    _edit_tensors(path, lambda t: t.pop("base_model.model.model.layers.1.mlp.up_proj.lora_B.weight"))
    with pytest.raises(AdapterError, match="lacks lora_A or lora_B"):
        _load(path)
    path = _copy_adapter(adapters["a"][1], tmp_path / "rank")
    key = "base_model.model.model.layers.0.self_attn.k_proj.lora_A.weight"
    _edit_tensors(path, lambda t: t.__setitem__(key, torch.zeros(3, 64)))
    with pytest.raises(AdapterError, match="rank"):
        _load(path)
    path = _copy_adapter(adapters["a"][1], tmp_path / "empty")
    _edit_tensors(path, lambda t: t.clear())
    with pytest.raises(AdapterError):
        _load(path)


def test_load_adapter_refuses_activated_lora(qwen3, tmp_path):
    # aLoRA only applies after its invocation tokens: the engine's math would silently differ
    torch.manual_seed(0)
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False,
                     alora_invocation_tokens=[7, 8], task_type="CAUSAL_LM")
    get_peft_model(copy.deepcopy(qwen3), cfg).save_pretrained(tmp_path)
    with pytest.raises(AdapterError, match="alora_invocation_tokens"):
        _load(tmp_path)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_mixed_lora_batch_on_cuda(tmp_path):
    # LoraBatch builds its row index with torch.tensor(rows) (CPU); index_add on a CUDA output
    # needs the index on the same device
    dev = torch.device("cuda")
    model = _qwen3().to(dev)
    torch.manual_seed(5)
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights=False)
    get_peft_model(copy.deepcopy(_qwen3()), cfg).save_pretrained(tmp_path)
    adapter = load_adapter("a", tmp_path, 2, torch.float32, dev)
    runner = ModelRunner(model)
    rows = [_ids(7, seed=s) for s in (1, 2, 3)]
    got = runner.forward(torch.tensor(rows, device=dev), torch.arange(7, device=dev)[None].repeat(3, 1),
                         FullCausal(runner.scaling), LoraBatch([adapter, None, adapter]))
    for r, ids in enumerate(rows):
        one = runner.forward(torch.tensor([ids], device=dev), torch.arange(7, device=dev)[None],
                             FullCausal(runner.scaling), LoraBatch([adapter]) if r != 1 else None)
        assert torch.allclose(got[r], one[0], atol=1e-4)
