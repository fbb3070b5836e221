"""The `torch` engine: a continuous-batching decode loop with session caches and capture.

One thread owns the model, the KV storage and the budget. HTTP handlers hand it `Request`s through
`submit` and get called back (`on_token`, `on_done`) from that thread. Each iteration: take new
requests and aborts, admit waiting requests while the budget allows (prefill each over its
session's cached prefix, sample its first token), then run one decode step for every running
request. Requests therefore join and leave the batch at token boundaries, and a batch mixes
sessions, lengths and adapter versions freely.

Failures stay with their request: a row whose distribution cannot be sampled, or whose callback
raises, fails alone with an error; a forward pass that raises fails the requests of that step and
the loop goes on. Only a bug in the loop's own bookkeeping stops it (then `error` says why, every
waiting request is failed, and `on_fatal` lets the process exit so the fleet replaces it).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch

from burstrl.config import EngineConfig
from burstrl.inference.backend import MetricRow
from burstrl.inference.calls import report_done, settle_session
from burstrl.inference.kvcache import SessionCache
from burstrl.inference.load_report import LoadReport
from burstrl.inference.lora import AdapterError, LoraAdapter, LoraBatch, LoraStacks
from burstrl.inference.paged import KVPool, SequenceKV
from burstrl.inference.paged_attention import PagedDecode, PagedPrefill, RowsOutOfBlocks
from burstrl.inference.prefix import block_hashes
from burstrl.inference.probe import adapter_mismatch, select_runner
from burstrl.inference.request import EngineCounters, Request
from burstrl.inference.sampling import History, sample
from burstrl.inference.sessions import SessionTable

log = logging.getLogger(__name__)


def default_threads() -> int:
    """The cores this process may run on (affinity-aware, so containers are not oversubscribed)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def _crash_point() -> int | None:
    """`BURSTRL_CRASH=engine@N`: the loop dies once N requests have finished (the tests' way to
    reach the dead-engine path now that no request can); unset, nothing happens."""
    spec = os.environ.get("BURSTRL_CRASH", "")
    return int(spec.split("@", 1)[1]) if spec.startswith("engine@") else None


class Engine:
    """Owns the model runner, the decode batch and the session caches; runs in one thread."""

    def __init__(self, model: torch.nn.Module, tokenizer, cfg: EngineConfig, eos_ids: list[int],
                 sessions: SessionTable, max_model_len: int,
                 on_release: Callable[[], None] | None = None,
                 on_fatal: Callable[[str], None] | None = None) -> None:
        torch.set_num_threads(cfg.num_threads or default_threads())
        self.cfg = cfg
        self.runner, self.probe_error = select_runner(model, cfg.path)  # refuses a model no path computes exactly
        self.tokenizer = tokenizer
        self.eos_ids = set(eos_ids)
        self.sessions = sessions
        self.max_model_len = max_model_len
        self.on_release = on_release
        self.on_fatal = on_fatal
        self.raw_logprobs = cfg.logprobs_mode == "raw"
        r = self.runner
        windows = r.layer_windows if cfg.kv_window_only else None  # sliding layers keep their window only
        self.pool = KVPool.for_tokens(cfg.max_total_num_tokens, r.num_layers, r.num_kv_heads, r.head_dim,
                                      r.dtype, r.device, cfg.kv_block_size, windows)  # all the KV memory there is
        self.cache = SessionCache(self.pool, cfg.thrash_window_s)
        self.rows: list[Request] = []
        self.waiting: deque[Request] = deque()
        self.counters = EngineCounters()
        self.error: str | None = None
        self._inbox: deque[Request] = deque()
        self._aborts: set[str] = set()
        self._drops: list[str] = []
        self._jobs: deque[tuple[Callable[[], Any], Future]] = deque()
        self._cv = threading.Condition()
        self._stop = False
        self._thread: threading.Thread | None = None
        self._gen = torch.Generator(device=r.device)
        self._gen.manual_seed(cfg.seed)
        self._lora: LoraBatch | None = None
        self._lora_dirty = True
        self._lora_stacks = LoraStacks()  # mixed batches' concatenated adapters (engine thread only)
        self._next_expiry = 0.0
        self._crash_after = _crash_point()
        self._report = LoadReport(sessions, self.cache,
                                  lambda: (len(self.rows), len(self.waiting) + len(self._inbox)))

    # ---- public, any thread ----
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="burstrl-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout=30)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    def submit(self, req: Request) -> None:
        if not self.alive:
            raise RuntimeError(f"engine is not running: {self.error or 'stopped'}")
        req.generator = req.params.generator(self.runner.device)
        with self._cv:
            self._inbox.append(req)
            self._cv.notify()

    def abort(self, request_id: str) -> None:
        """Stop a request at the next token boundary (its client went away)."""
        with self._cv:
            self._aborts.add(request_id)
            self._cv.notify()

    def drop_session(self, session_id: str) -> None:
        """Free a released session's idle cache."""
        with self._cv:
            self._drops.append(session_id)
            self._cv.notify()

    def prove_adapter(self, adapter: LoraAdapter, timeout_s: float = 600.0) -> float:
        """The start probe for a LoRA version's first load (AdapterError naming the mismatch, else the
        probe's max |dlogp|). Runs between engine steps: it briefly hooks the served model."""
        problem, err = self.call_between_steps(lambda: adapter_mismatch(self.runner, adapter), timeout_s)
        if problem is not None:
            raise AdapterError(f"adapter {adapter.name!r} refused: {problem}")
        log.info("adapter %s proven on the %s path (max |dlogp| %.2g)", adapter.name, self.runner.path, err)
        return err

    def call_between_steps(self, fn: Callable[[], Any], timeout_s: float) -> Any:
        """fn() on the engine thread between two iterations (or here, before the engine starts)."""
        if self._thread is None:
            return fn()
        if not self.alive:
            raise RuntimeError(f"engine is not running: {self.error or 'stopped'}")
        done: Future = Future()
        with self._cv:
            self._jobs.append((fn, done))
            self._cv.notify()
        return done.result(timeout=timeout_s)

    # ---- engine thread ----
    def _run(self) -> None:
        try:
            while self._iterate():
                pass
            for req in [*self.waiting, *self._inbox]:  # stopping: nobody is left waiting forever
                req.error = "replica shutting down"
                self._report_done(req, "abort")
            self._fail_jobs("replica shutting down")
            for i in reversed(range(len(self.rows))):
                self.rows[i].finish_reason = "abort"
                self._leave(i)
        except Exception as exc:  # the engine is dead: fail every request loudly, keep the reason
            log.exception("engine loop failed")
            self.error = f"{type(exc).__name__}: {exc}"
            for req in [*self.rows, *self.waiting, *self._inbox]:
                req.error = self.error
                self._report_done(req, "error")
            self._fail_jobs(f"engine died: {self.error}")  # a prover waiting on a dead engine hears at once
            if self.on_fatal is not None:
                self.on_fatal(self.error)
            raise

    def _fail_jobs(self, why: str) -> None:
        with self._cv:
            jobs, self._jobs = self._jobs, deque()
        for _, done in jobs:
            done.set_exception(RuntimeError(why))

    def _iterate(self) -> bool:
        with self._cv:
            if not (self._inbox or self._aborts or self._drops or self._jobs or self.waiting or self.rows):
                self._cv.wait(timeout=1.0)
            if self._stop:
                return False
            self.waiting.extend(self._inbox)
            self._inbox.clear()
            aborts, self._aborts = self._aborts, set()
            drops, self._drops = self._drops, []
            jobs, self._jobs = self._jobs, deque()
        for fn, done in jobs:
            try:
                done.set_result(fn())
            except Exception as exc:  # tolerated: the job's caller gets the error, the engine serves on
                done.set_exception(exc)
        if self._crash_after is not None and sum(self.counters.requests.values()) >= self._crash_after:
            raise RuntimeError("engine crash injected by BURSTRL_CRASH")
        for session_id in drops:
            self.cache.drop(session_id)
        if aborts:
            self._apply_aborts(aborts)
        self._expire_sessions()
        self._admit()
        if self.rows:
            self._decode_step()
        return True

    def _apply_aborts(self, ids: set[str]) -> None:
        for req in [r for r in self.waiting if r.id in ids]:
            self.waiting.remove(req)
            self._report_done(req, "abort")
        for i in reversed(range(len(self.rows))):
            if self.rows[i].id in ids:
                self.rows[i].finish_reason = "abort"
                self._leave(i)

    def _expire_sessions(self) -> None:
        now = time.monotonic()
        if now < self._next_expiry:
            return
        self._next_expiry = now + 1.0
        expired = self.sessions.expire()
        for s in expired:
            self.cache.drop(s.id)
        if expired and self.on_release is not None:
            self.on_release()

    def _admit(self) -> None:
        """Take waiting requests (FCFS) while rows, prefill tokens and the KV budget allow."""
        prefill_budget, admitted = self.cfg.max_prefill_tokens, []
        while (self.waiting and len(self.rows) + len(admitted) < self.cfg.max_running_requests
               and prefill_budget > 0):
            req = self.waiting[0]
            sid = req.session.id
            kv, reuse, shared = None, 0, False
            if self.cfg.session_cache and not req.session.ephemeral:
                kv, reuse = self.cache.take(sid, req.prompt_ids, req.namespace)
            if kv is None and self.cfg.prefix_sharing:
                if self._better_after(req, admitted):
                    break  # shares more with a request prefilled now: admit next iteration, share it
                kv, reuse = self.cache.share(req.prompt_ids, req.namespace)
                shared = kv is not None
            kv = kv if kv is not None else SequenceKV.new(self.pool)
            need, req.steady = kv.blocks_needed(self.pool, len(req.prompt_ids),
                                                len(req.prompt_ids) + req.params.max_tokens)
            if need > self.pool.num_blocks:  # could never fit: fail it rather than block the queue
                self._refuse(req, kv, shared, need)
                continue
            if not self.cache.reserve(need):
                self._give_back(req, kv, shared)
                break
            self.waiting.popleft()
            self.cache.record(sid, len(req.prompt_ids), reuse, shared)
            req.reserved, req.cached_tokens, req.t_start = need, reuse, time.monotonic()
            req.kv = kv
            prefill_budget -= len(req.prompt_ids) - reuse
            admitted.append(req)
        if admitted:
            self._prefill(admitted)

    def _give_back(self, req: Request, kv: SequenceKV, shared: bool) -> None:
        """A request not admitted after all: a shared prefix is let go, its session's cache kept."""
        if shared or kv.length == 0:
            kv.release(self.pool)
        else:
            self.cache.put(req.session.id, kv, req.prompt_ids, req.namespace)

    def _refuse(self, req: Request, kv: SequenceKV, shared: bool, need: int) -> None:
        """Fail the head of the queue, which needs more blocks than the whole pool has."""
        self.waiting.popleft()
        self._give_back(req, kv, shared)
        self.counters.failed_requests += 1
        groups = self.pool.sequence_blocks
        per = f" (over {groups} layer groups)" if groups > 1 else ""
        req.error = (f"prompt + max_tokens need {need} KV blocks of {self.pool.block_size} tokens{per}; "
                     f"the whole budget is {self.pool.num_blocks}")
        self._report_done(req, "error")

    def _better_after(self, req: Request, admitted: list[Request]) -> bool:
        """Does `req` share more prompt blocks with one being admitted than with any cache now?

        Rollouts of a GRPO group arrive together with the same prompt: prefilling the first and
        copying its prefix into the others next iteration beats prefilling every one of them.
        """
        if not admitted:
            return False
        mine = block_hashes(req.prompt_ids, namespace=req.namespace)
        if not mine:
            return False
        now = self.cache.prefixes.longest(req.prompt_ids, req.namespace)[1]
        for other in admitted:
            if other.namespace != req.namespace:
                continue
            theirs = block_hashes(other.prompt_ids, limit=len(req.prompt_ids), namespace=other.namespace)
            common = next((i for i, (a, b) in enumerate(zip(mine, theirs, strict=False)) if a != b), min(len(mine), len(theirs)))
            if common > now:
                return True
        return False

    def _prefill(self, reqs: list[Request]) -> None:
        """One packed forward over every admitted request's uncached suffix; sample first tokens."""
        t0 = time.monotonic()
        device = self.runner.device
        new = [r.prompt_ids[r.cached_tokens:] for r in reqs]
        ids = torch.tensor([[t for n in new for t in n]], device=device)
        positions = torch.cat([torch.arange(r.cached_tokens, len(r.prompt_ids)) for r in reqs])[None].to(device)
        lora = None
        if any(r.adapter is not None for r in reqs):
            lora = LoraBatch([r.adapter for r, n in zip(reqs, new, strict=False) for _ in n], per_token=True,
                             stacks=self._lora_stacks)
        try:
            attention = PagedPrefill(self.pool, [r.kv for r in reqs], [len(n) for n in new], self.runner.scaling)
            select = torch.tensor(attention.last_positions, device=device)
            logits = self.runner.forward(ids, positions, attention, lora, select=select)
        except Exception as exc:  # tolerated: these requests fail, the engine serves the rest
            self._step_failed("prefill", exc, reqs)
            return
        attention.commit()
        self.cache.hold_running(sum(r.kv.held_tokens(self.pool) for r in reqs))
        for req in reqs:
            self.cache.unreserve(req.reserved - req.steady)  # a sliding group's prefill peak is over
            req.reserved = req.steady
            req.session.kv_tokens = req.kv.length
        self.counters.prompt_tokens += ids.shape[1]
        self.counters.prefill_s += time.monotonic() - t0
        for req, outcome in zip(reqs, self._sample(logits, reqs), strict=False):
            if isinstance(outcome, str) or (finished := self._append(req, *outcome)) is None:
                self.cache.release_running(req.kv.held_tokens(self.pool))
                self._fail(req, outcome if isinstance(outcome, str) else req.error)
            elif finished:
                self._finish(req)
            else:
                self.rows.append(req)
                self._lora_dirty = True
                if self.cfg.prefix_sharing:
                    self.cache.add_running(req.id, req.kv, req.prompt_ids, req.namespace)

    def _decode_step(self) -> None:
        t0 = time.monotonic()
        step = self._prepare_step()
        if step is None:
            return
        rows = self.rows
        ids = torch.tensor([[r.completion_ids[-1]] for r in rows], device=self.runner.device)
        try:
            logits = self.runner.forward(ids, step.positions, step, self._lora_batch())
        except Exception as exc:  # tolerated: the running requests fail, the engine serves the rest
            self._step_failed("decode", exc, [self._drop_row(i) for i in reversed(range(len(rows)))])
            return
        self.cache.hold_running(step.advance())
        done, failed = [], {}
        for i, (req, outcome) in enumerate(zip(rows, self._sample(logits, rows), strict=False)):
            req.session.kv_tokens += 1
            if isinstance(outcome, str) or (finished := self._append(req, *outcome)) is None:
                failed[i] = outcome if isinstance(outcome, str) else req.error
            elif finished:
                done.append(i)
        self.counters.decode_steps += 1
        self.counters.decode_s += time.monotonic() - t0
        for i in sorted([*done, *failed], reverse=True):
            if i in failed:
                self._fail(self._drop_row(i), failed[i])
            else:
                self._leave(i)

    def _prepare_step(self) -> PagedDecode | None:
        """A slot for every row's next token; a row the pool cannot give one fails alone.

        Reservations at admission make this impossible while the budget bookkeeping is right;
        it is here so that a bookkeeping bug costs requests, not the engine."""
        while self.rows:
            step = PagedDecode(self.pool, [r.kv for r in self.rows], self.runner.scaling)
            try:
                step.prepare()
                return step
            except RowsOutOfBlocks as exc:
                log.error("decode: %s", exc)
                for i in sorted(exc.rows, reverse=True):
                    self._fail(self._drop_row(i), f"decode failed: {exc}")
        return None

    def _lora_batch(self) -> LoraBatch | None:
        if self._lora_dirty:
            batch = LoraBatch([r.adapter for r in self.rows], stacks=self._lora_stacks)
            self._lora = None if batch.empty else batch
            self._lora_dirty = False
        return self._lora

    def _sample(self, logits: torch.Tensor, reqs: list[Request]) -> list[tuple | str]:
        """Per request: (token, logprob, top, shown logprob, shown top), or an error message."""
        params = [r.params for r in reqs]
        histories = ([History(r.prompt_ids, r.completion_ids) for r in reqs]
                     if any(p.adjusts for p in params) else None)
        out = sample(logits, params, [r.generator for r in reqs], self._gen, histories,
                     tuple(self.eos_ids), self.raw_logprobs)
        results: list[tuple | str] = []
        for i in range(len(reqs)):
            if i in out.errors:
                results.append(out.errors[i])
                continue
            top = out.top[i] if out.top else None
            shown_top = out.shown_top[i] if out.shown_top else None
            results.append((out.tokens[i], out.logprobs[i], top, out.shown[i], shown_top))
        return results

    def _append(self, req: Request, token: int, logprob: float, top: list | None, shown: float,
                shown_top: list | None) -> bool | None:
        """Record a sampled token; True when the request is finished, None when it failed (req.error)."""
        req.logprobs.append(logprob)
        req.shown_logprobs.append(shown)  # before completion_ids: streaming readers index by its length
        if top is not None:
            req.top_logprobs.append(top)
            req.shown_top.append(shown_top)
        req.completion_ids.append(token)
        if not req.t_first:
            req.t_first = time.monotonic()
        self.counters.generation_tokens += 1
        try:
            req.finish_reason = self._finish_reason(req, token)
            if req.on_token is not None:
                req.on_token(req)
        except Exception as exc:  # tolerated: a stop check or callback failed for this request only
            log.exception("request %s failed after a token", req.id)
            req.error = f"{type(exc).__name__}: {exc}"
            return None
        return req.finish_reason is not None

    def _finish_reason(self, req: Request, token: int) -> str | None:
        p, n = req.params, len(req.completion_ids)
        if n > p.min_tokens:  # before min_tokens, EOS and stop ids are masked and stop strings wait
            if token in self.eos_ids and not p.ignore_eos:
                return "stop"
            if token in p.stop_token_ids:
                req.stop_reason = token
                return "stop"
            if p.stop and self._hit_stop(req):
                return "stop"
        if n >= p.max_tokens or len(req.prompt_ids) + n >= self.max_model_len:
            return "length"
        return None

    def _hit_stop(self, req: Request) -> bool:
        text = self.tokenizer.decode(req.completion_ids, skip_special_tokens=True)
        window = len(text) - max(len(s) for s in req.params.stop) - 8
        cuts = [(i, s) for s in req.params.stop if (i := text.find(s, max(0, window))) >= 0]
        if cuts:
            at, req.stop_reason = min(cuts)
            req.text = text[:at]
        return bool(cuts)

    def _step_failed(self, stage: str, exc: Exception, reqs: list[Request]) -> None:
        log.exception("%s forward failed; failing its %d request(s)", stage, len(reqs))
        self.counters.step_failures += 1
        for req in reqs:
            self._fail(req, f"{stage} failed: {type(exc).__name__}: {exc}")

    def _drop_row(self, row: int) -> Request:
        """Take a failed request out of the batch; its keys/values are discarded, not cached."""
        req = self.rows[row]
        self.cache.remove_running(req.id)
        self.cache.release_running(req.kv.held_tokens(self.pool))
        self.rows[row] = self.rows[-1]
        self.rows.pop()
        self._lora_dirty = True
        return req

    def _fail(self, req: Request, message: str | None) -> None:
        """End one request with an error: its budget is returned, its cache dropped, its session freed."""
        self.counters.failed_requests += 1
        self.cache.unreserve(req.reserved)
        if req.kv is not None:
            req.kv.release(self.pool)
        req.reserved, req.kv = 0, None
        req.session.kv_tokens = 0
        req.error = message or "request failed"
        self._report_done(req, "error")

    def _leave(self, row: int) -> None:
        req = self.rows[row]
        self.cache.remove_running(req.id)
        self.rows[row] = self.rows[-1]
        self.rows.pop()
        self._lora_dirty = True
        self._finish(req)

    def _finish(self, req: Request) -> None:
        """Return the request's budget, keep its cache for the session's next call, capture it."""
        kv, session = req.kv, req.session
        self.cache.release_running(kv.held_tokens(self.pool))
        self.cache.unreserve(req.reserved)
        fed = req.prompt_ids + req.completion_ids[:-1]
        assert kv.length == len(fed), (kv.length, len(fed))
        if self.cfg.session_cache and not session.ephemeral:
            self.cache.put(session.id, kv, fed, req.namespace)
        else:
            kv.release(self.pool)
            session.kv_tokens = 0
        if req.text is None:
            req.text = self.tokenizer.decode(req.completion_ids, skip_special_tokens=True)
        settle_session(req, req.text)
        req.kv = None
        self._report_done(req, req.finish_reason or "abort")

    def _report_done(self, req: Request, reason: str) -> None:
        report_done(req, reason, self.sessions, self.counters, self.cfg.capture)

    # ---- load reporting (read from any thread; values are a snapshot) ----
    @property
    def path(self) -> str:
        """"fast" (own layer math) or "generic" (the model's forward)."""
        return self.runner.path

    @property
    def vocab_size(self) -> int:
        return self.runner.vocab_size

    def release_adapter(self, adapter: LoraAdapter) -> None:
        """Nothing to do: the version's tensors go with its last reference, its KV namespace with them."""

    def metric_rows(self) -> list[MetricRow]:
        return self._report.metric_rows(self.counters)

    def prefix_summary(self, max_blocks: int = 16384) -> dict:
        return self._report.prefix_summary(max_blocks)

    def loads(self) -> dict:
        return self._report.loads()
