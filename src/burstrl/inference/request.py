"""One engine call (`Request`) and the engine's counters: what HTTP handlers hand the engine thread.

Kept apart from the engine loop so that the request's fields (what was fed, sampled, shown to the
client, and why it ended) read in one place.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from burstrl.inference.lora import LoraAdapter
from burstrl.inference.paged import SequenceKV
from burstrl.inference.prefix import KvNamespace
from burstrl.inference.sampling import SamplingParams
from burstrl.inference.sessions import ReplicaSession
from burstrl.inference.tools import ToolSpec


@dataclass(eq=False)
class Request:
    """One call: what to feed, how to sample, and where to report; the engine fills the rest."""

    id: str
    session: ReplicaSession
    prompt_ids: list[int]
    params: SamplingParams
    version: str
    adapter: LoraAdapter | None
    on_done: Callable[[Request], None]
    on_token: Callable[[Request], None] | None = None
    messages: list[dict] | None = None
    tools: ToolSpec | None = None  # chat calls with tools: what the template rendered, how calls are parsed
    cache_salt: str | None = None  # vLLM's field: prefix sharing only between requests of the same salt
    completion_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    shown_logprobs: list[float] = field(default_factory=list)  # what the client sees (raw or processed)
    shown_top: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop token id or string that ended it (vLLM's field)
    text: str | None = None
    cached_tokens: int = 0
    error: str | None = None
    t_submit: float = field(default_factory=time.monotonic)
    t_start: float = 0.0
    t_first: float = 0.0
    t_end: float = 0.0
    reserved: int = 0  # KV blocks
    steady: int = 0  # KV blocks reserved once the prefill is over (less with sliding-window layers)
    kv: SequenceKV | None = None
    generator: torch.Generator | None = None

    @property
    def namespace(self) -> KvNamespace:
        """The KV namespace: keys/values are only ever reused within one adapter version, and within
        one `cache_salt` (compared exactly, so two salts never share a block, hash collisions or not)."""
        uid = 0 if self.adapter is None else self.adapter.uid
        return uid if self.cache_salt is None else (uid, self.cache_salt)


@dataclass
class EngineCounters:
    requests: dict[str, int] = field(default_factory=dict)  # by finish reason
    prompt_tokens: int = 0
    generation_tokens: int = 0
    decode_steps: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    failed_requests: int = 0  # failed alone (bad distribution, callback error, failed step)
    step_failures: int = 0  # forward passes that raised
