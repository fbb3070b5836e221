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
