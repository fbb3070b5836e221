"""vLLM as a replica's engine (`engine.backend = "vllm"`): a child process on the same host.

- `process`: starts vLLM's OpenAI server from its own environment on a private Unix socket, waits for
  it, watches it, and ends its whole process group.
- `engine`: `VllmEngine`, the `inference.backend.EngineBackend` that submits token ids to vLLM's
  token-in endpoint and fills each call's tokens and logprobs, which the replica captures.
- `versions`: adapter versions as vLLM LoRA adapters (one name and directory per version).
- `metrics`: vLLM's /metrics read into the figures `/v1/loads` reports.
"""
