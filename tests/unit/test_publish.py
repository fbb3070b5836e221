"""The trainer never publishes a non-finite adapter: nothing reaches the volume or a replica."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from burstrl.config import TrainConfig, WeightsConfig
from burstrl.trainer.dist import Dist
from burstrl.trainer.publish import NonFiniteAdapter, Publisher, publish_version


@pytest.fixture(scope="module")
def good_adapter(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from burstrl.model.lora import make_random_adapter

    return make_random_adapter(tiny_model_dir, tmp_path_factory.mktemp("publish") / "good", seed=3)


def _poisoned(good: Path, out: Path, value: float) -> tuple[Path, str]:
    """A copy of `good` with one value of one (sorted-first lora_B) tensor set to `value`."""
    import shutil

    shutil.copytree(good, out)
    tensors = load_file(str(out / "adapter_model.safetensors"))
    key = sorted(k for k in tensors if "lora_B" in k)[0]
    tensors[key] = tensors[key].clone()
    tensors[key][0, 0] = value
    save_file(tensors, str(out / "adapter_model.safetensors"))
    return out, key


def _cfg(tmp_path: Path, async_push: bool) -> TrainConfig:
    return TrainConfig(run_dir=str(tmp_path / "run"),
                       weights=WeightsConfig(volume=str(tmp_path / "volume"), async_push=async_push))


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("async_push", [False, True])
def test_non_finite_adapter_is_never_published(good_adapter, tmp_path, value, async_push):
    bad, key = _poisoned(good_adapter, tmp_path / "bad", value)
    cfg = _cfg(tmp_path, async_push)
    with pytest.raises(NonFiniteAdapter, match=re.escape(f"policy-v7: tensor '{key}'")):
        Publisher(cfg, Dist()).publish(7, bad)
    with pytest.raises(NonFiniteAdapter, match="policy-v7"):
        publish_version(cfg, 7, bad, Dist())  # the resume path publishes without a Publisher
    volume = tmp_path / "volume"
    assert not volume.exists() or not any(volume.iterdir())


def test_finite_adapter_is_published(good_adapter, tmp_path):
    publisher = Publisher(_cfg(tmp_path, async_push=True), Dist())
    publisher.publish(1, good_adapter)
    publisher.wait()
    published = load_file(str(tmp_path / "volume" / "policy-v1" / "adapter_model.safetensors"))
    assert all(torch.isfinite(t).all() for t in published.values())


def test_adapter_cast_on_the_trainer_serves_the_same_weights(tiny_model_dir: Path, good_adapter: Path,
                                                              tmp_path: Path) -> None:
    """`serving_files` casts to bfloat16 before packing (half the bytes): the replica then serves
    exactly what it served when it cast the float32 files itself."""
    from transformers import AutoConfig

    from burstrl.inference.adapters import AdapterRegistry
    from burstrl.protocol.adapters import Packer, pack_adapter
    from burstrl.trainer.publish import serving_files

    layers = AutoConfig.from_pretrained(tiny_model_dir).num_hidden_layers
    registry = AdapterRegistry(tmp_path / "state", layers, torch.bfloat16, torch.device("cpu"))
    served = {}
    for name, (manifest, shards) in {
            "f32": pack_adapter(good_adapter, 2, "f32"),
            "bf16": Packer().pack_bytes(serving_files(good_adapter, "bfloat16"), 2, "bf16")}.items():
        for i, shard in enumerate(shards):
            registry.put_shard(name, i, 2, bytes(shard), manifest.shard_sha256[i])
        registry.put_manifest(name, manifest.to_json())
        served[name] = (registry.commit(name), manifest.total_bytes)
    (f32, f32_bytes), (bf16, bf16_bytes) = served["f32"], served["bf16"]
    assert bf16_bytes < 0.6 * f32_bytes
    assert set(f32.weights) == set(bf16.weights) and f32.rank == bf16.rank
    for key, (a, b, scale) in f32.weights.items():
        a2, b2, scale2 = bf16.weights[key]
        assert a.dtype == a2.dtype == torch.bfloat16 and torch.equal(a, a2) and torch.equal(b, b2)
        assert scale == scale2
    with pytest.raises(ValueError, match="floating"):
        serving_files(good_adapter, "int8")
