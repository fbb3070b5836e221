"""The one boundary between a replica's server and its engine (`engine.backend`).

Why one small protocol: the server, request checks, sessions, capture (`inference.calls`) and
adapter versions are burstrl's and written once; an engine only computes tokens. Each engine is
one module or package behind this boundary: burstrl's own (`inference.engine.Engine`) and vLLM
(`inference.vllm.engine.VllmEngine`). What an engine must do:

- take a `Request` (prompt token ids, sampling params, the version's adapter) and fill, as tokens
  come, `completion_ids`, the processed `logprobs` of each sampled token (of the distribution it
  was sampled from) and the shown ones, then end it through `calls.report_done` exactly once
  (finish reason, or `error`); `abort` ends it at the next token with the tokens so far;
- load a version before it is served (`prove_adapter`, which may refuse it) and free it when the
  registry lets it go (`release_adapter`);
- report load (`loads`, `prefix_summary`, `metric_rows`), liveness (`alive`, `error`) and call
  `on_fatal` once if it dies, so the replica answers 503 and exits for the fleet to replace it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from burstrl.inference.lora import LoraAdapter
from burstrl.inference.request import EngineCounters, Request

MetricRow = tuple[str, str, str, float]  # (name, prometheus type, help, value)


class EngineBackend(Protocol):
    path: str  # what computes the tokens: "fast", "generic" (own engine) or "vllm"
    vocab_size: int
    counters: EngineCounters
    error: str | None
    on_release: Callable[[], None] | None  # a session's call ended: retired versions may be freed
    on_fatal: Callable[[str], None] | None

    @property
    def alive(self) -> bool: ...

    def start(self) -> None: ...

    def stop(self) -> None: ...

    def submit(self, req: Request) -> None:
        """Queue a call (RuntimeError if the engine is not running)."""

    def abort(self, request_id: str) -> None:
        """End a call at its next token boundary, keeping the tokens so far (its client went away)."""

    def drop_session(self, session_id: str) -> None:
        """Free what the engine holds for a released session."""

    def prove_adapter(self, adapter: LoraAdapter) -> float:
        """Make a version servable and prove it (AdapterError refuses it); the probe's max |dlogp| or 0."""

    def release_adapter(self, adapter: LoraAdapter) -> None:
        """A version the registry freed: no session can name it any more."""

    def loads(self) -> dict: ...

    def prefix_summary(self, max_blocks: int = 16384) -> dict: ...

    def metric_rows(self) -> list[MetricRow]: ...
