"""A run on a shared fleet (`--fleet.url` + `--fleet.token`): what its config must say, and what it keeps to itself.

The live fleet and two tenants training on it are tests/e2e/test_shared_fleet.py.
"""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from burstrl.config import ConfigError, RunConfig, load_tree
from burstrl.config.roles import RouteConfig
from burstrl.protocol.tenants import tenant_token

from .test_cli import burstrl

KEY = "shared-fleet-key"
TOKEN = tenant_token(KEY, "run-a")


def config(**fleet: object) -> RunConfig:
    return RunConfig.model_validate({"fleet": fleet})


@pytest.mark.parametrize(("fleet", "message"), [
    ({"url": "http://127.0.0.1:1"}, "fleet.url is set but fleet.token is empty"),
    ({"token": TOKEN}, "fleet.token is set but fleet.url is empty"),
    ({"url": "127.0.0.1:1", "token": TOKEN}, "fleet.url must start with http://"),
    ({"url": "http://h:1", "token": "not-a-token"}, "fleet.token is not a tenant token"),
    ({"url": "http://h:1", "token": "Run_A.abc"}, "fleet.token is not a tenant token"),
])
def test_a_shared_fleet_needs_its_url_and_a_tenant_token(fleet: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        config(**fleet)


def test_chaos_and_the_autoscaler_are_the_fleets_not_a_tenants() -> None:
    fleet = {"url": "http://h:1", "token": TOKEN}
    with pytest.raises(ValueError, match="kills no replicas"):
        RunConfig.model_validate({"fleet": fleet, "chaos": {"kill_fraction": 0.5, "at_step": 1}})
    with pytest.raises(ValueError, match="does not size it"):
        RunConfig.model_validate({"fleet": fleet, "autoscale": {"enabled": True}})


def test_the_tenant_is_the_tokens_name_and_pool_counts_are_ignored() -> None:
    cfg = config(url="http://h:1", token=TOKEN, reserved=0, on_demand=0)
    assert cfg.tenant() == "run-a"
    assert config().tenant() == ""
    with pytest.raises(ValueError, match="at least one replica"):
        config(reserved=0, on_demand=0)


def test_an_unknown_fleet_key_is_refused_by_name() -> None:
    with pytest.raises(ConfigError, match="fleet.urll"):
        load_tree(RunConfig, [], {"fleet": {"urll": "http://h:1"}})


def test_the_cli_refuses_a_fleet_url_without_a_token_before_starting_anything(tmp_path: Path) -> None:
    run_dir = tmp_path / "never"
    out = burstrl("run", "--run_dir", str(run_dir), "--fleet.url", "http://127.0.0.1:9", "--dry-run")
    assert out.returncode == 2 and "fleet.token is empty" in out.stderr and "Traceback" not in out.stderr
    assert not run_dir.exists()


def test_a_fleet_that_does_not_answer_is_refused_before_the_run_directory_is_made(tmp_path: Path) -> None:
    from burstrl.launcher.run import LaunchError
    from burstrl.launcher.tenant_run import TenantLauncher

    cfg = RunConfig.model_validate({"run_dir": str(tmp_path / "run"),
                                    "fleet": {"url": "http://127.0.0.1:1", "token": TOKEN}})
    launcher = TenantLauncher(cfg)
    try:
        with pytest.raises(LaunchError, match="did not list its replicas for tenant run-a"):
            launcher.prepare()
    finally:
        launcher.provider.close()
    assert not (tmp_path / "run").exists()


def test_the_saved_run_config_holds_no_token(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from burstrl.launcher.tenant_run import TenantLauncher

    monkeypatch.setattr(TenantLauncher, "ask_fleet", lambda self: ["http://r:1"])
    cfg = RunConfig.model_validate({"run_dir": str(tmp_path / "run"), "fleet": {"url": "http://h:1", "token": TOKEN}})
    launcher = TenantLauncher(cfg)
    try:
        assert not launcher.prepare()
        assert (launcher.run_dir / "replicas.txt").read_text() == "http://r:1\n"
        assert launcher.provider.zygote is None, "a tenant starts no replicas: no zygote to fork them"
        assert launcher.env["BURSTRL_TENANT_TOKEN"] == TOKEN == launcher.env["BURSTRL_ADMIN_TOKEN"]
        saved = (launcher.run_dir / "run_config.toml").read_text()
        assert TOKEN.partition(".")[2] not in saved and "http://h:1" in saved
    finally:
        launcher.store.close()
        launcher.provider.close()


def test_fleet_up_keeps_its_key_private_and_across_restarts(tmp_path: Path) -> None:
    from burstrl.launcher.shared_fleet import tenant_key

    key = tenant_key(tmp_path)
    assert stat.S_IMODE((tmp_path / "tenant.key").stat().st_mode) == 0o600
    assert tenant_key(tmp_path) == key and len(key) == 64


def test_fleet_status_without_a_fleet_says_so(tmp_path: Path) -> None:
    out = burstrl("fleet", "status", "--run_dir", str(tmp_path))
    assert out.returncode == 2 and "no fleet is up there" in out.stderr


def test_fleet_replicas_route_answers_tenants_and_the_cluster_only() -> None:
    """Healthy replicas that take new sessions, to a tenant token or the cluster token; a 401 to anyone else."""
    from burstrl.router.server import Router, build_app

    router = Router(RouteConfig(tenant_key=KEY, cluster_token="cluster", scrape_s=3600), "cluster")
    with TestClient(build_app(router)) as client:  # replicas added after the start's scrape: none runs again
        for url, pool in (("http://r:1", "reserved"), ("http://o:1", "on_demand"), ("http://d:1", "on_demand")):
            router.registry.add(url, pool)
            router.registry.apply_scrape(url, {"max_total_num_tokens": 1000, "versions": ["base"]},
                                         {"data": [{"id": "base"}]})
        router.registry.replicas["http://d:1"].draining = True
        for token in (TOKEN, "cluster"):
            r = client.get("/v1/fleet/replicas", headers={"Authorization": f"Bearer {token}"})
            assert r.status_code == 200 and r.json() == {"replicas": ["http://o:1", "http://r:1"]}, r.text
        for headers in ({}, {"Authorization": f"Bearer {tenant_token('other-key', 'run-a')}"}):
            assert client.get("/v1/fleet/replicas", headers=headers).status_code == 401
        # when each tenant last asked: the cluster token's to read (the fleet releases quiet tenants)
        assert client.get("/v1/fleet/tenants", headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 401
        asked = client.get("/v1/fleet/tenants", headers={"Authorization": "Bearer cluster"}).json()["tenants"]
        assert list(asked) == ["run-a"] and 0 <= asked["run-a"] < 60
