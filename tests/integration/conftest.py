"""Real replica processes on loopback for the integration tests."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from burstrl.protocol.process import RoleProcess, start_replica
from burstrl.store import RolloutStore
from tests.http_client import HTTP

ADMIN_TOKEN = "test-admin-token"


@dataclass
class Server:
    url: str
    replica: RoleProcess

    def admin(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {ADMIN_TOKEN}"}

    def get(self, path: str) -> dict:
        """GET with the admin token (traces and per-session loads need it)."""
        r = HTTP.get(self.url + path, headers=self.admin(), timeout=30)
        r.raise_for_status()
        return r.json()

    def metric(self, name: str) -> float:
        text = HTTP.get(self.url + "/metrics", timeout=30).text
        for line in text.splitlines():
            if line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
        raise KeyError(name)


def start_server(model_dir: Path, workdir: Path, *overrides: str) -> Server:
    """A replica child process (its own process group) on a free loopback port."""
    rep = start_replica(model_dir, workdir, "--server.admin_token", ADMIN_TOKEN,
                        "--server.state_dir", str(workdir / "state"), "--engine.num_threads", "1", *overrides)
    return Server(url=rep.url, replica=rep)


def stop_server(server: Server) -> None:
    server.replica.stop()


@contextmanager
def routed_replicas(model_dir: Path, root: Path, n: int, replica_args: tuple[str, ...] = (),
                    router_args: tuple[str, ...] = ()) -> Iterator[tuple[RoleProcess, list[Server]]]:
    """`n` replicas started at once (`replica_args`) behind a router listing them (`router_args`);
    all stopped when the block ends."""
    from burstrl.protocol import process

    with ThreadPoolExecutor(n) as pool:
        servers = list(pool.map(lambda i: start_server(model_dir, root / f"r{i}", *replica_args), range(n)))
    router = None
    try:
        router = process.start_router(root / "router", "--replicas", json.dumps([s.url for s in servers]),
                                      *router_args)
        yield router, servers
    finally:
        if router is not None:
            router.stop()
        for s in servers:
            stop_server(s)


@pytest.fixture(scope="session")
def adapters(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two random LoRA versions of the tiny model, in PEFT format."""
    from burstrl.model.lora import make_random_adapter

    root = tmp_path_factory.mktemp("adapters")
    return {name: make_random_adapter(tiny_model_dir, root / name, seed=seed)
            for name, seed in (("policy-v1", 1), ("policy-v2", 2))}


@pytest.fixture(scope="module")
def replica(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """An in-process replica (engine thread, no HTTP) on the tiny model."""
    from burstrl.config import ServeConfig
    from burstrl.inference.replica import build_replica

    cfg = ServeConfig.model_validate({
        "model": {"path": str(tiny_model_dir)},
        "engine": {"num_threads": 1},
        "server": {"admin_token": "t", "state_dir": str(tmp_path_factory.mktemp("state"))},
    })
    rep = build_replica(cfg)
    yield rep
    rep.close()


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    srv = start_server(tiny_model_dir, tmp_path_factory.mktemp("replica"))
    yield srv
    stop_server(srv)


@pytest.fixture(scope="session")
def hf_greedy(tiny_model_dir: Path):
    """Reference decoding with no engine and no cache: HF `generate`, greedy, EOS ignored."""
    import torch

    from burstrl.model.hf import load_model

    model = load_model(tiny_model_dir, "float32", "cpu")

    def run(ids: list[int], n: int) -> list[int]:
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        return out[0, len(ids):].tolist()

    return run


@pytest.fixture
def tls_cert(tmp_path: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 and its key (skips where openssl is missing)."""
    import shutil
    import subprocess

    if shutil.which("openssl") is None:
        pytest.skip("openssl CLI not installed")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    return cert, key


def commit_step_one(store_path: Path, stop: threading.Event, ready: Callable[[RolloutStore], bool],
                    max_groups: int) -> list:
    """A stand-in trainer: once `ready(store)` (or `stop`), takes up to `max_groups` buffered groups and
    commits step 1, which ends an orchestrator run of one step. Returns the groups taken."""
    store = RolloutStore(store_path)
    try:
        while not stop.is_set() and not ready(store):
            stop.wait(0.2)
        taken = store.take(max_groups, trainer_version=0, max_staleness=1000)
        store.commit_step(1, [g.id for g in taken], {"trainer_version": 0})
        return taken
    finally:
        store.close()


def run_until_step_one(orch: Any, store_path: Path, ready: Callable[[RolloutStore], bool], max_groups: int,
                       timeout: float) -> list:
    """Run `orch` (an Orchestrator of one step) while `commit_step_one` stands in for the trainer in a
    thread; the groups it took. The orchestrator returns once step 1 is committed."""

    async def go() -> list:
        stop = threading.Event()
        taken = asyncio.get_running_loop().run_in_executor(
            ThreadPoolExecutor(1), commit_step_one, store_path, stop, ready, max_groups)
        try:
            await asyncio.wait_for(orch.run(), timeout=timeout)
        finally:
            stop.set()
        return await taken

    return asyncio.run(go())


def sampled_logprobs(model: torch.nn.Module, ids: list[int], start: int) -> torch.Tensor:
    """Log-probabilities of ids[start:] under one HF forward of the whole sequence (float32)."""
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    return logp[start - 1:-1].gather(1, torch.tensor(ids[start:])[:, None])[:, 0]


def reference_logprobs(model_dir: Path, adapter: Path | None, ids: list[int], start: int) -> torch.Tensor:
    """`sampled_logprobs` under an fp32 load of the model (PEFT applies the adapter, if any)."""
    from burstrl.model.hf import load_model

    model = load_model(model_dir, "float32", "cpu")
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter))
    return sampled_logprobs(model, ids, start)
