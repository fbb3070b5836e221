import pytest
import torch

from burstrl.model import hf


def test_resolve_device_and_dtype():
    assert hf.resolve_device("cpu") == torch.device("cpu")
    assert hf.resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert hf.resolve_dtype("auto", "cpu") == torch.float32
    assert hf.resolve_dtype("auto", torch.device("cuda", 0)) == torch.bfloat16
    assert hf.resolve_dtype("bfloat16", "cpu") == torch.bfloat16
    with pytest.raises(ValueError, match="fp8"):
        hf.resolve_dtype("fp8", "cpu")


def test_load_model_in_requested_dtype(tiny_model_dir):
    model = hf.load_model(tiny_model_dir, dtype="bfloat16", device="cpu")
    assert model.dtype == torch.bfloat16
    assert model.config._attn_implementation == "sdpa"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_load_model_on_gpu(tiny_model_dir):
    model = hf.load_model(tiny_model_dir)  # auto: cuda, bfloat16
    assert model.device.type == "cuda" and model.dtype == torch.bfloat16
    with torch.no_grad():
        logits = model(torch.tensor([[1, 2, 3]], device=model.device)).logits
    assert logits.shape == (1, 3, model.config.vocab_size) and torch.isfinite(logits).all()
