"""Model loading, the tiny test model and LoRA helpers.

Owns: turning a Hugging Face checkpoint directory into a tokenizer, an eval-mode model on the
right device and dtype, and the stop-token ids (`hf.py`); writing the tiny random-init Qwen3 that
tests and the quickstart run on (`tiny.py`); LoRA adapter helpers (`lora.py`). Everything goes
through the ordinary `from_pretrained` path, so a real Qwen3 directory and the tiny one load the
same way.

Talks to nobody over the network: it reads and writes model directories on local disk.
"""
