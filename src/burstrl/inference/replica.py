"""A replica process: load the model, start the engine, serve HTTP until stopped.

`build_replica` wires the parts (model, tokenizer, engine, adapter registry, sessions) and is what
tests and benchmarks use in-process; `serve` adds the HTTP server on a socket it binds itself, so
that `--server.port 0` works and the bound URL is printed as one JSON line (`{"event": "ready"}`)
for whoever launched it.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import socket
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from burstrl.config import ServeConfig
from burstrl.inference.adapters import AdapterRegistry
from burstrl.inference.chat import ChatError, ChatTokenizer
from burstrl.inference.engine import Engine
from burstrl.inference.openai_api import TokenText
from burstrl.inference.sessions import SessionTable
from burstrl.weights.volume import latest, version_name

log = logging.getLogger(__name__)


@dataclass
class ReplicaCounters:
    client_disconnects: int = 0
    bad_requests: int = 0
    adapters_loaded: int = 0
    uploads_refused: int = 0


@dataclass
class Replica:
    """Everything an HTTP handler needs; one per process."""

    cfg: ServeConfig
    engine: Engine
    registry: AdapterRegistry
    sessions: SessionTable
    tokenizer: Any
    chat: ChatTokenizer | None
    text: TokenText
    admin_token: str
    cluster_token: str
    max_model_len: int
    state_dir: Path
    owns_state_dir: bool = False  # a temp dir made for this replica: removed on close
    counters: ReplicaCounters = field(default_factory=ReplicaCounters)

    def collect_retired(self) -> None:
        """Free retiring adapter versions whose last session is gone."""
        for name in self.registry.collect(self.sessions.versions_in_use()):
            log.info("adapter %s freed (last session released)", name)

    def close(self) -> None:
        self.engine.stop()
        if self.owns_state_dir:
            shutil.rmtree(self.state_dir, ignore_errors=True)


def build_replica(cfg: ServeConfig) -> Replica:
    """Load the model and start the engine thread (the caller owns `close()`)."""
    from burstrl.model.hf import eos_token_ids, load_model, load_tokenizer

    if not cfg.model.path:
        raise ValueError("model.path is required (burstrl serve --model DIR)")
    model = load_model(cfg.model.path, cfg.model.dtype, cfg.model.device)
    tokenizer = load_tokenizer(cfg.model.path)
    max_len = cfg.engine.max_model_len or int(model.config.max_position_embeddings)
    if max_len > cfg.engine.max_total_num_tokens:
        log.warning("max_model_len %d exceeds the KV budget; capping it to %d",
                    max_len, cfg.engine.max_total_num_tokens)
        max_len = cfg.engine.max_total_num_tokens
    state_dir = Path(cfg.server.state_dir or tempfile.mkdtemp(prefix="burstrl-replica-"))
    state_dir.mkdir(parents=True, exist_ok=True)
    sessions = SessionTable(cfg.engine.session_ttl_s)
    engine = Engine(model, tokenizer, cfg.engine, eos_token_ids(model, tokenizer), sessions, max_len)
    registry = AdapterRegistry.for_layers(state_dir, engine.runner.layers, engine.runner.dtype,
                                          engine.runner.device, cfg.server.upload_ttl_s)
    try:
        chat = ChatTokenizer(tokenizer)
    except ChatError:
        chat = None
    replica = Replica(cfg=cfg, engine=engine, registry=registry, sessions=sessions, tokenizer=tokenizer,
                      chat=chat, text=TokenText(tokenizer), admin_token=_admin_token(cfg, state_dir),
                      cluster_token=cfg.server.cluster_token or os.environ.get("BURSTRL_CLUSTER_TOKEN", ""),
                      max_model_len=max_len, state_dir=state_dir, owns_state_dir=not cfg.server.state_dir)
    engine.on_release = replica.collect_retired
    for name, path in cfg.adapters.items():
        registry.load(name, path)
    if cfg.adapter_volume:
        _load_newest_version(registry, Path(cfg.adapter_volume))
    engine.start()
    return replica


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


def bind_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP, not 0: asyncio disables Nagle only on sockets whose protocol says TCP; with 0, every
    # request after the first on a kept-alive connection waited ~40 ms for a delayed ACK.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def serve(cfg: ServeConfig) -> None:
    """Run a replica until SIGINT/SIGTERM; prints a ready line with the URL once listening."""
    import uvicorn

    from burstrl.inference.server import build_app

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    replica = build_replica(cfg)
    sock = bind_socket(cfg.server.host, cfg.server.port)
    tls = bool(cfg.server.ssl_certfile)
    host, port = sock.getsockname()[:2]
    url = f"{'https' if tls else 'http'}://{host if ':' not in host else f'[{host}]'}:{port}"
    def ready() -> None:
        print(json.dumps({"event": "ready", "url": url, "pid": os.getpid()}), flush=True)

    app = build_app(replica, on_ready=ready)
    config = uvicorn.Config(app, log_level="warning", ssl_certfile=cfg.server.ssl_certfile or None,
                            ssl_keyfile=cfg.server.ssl_keyfile or None, timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)

    def engine_died(error: str) -> None:  # 503 for a while, then exit so the fleet replaces us
        log.error("engine died (%s): answering 503, exiting in %.1f s", error, cfg.server.dead_engine_exit_s)
        timer = threading.Timer(cfg.server.dead_engine_exit_s, lambda: setattr(server, "should_exit", True))
        timer.daemon = True  # owned by the process, which ends when it fires
        timer.start()

    replica.engine.on_fatal = engine_died
    try:
        server.run(sockets=[sock])
    finally:
        replica.close()
    if replica.engine.error is not None:
        raise SystemExit(f"replica stopped: engine died: {replica.engine.error}")
