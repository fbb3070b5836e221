"""`VllmEngine`: the `inference.backend.EngineBackend` that computes tokens with a vLLM child.

One thread runs an asyncio loop (owned by the engine: `start` makes it, `stop` ends it) with one
HTTP client on vLLM's private socket. Each call is a task streaming `/inference/v1/generate`; its
tokens and logprobs land in the `Request` as they come, and it ends through `calls.report_done`
like a call on the own engine. A watcher task reads vLLM's /metrics for `/v1/loads`, expires idle
sessions, and notices vLLM's death: then every call fails, `on_fatal` fires once, and the replica
answers 503 and exits for the fleet to replace it.

Deadlines (`burstrl.deadline`): a call's response headers and every chunk of its stream within
`engine.vllm.request_timeout_s` (a long generation is fine, a stalled one is cut); every other call
to vLLM within that deadline as a whole.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import httpx

from burstrl.config import EngineConfig
from burstrl.deadline import CallFailed, achunks, afetch, aopen
from burstrl.inference.backend import MetricRow
from burstrl.inference.calls import report_done, settle_session
from burstrl.inference.lora import AdapterError, LoraAdapter
from burstrl.inference.request import EngineCounters, Request
from burstrl.inference.sessions import SessionTable
from burstrl.inference.vllm import probe, versions, wire
from burstrl.inference.vllm.loads import loads_body, metric_rows, prefix_summary
from burstrl.inference.vllm.metrics import VllmFigures, parse
from burstrl.inference.vllm.process import VllmProcess, VllmStartError
from burstrl.inference.vllm.refills import RefillTracker

log = logging.getLogger(__name__)
logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per call to vLLM otherwise (scrapes twice a second)
BASE = "http://vllm"  # the host part is ignored on a Unix socket


class VllmEngine:
    path = "vllm"

    def __init__(self, process: VllmProcess, tokenizer: Any, cfg: EngineConfig, eos_ids: list[int],
                 sessions: SessionTable, max_model_len: int, vocab_size: int, state_dir: Path) -> None:
        self.process, self.tokenizer, self.cfg = process, tokenizer, cfg
        self.eos_ids, self.sessions = set(eos_ids), sessions
        self.max_model_len, self.vocab_size = max_model_len, vocab_size
        self.versions_dir = state_dir / "vllm-versions"
        self.counters = EngineCounters()
        self.figures = VllmFigures()
        self.refills = RefillTracker(cfg.thrash_window_s)
        self.error: str | None = None
        self.probe_error: float | None = None  # the start probe's max |dlogp|
        self.on_release: Callable[[], None] | None = None
        self.on_fatal: Callable[[str], None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._client: httpx.AsyncClient | None = None
        self._tasks: dict[str, asyncio.Task] = {}
        self._background: set[asyncio.Task] = set()
        self._stopping = False
        self._timeout = cfg.vllm.request_timeout_s

    # ---- lifecycle (any thread but the loop's) ----
    def start(self) -> None:
        """Start vLLM (blocks until it is healthy) and the loop thread; idempotent."""
        if self._thread is not None:
            return
        self.process.start()
        self._loop = asyncio.new_event_loop()
        ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(ready,), name="burstrl-vllm", daemon=True)
        self._thread.start()
        ready.wait()
        if self.cfg.vllm.start_probe:
            try:
                self._prove_model()
            except BaseException:
                self.stop()
                raise

    def _prove_model(self, adapter: LoraAdapter | None = None) -> None:
        """The probe (`vllm.probe`): VllmStartError (AdapterError for a version) naming the mismatch if vLLM
        computes another model, or another version, than the checkpoint and the adapter say. Blocks."""
        error = VllmStartError if adapter is None else AdapterError
        what = "vLLM" if adapter is None else f"adapter {adapter.name!r}"
        ids = probe.probe_sequence(self.vocab_size)
        lora = None if adapter is None else versions.lora_name(adapter)
        # the first call after vLLM's start may wait on its warm-up: the start's deadline, not a call's
        deadline = self.cfg.vllm.start_timeout_s
        reply = self._call(afetch(self._client, "POST", "/inference/v1/generate", deadline=deadline,
                                  max_bytes=8 << 20, json=probe.request_body(ids, lora)), deadline)
        if reply.status != 200:
            raise error(f"{what}: the probe's call failed: {reply.status} {reply.body[:300]!r}")
        try:
            engine = probe.engine_logprobs(reply.json(), ids)
        except ValueError as exc:
            raise error(f"{what}: the probe: {exc}") from None
        reference = probe.reference_logprobs(self.process.model, ids, adapter)
        problem, worst, mean = probe.judge(engine, reference, self.process.dtype)
        if problem is not None:
            raise error(f"{what} refused by the probe: {problem}")
        if adapter is None:
            self.probe_error = worst
        log.info("%s proven on a %d-token probe (%s; max |dlogp| %.2g, mean %.2g)", what, len(ids),
                 self.process.dtype, worst, mean)

    def stop(self) -> None:
        if self._loop is not None and self._thread is not None and self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(timeout=60)
            self._thread.join(timeout=30)
        self.process.stop()

    @property
    def alive(self) -> bool:
        return (self._thread is not None and self._thread.is_alive() and self.error is None
                and not self._stopping and self.process.alive)

    # ---- calls (any thread) ----
    def submit(self, req: Request) -> None:
        if not self.alive:
            raise RuntimeError(f"engine is not running: {self.error or 'stopped'}")
        self._loop.call_soon_threadsafe(self._spawn, req)

    def abort(self, request_id: str) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._cancel, request_id)

    def drop_session(self, session_id: str) -> None:
        """Nothing to free in vLLM: its prefix cache is keyed by content, not by session."""
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self.refills.forget, session_id)

    # ---- versions ----
    def prove_adapter(self, adapter: LoraAdapter) -> float:
        """Write the version for vLLM, load it there and prove it (`_prove_model`; AdapterError if vLLM or the
        probe refuses it). Blocks: never call it on the loop's thread."""
        path = versions.write_peft(adapter, self.versions_dir)
        try:
            self._call(self._load(adapter, path), self._timeout * 4)
            if self.cfg.vllm.start_probe:
                self._prove_model(adapter)
        except BaseException:
            self.release_adapter(adapter)  # unloads it from vLLM and deletes its files
            raise
        return 0.0

    def release_adapter(self, adapter: LoraAdapter) -> None:
        """Unload the version from vLLM and delete its files (in the background: may run on the loop)."""
        if self._loop is None or self._loop.is_closed():
            versions.remove(adapter, self.versions_dir)
            return
        self._loop.call_soon_threadsafe(self._in_background, self._unload(adapter))

    # ---- load reporting (any thread; snapshots) ----
    def loads(self) -> dict:
        return loads_body(self.figures, self.sessions, len(self._tasks), self.refills)

    def prefix_summary(self, max_blocks: int = 16384) -> dict:
        return prefix_summary(self.sessions, max_blocks)

    def metric_rows(self) -> list[MetricRow]:
        return metric_rows(self.figures, self.counters, len(self._tasks), self.refills)

    # ---- the loop's thread ----
    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)
        self._client = httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=str(self.process.socket)),
                                         base_url=BASE, timeout=None,
                                         headers={"Authorization": f"Bearer {self.process.api_key}"})
        self._in_background(self._watch())
        ready.set()
        try:
            self._loop.run_forever()
        finally:
            self._loop.close()

    def _spawn(self, req: Request) -> None:
        if self._stopping or self.error is not None:
            req.error = f"engine is not running: {self.error or 'stopped'}"
            self._end(req)
            return
        self._tasks[req.id] = self._loop.create_task(self._generate(req))

    def _cancel(self, request_id: str) -> None:
        task = self._tasks.get(request_id)
        if task is not None:
            task.cancel()

    def _in_background(self, coro: Coroutine) -> None:
        task = self._loop.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _generate(self, req: Request) -> None:
        req.t_start = time.monotonic()
        lora = None if req.adapter is None else versions.lora_name(req.adapter)
        body = wire.generate_body(req, lora, self.eos_ids)
        response = None
        try:
            request = self._client.build_request("POST", "/inference/v1/generate", json=body)
            response = await aopen(self._client, request, header_deadline=self._timeout)
            if response.status_code != 200:
                raw = await response.aread()
                raise wire.WireError(f"vLLM answered {response.status_code}: {raw[:300].decode(errors='replace')}")
            async for event in wire.sse_events(achunks(response, gap=self._timeout)):
                self._take(req, event)
            if req.finish_reason is None:
                raise wire.WireError("vLLM's stream ended without a finish reason")
        except asyncio.CancelledError:  # an abort keeps the tokens so far; a shutdown fails the call
            req.finish_reason = "abort"
            if self.error is not None or self._stopping:
                req.error = f"vLLM died: {self.error}" if self.error else "replica shutting down"
        except (CallFailed, wire.WireError) as exc:
            req.error = f"vLLM: {exc}" if self.process.alive else f"vLLM died: {self.process.exit_reason()}"
        finally:
            self._tasks.pop(req.id, None)
            if response is not None:
                await asyncio.shield(response.aclose())
            self._end(req)

    def _take(self, req: Request, event: dict) -> None:
        added = wire.apply(req, event, self.eos_ids, self.vocab_size)
        if added:
            self.counters.generation_tokens += added
            if not req.t_first:
                req.t_first = time.monotonic()
            if req.on_token is not None:
                req.on_token(req)

    def _end(self, req: Request) -> None:
        """The call's one end (see `inference.calls`); a failed one frees its session uncaptured."""
        self.counters.prompt_tokens += len(req.prompt_ids)
        if req.error is not None:
            self.counters.failed_requests += 1
            report_done(req, "error", self.sessions, self.counters, self.cfg.capture)
            return
        self.refills.observe(req, self.figures.block_size)  # before the session takes this call
        if req.completion_ids:
            settle_session(req, _text(self.tokenizer, req))
        report_done(req, req.finish_reason or "abort", self.sessions, self.counters, self.cfg.capture)

    async def _watch(self) -> None:
        """Read vLLM's figures, expire idle sessions, and notice vLLM's death."""
        next_expiry = 0.0
        while not self._stopping:
            if not self.process.alive:
                self._died(self.process.exit_reason() or "vLLM exited")
                return
            try:
                reply = await afetch(self._client, "GET", "/metrics", deadline=self._timeout, max_bytes=8 << 20)
                if reply.status == 200:
                    self.figures = parse(reply.body.decode(errors="replace"))
            except CallFailed as exc:  # tolerated: the next scrape retries; death is judged by the process
                log.warning("vLLM /metrics: %s", exc)
            if time.monotonic() >= next_expiry:
                next_expiry = time.monotonic() + 1.0
                expired = self.sessions.expire()
                for session in expired:
                    self.refills.forget(session.id)
                if expired and self.on_release is not None:
                    self.on_release()
            await asyncio.sleep(self.cfg.vllm.metrics_interval_s)

    def _died(self, reason: str) -> None:
        self.error = reason
        log.error("vLLM died: %s\n%s", reason, self.process.log_tail())
        for task in list(self._tasks.values()):
            task.cancel()
        if self.on_fatal is not None:
            self.on_fatal(reason)

    async def _shutdown(self) -> None:
        self._stopping = True
        tasks = [*self._tasks.values(), *self._background]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self._client.aclose()
        self._loop.call_soon(self._loop.stop)

    async def _load(self, adapter: LoraAdapter, path: Path) -> None:
        name = versions.lora_name(adapter)
        reply = await afetch(self._client, "POST", "/v1/load_lora_adapter", deadline=self._timeout * 4,
                             max_bytes=1 << 16, json={"lora_name": name, "lora_path": str(path)})
        if reply.status != 200:
            raise AdapterError(f"adapter {adapter.name!r} refused by vLLM: {reply.body[:300].decode(errors='replace')}")

    async def _unload(self, adapter: LoraAdapter) -> None:
        try:
            await afetch(self._client, "POST", "/v1/unload_lora_adapter", deadline=self._timeout,
                         max_bytes=1 << 16, json={"lora_name": versions.lora_name(adapter)})
        except CallFailed as exc:  # tolerated: vLLM evicts it in time; its files go anyway
            log.warning("unloading %s from vLLM: %s", adapter.name, exc)
        finally:
            versions.remove(adapter, self.versions_dir)

    def _call(self, coro: Coroutine, deadline: float) -> Any:
        """Run `coro` on the loop and wait for it; `deadline` bounds the coroutine's own calls (afetch), the
        wait here gets a margin past it, so the call's own error (naming the deadline) is what surfaces."""
        if not self.alive:
            coro.close()
            raise RuntimeError(f"engine is not running: {self.error or 'stopped'}")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=deadline + 30)


def _text(tokenizer: Any, req: Request) -> str:
    """The completion's text, cut at the stop string that ended it (vLLM's ids run through it)."""
    text = tokenizer.decode(req.completion_ids, skip_special_tokens=True)
    if isinstance(req.stop_reason, str) and (at := text.find(req.stop_reason)) >= 0:
        text = text[:at]
    return text
