"""A replica's parts, wired: model, tokenizer, engine, adapter registry, sessions.

`build_replica` is what tests and benchmarks use in-process; `server.run_replica` adds the HTTP server.
`InferenceReplica` is everything a route handler needs (found on `request.app.state.replica`); this module
imports no HTTP code, so the route modules can import it without a cycle.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import stat
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from burstrl.config import ServeConfig
from burstrl.inference.adapters import AdapterRegistry
from burstrl.inference.backend import EngineBackend
from burstrl.inference.bulk import BulkReceiver, tls_context
from burstrl.inference.capture import CaptureLimits
from burstrl.inference.chat import ChatError, ChatTokenizer
from burstrl.inference.engine import Engine, default_threads
from burstrl.inference.limits import RequestLimits
from burstrl.inference.openai_api import TokenText
from burstrl.inference.sessions import SessionTable
from burstrl.inference.workers import RequestWorkers
from burstrl.protocol.process import pid_alive, read_owner, write_owner
from burstrl.protocol.versions import version_name
from burstrl.weights.volume import latest

log = logging.getLogger(__name__)


@dataclass
class ReplicaCounters:
    client_disconnects: int = 0
    bad_requests: int = 0
    adapters_loaded: int = 0
    uploads_refused: int = 0

    def refused_upload(self) -> None:
        self.uploads_refused += 1


@dataclass
class InferenceReplica:
    """Everything an HTTP handler needs; one per process."""

    cfg: ServeConfig
    engine: EngineBackend
    registry: AdapterRegistry
    sessions: SessionTable
    tokenizer: Any
    chat: ChatTokenizer | None
    text: TokenText
    admin_token: str
    cluster_token: str
    max_model_len: int
    state_dir: Path
    limits: RequestLimits  # request sizes checked before parsing (inference.limits)
    workers: RequestWorkers  # parse, render and tokenize off the event loop; stopped on close
    owns_state_dir: bool = False  # a temp dir made for this replica: removed on close
    counters: ReplicaCounters = field(default_factory=ReplicaCounters)
    bulk: BulkReceiver | None = None  # the shard listener (inference.bulk); stopped on close

    def collect_retired(self) -> None:
        """Free retiring adapter versions whose last session is gone."""
        for name in self.registry.collect(self.sessions.versions_in_use()):
            log.info("adapter %s freed (last session released)", name)

    def close(self) -> None:
        self.workers.close()
        if self.bulk is not None:
            self.bulk.close()
        self.engine.stop()
        if self.owns_state_dir:
            shutil.rmtree(self.state_dir, ignore_errors=True)


def build_replica(cfg: ServeConfig) -> InferenceReplica:
    """Load the model and start the engine (the caller owns `close()`)."""
    from burstrl.model.hf import load_tokenizer

    if not cfg.model.path:
        raise ValueError("model.path is required (burstrl serve --model DIR)")
    tokenizer = load_tokenizer(cfg.model.path)
    state_dir = _state_dir(cfg)
    if cfg.engine.backend == "vllm":
        from burstrl.inference.vllm.build import vllm_engine

        engine, registry, sessions, max_len = vllm_engine(cfg, tokenizer, state_dir, session_table)
    else:
        engine, registry, sessions, max_len = _own_engine(cfg, tokenizer, state_dir)
    try:
        chat = ChatTokenizer(tokenizer, cfg.content_special_tokens)
    except ChatError:
        chat = None
    replica = InferenceReplica(cfg=cfg, engine=engine, registry=registry, sessions=sessions, tokenizer=tokenizer,
                      chat=chat, text=TokenText(tokenizer), admin_token=_admin_token(cfg, state_dir),
                      cluster_token=cfg.server.cluster_token or os.environ.get("BURSTRL_CLUSTER_TOKEN", ""),
                      max_model_len=max_len, state_dir=state_dir, limits=RequestLimits.derive(cfg.limits, max_len),
                      workers=RequestWorkers(cfg.server.request_workers or default_threads()),
                      owns_state_dir=not cfg.server.state_dir)
    engine.on_release = replica.collect_retired
    registry.verify = engine.prove_adapter  # every version is proven on first load, as the model was at start
    registry.release = engine.release_adapter
    try:
        engine.start()
        for name, path in cfg.adapters.items():
            registry.load(name, path)
        if cfg.adapter_volume:
            _load_newest_version(registry, Path(cfg.adapter_volume))
        if cfg.server.bulk_port >= 0:
            replica.bulk = BulkReceiver(registry, replica.admin_token, cfg.server.host, cfg.server.bulk_port,
                                        cfg.server.max_shard_bytes,
                                        tls_context(cfg.server.ssl_certfile, cfg.server.ssl_keyfile),
                                        on_refused=replica.counters.refused_upload,
                                        tenant_key=cfg.server.tenant_key)
    except BaseException:
        replica.close()
        raise
    return replica


def _own_engine(cfg: ServeConfig, tokenizer: Any, state_dir: Path) -> tuple[Engine, AdapterRegistry, SessionTable, int]:
    """burstrl's own engine on the model loaded here, its registry checking versions against its layers."""
    from burstrl.model.hf import eos_token_ids, load_model

    model = load_model(cfg.model.path, cfg.model.dtype, cfg.model.device)
    max_len = cfg.engine.max_model_len or int(model.config.max_position_embeddings)
    budget = max(1, cfg.engine.max_total_num_tokens // cfg.engine.kv_block_size) * cfg.engine.kv_block_size
    if max_len > budget:  # the KV pool holds whole blocks: the budget rounded down to one
        log.warning("max_model_len %d exceeds the KV budget; capping it to %d", max_len, budget)
        max_len = budget
    sessions = session_table(cfg, max_len)
    engine = Engine(model, tokenizer, cfg.engine, eos_token_ids(model, tokenizer), sessions, max_len)
    registry = AdapterRegistry.for_layers(state_dir, engine.runner.layers, engine.runner.dtype,
                                          engine.runner.device, cfg.server.upload_ttl_s)
    return engine, registry, sessions, max_len


def session_table(cfg: ServeConfig, max_len: int) -> SessionTable:
    per_session = cfg.engine.capture_max_session_tokens or 4 * max_len
    return SessionTable(cfg.engine.session_ttl_s, cfg.engine.session_max_life_s,
                        CaptureLimits(per_session, cfg.engine.capture_max_total_tokens))


def _state_dir(cfg: ServeConfig) -> Path:
    if cfg.server.state_dir:
        state_dir = Path(cfg.server.state_dir)
        state_dir.mkdir(parents=True, exist_ok=True)
        return state_dir
    sweep_dead_state_dirs(Path(tempfile.gettempdir()))
    return make_state_dir(Path(tempfile.gettempdir()))


STATE_PREFIX = "burstrl-replica-"


def make_state_dir(parent: Path) -> Path:
    """A private temp state dir recording its owner (pid + start time), so that when this replica is
    killed (SIGKILL, preemption) the next replica on the host can tell the dir is garbage."""
    path = Path(tempfile.mkdtemp(prefix=STATE_PREFIX, dir=parent))
    write_owner(path)
    return path


def sweep_dead_state_dirs(parent: Path, min_age_s: float = 60.0) -> list[Path]:
    """Remove temp state dirs of replicas that died without `close()`: each holds the replica's
    generated admin token (a secret left behind per death, forever, on a host whose replicas are
    preempted; before uploads were staged in memory, also ~10 MB of shards and adapters).

    A dir without an owner record is left alone for `min_age_s` (its owner may be creating it);
    dirs of other users are never touched. Returns the dirs removed.
    """
    removed = []
    for path in parent.glob(STATE_PREFIX + "*"):
        try:
            st = path.lstat()
        except FileNotFoundError:
            continue
        if stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and not _owner_alive(path, st, min_age_s):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    if removed:
        log.info("removed %d state dirs of dead replicas under %s", len(removed), parent)
    return removed


def _owner_alive(path: Path, st: os.stat_result, min_age_s: float) -> bool:
    owner = read_owner(path)
    try:
        return pid_alive(int(owner["owner_pid"]), owner.get("owner_start"))
    except (KeyError, TypeError, ValueError, AttributeError):  # no or torn record: judge by age
        return time.time() - st.st_mtime < min_age_s


def _load_newest_version(registry: AdapterRegistry, volume: Path) -> None:
    """A late joiner serves the newest published version at once instead of after the next push."""
    found = latest(volume)
    if found is None:
        log.info("adapter volume %s holds no version: serving the base model only", volume)
        return
    version, path = found
    name = version_name(version)
    if name not in registry.names():
        registry.load(name, path)
    log.info("loaded %s from the adapter volume (%s)", name, path)


def _admin_token(cfg: ServeConfig, state_dir: Path) -> str:
    """Configured token, else $BURSTRL_ADMIN_TOKEN, else a fresh one written to state_dir (0600)."""
    token = cfg.server.admin_token or os.environ.get("BURSTRL_ADMIN_TOKEN", "")
    if token:
        return token
    token = secrets.token_urlsafe(24)
    path = state_dir / "admin_token"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token)
    print(f"admin token written to {path}", file=sys.stderr)
    return token
