"""LoRA helpers shared by the trainer, the tests and the benchmarks.

Adapters are always written with PEFT's own `save_pretrained` (adapter_config.json +
adapter_model.safetensors), so the engine, vLLM and SGLang all load the same directory.
"""

from __future__ import annotations

from pathlib import Path

import torch

TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def lora_config(rank: int = 8, alpha: int = 16, init_random: bool = False):
    """The LoRA config burstrl uses: every attention and MLP projection."""
    from peft import LoraConfig

    return LoraConfig(r=rank, lora_alpha=alpha, target_modules=TARGET_MODULES, lora_dropout=0.0,
                      init_lora_weights=not init_random, task_type="CAUSAL_LM")


def make_random_adapter(model_dir: str | Path, out: str | Path, seed: int, rank: int = 8,
                        scale: float = 1.0) -> Path:
    """Write a PEFT adapter with random A and B (B != 0, so it changes the model's outputs).

    Used to test multi-version serving before any training exists; `scale` multiplies B.
    """
    from peft import get_peft_model

    from burstrl.model.hf import load_model

    torch.manual_seed(seed)
    model = get_peft_model(load_model(model_dir, "float32", "cpu"), lora_config(rank, init_random=True))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.05 * scale)
    model.save_pretrained(str(out))
    return Path(out)
