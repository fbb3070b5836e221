"""The tenant launcher's catch-up push (`launcher/catch_up.py`, issue 51) against a real replica with tenants.

A replica of a shared fleet that joins late gets the tenant's newest version from the tenant: the one a
late joiner of a run's own fleet loads from the volume (the newest that verifies), in the tenant's
namespace, in the serving dtype, shard count of the trainer's ranks. A replica that cannot be reached
is counted and tried again a few times, never raised; a URL already caught up is not pushed again.
"""

from __future__ import annotations

import json
import shutil
import socket
import time
from collections.abc import Iterator
from http.server import ThreadingHTTPServer
from pathlib import Path

import pytest

from burstrl.launcher.catch_up import MAX_TRIES, CatchUp
from burstrl.protocol.tenants import tenant_token
from burstrl.weights.volume import publish
from tests.http_client import HTTP
from tests.loopback import JsonHandler, serving

from .conftest import Server, start_server, stop_server

KEY = "catch-up-tenant-key"
TOKEN = tenant_token(KEY, "run-a")


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    srv = start_server(tiny_model_dir, tmp_path_factory.mktemp("catch-up"), "--server.tenant_key", KEY)
    try:
        yield srv
    finally:
        stop_server(srv)


@pytest.fixture(scope="module")
def volume(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """policy-v1, policy-v2 and a broken policy-v3 (a late joiner skips it: it does not verify)."""
    from burstrl.model.lora import make_random_adapter

    root = tmp_path_factory.mktemp("catch-up-volume")
    for v in (1, 2, 3):
        publish(root / "adapters", v, make_random_adapter(tiny_model_dir, root / f"src{v}", seed=40 + v))
    with open(root / "adapters" / "policy-v3" / "adapter_model.safetensors", "r+b") as f:
        f.truncate(100)
    return root / "adapters"


def tenant_models(server: Server) -> list[str]:
    r = HTTP.get(server.url + "/v1/models", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)
    assert r.status_code == 200, r.text
    return [m["id"] for m in r.json()["data"]]


def settle(catch_up: CatchUp, urls: list[str], timeout_s: float = 60.0) -> None:
    """Poll as the launcher does until no batch runs and nothing is pending."""
    deadline = time.monotonic() + timeout_s
    catch_up.poll(urls)
    while catch_up.thread is not None or catch_up.pending:
        assert time.monotonic() < deadline, f"catch-up still busy: {catch_up.pending}"
        catch_up.poll(urls)
        time.sleep(0.05)


def dead_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"  # closed on exit: nothing listens there


def test_a_new_replica_gets_the_newest_version_and_a_dead_one_is_counted(server: Server, volume: Path) -> None:
    events: list[tuple[str, str]] = []
    catch_up = CatchUp(volume, TOKEN, True, lambda n, d: events.append((n, d)), senders=2, dtype="bfloat16",
                       retry_s=0.2)
    assert "policy-v2" not in tenant_models(server)
    dead = dead_url()
    start = time.monotonic()
    settle(catch_up, [server.url, dead])
    took = time.monotonic() - start
    print(f"caught up in {took:.2f} s; events: {events}")
    served = tenant_models(server)
    assert "policy-v2" in served and "policy-v1" not in served and "policy-v3" not in served, served
    admin = server.get("/v1/models")["data"]
    assert "run-a~policy-v2" in [m["id"] for m in admin], "stored in the tenant's namespace"
    answer = HTTP.post(server.url + "/v1/completions", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60,
                       json={"model": "policy-v2", "prompt": "a b", "max_tokens": 2})
    assert answer.status_code == 200, answer.text
    assert catch_up.pushes == 1 and catch_up.failures == MAX_TRIES and catch_up.given_up == 1
    assert [n for n, _ in events].count("catch_up_push") == 1
    assert [n for n, _ in events].count("catch_up_failed") == MAX_TRIES
    assert [n for n, _ in events].count("catch_up_given_up") == 1
    assert catch_up.counts() == {"catch_up_pushes": 1, "catch_up_failures": MAX_TRIES, "catch_up_given_up": 1}
    # a URL still listed is not pushed again; one that left and came back is asked, and already serves it
    settle(catch_up, [server.url])
    settle(catch_up, [])
    settle(catch_up, [server.url])
    assert catch_up.pushes == 1 and [n for n, _ in events].count("catch_up_push") == 1
    catch_up.close()


def test_an_empty_volume_sends_nothing(server: Server, tmp_path: Path) -> None:
    events: list[tuple[str, str]] = []
    catch_up = CatchUp(tmp_path / "adapters", TOKEN, True, lambda n, d: events.append((n, d)))
    settle(catch_up, [server.url])
    assert catch_up.pushes == 0 and catch_up.failures == 0 and not events
    catch_up.close()


class FleetListing(JsonHandler):
    """A shared fleet's router as a tenant launcher asks it: only `GET /v1/fleet/replicas`, with the token."""

    replicas: list[str] = []
    url = ""  # where the fixture serves it

    def do_GET(self) -> None:  # noqa: N802 - the http.server name
        ok = self.path == "/v1/fleet/replicas" and self.headers.get("Authorization") == f"Bearer {TOKEN}"
        self.send_json(200 if ok else 401, {"replicas": self.replicas} if ok else {"error": {"message": "no"}})


@pytest.fixture
def fleet_listing() -> Iterator[type[FleetListing]]:
    """A loopback fleet that lists one replica nothing listens on (each test sets its own list)."""
    handler = type("Listing", (FleetListing,), {"replicas": [dead_url()]})
    with serving(ThreadingHTTPServer(("127.0.0.1", 0), handler)) as url:
        handler.url = url
        yield handler


def test_a_given_up_catch_up_shows_in_the_runs_fleet_jsonl(fleet_listing: type[FleetListing], volume: Path,
                                                          tmp_path: Path) -> None:
    """The tenant launcher's samples carry `catch_up_given_up` and its events a `catch_up_given_up`:
    a late replica that never got the run's newest version is visible in the run's own record."""
    from burstrl.config import RunConfig
    from burstrl.launcher.display import Display
    from burstrl.launcher.tenant_run import TenantLauncher

    shutil.copytree(volume, tmp_path / "adapters")
    cfg = RunConfig.model_validate({"run_dir": str(tmp_path / "run"), "weights": {"volume": str(tmp_path / "adapters")},
                                    "fleet": {"url": fleet_listing.url, "token": TOKEN}})
    launcher = TenantLauncher(cfg, live=False)
    try:
        assert not launcher.prepare()
        launcher.display = Display(launcher.run_dir, cfg.trainer.steps, live=False)
        launcher.catch_up.retry_s = 0.05
        deadline = time.monotonic() + 60.0
        while not launcher.catch_up.given_up:  # the launcher's loop, less its roles
            assert time.monotonic() < deadline, launcher.catch_up.pending
            launcher.catch_up.poll(launcher.fleet_replicas)
            time.sleep(0.05)
        launcher.sample(force=True)
    finally:
        launcher.catch_up.close()
        launcher.store.close()
        launcher.stop_children()
    rows = [json.loads(line) for line in (launcher.run_dir / "fleet.jsonl").read_text().splitlines()]
    [sample] = [r for r in rows if r["kind"] == "sample"]
    assert sample["catch_up_given_up"] == 1 and sample["catch_up_failures"] == MAX_TRIES
    assert sample["catch_up_pushes"] == 0
    [given_up] = [r for r in rows if r.get("event") == "catch_up_given_up"]
    assert fleet_listing.replicas[0] in given_up["detail"], rows
