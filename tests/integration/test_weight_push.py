"""Publishing versions to real replica processes: sharded push, faults, late joiners, retirement."""

from __future__ import annotations

import socket
import ssl
import threading
from pathlib import Path

import httpx
import pytest

from burstrl.weights.gc import unload_old
from burstrl.weights.push import PushReport, ReplicaTarget, push, push_commit, push_shards
from burstrl.weights.volume import publish
from tests.http_client import HTTP

from .conftest import ADMIN_TOKEN, Server, start_server, stop_server

PROMPT = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def pair(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """Two replica processes, started at the same time."""
    servers: list[Server] = []
    errors: list[BaseException] = []

    dirs = [tmp_path_factory.mktemp(f"replica{i}") for i in range(2)]  # not in the threads: pytest's
    # first mktemp on a worker creates its base directory, and two at once race on that mkdir

    def start(i: int) -> None:
        try:
            servers.append(start_server(tiny_model_dir, dirs[i]))
        except BaseException as exc:  # noqa: BLE001 - re-raised below, after the other start
            errors.append(exc)

    threads = [threading.Thread(target=start, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        if errors:
            raise errors[0]
        yield sorted(servers, key=lambda s: s.url)
    finally:
        for srv in servers:
            stop_server(srv)


@pytest.fixture(scope="module")
def volume(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A versions directory with policy-v1 .. policy-v4 (random adapters of the tiny model)."""
    from burstrl.model.lora import make_random_adapter

    root = tmp_path_factory.mktemp("weights")
    for v in range(1, 5):
        publish(root / "adapters", v, make_random_adapter(tiny_model_dir, root / f"src{v}", seed=10 + v))
    return root / "adapters"


def targets(servers: list[Server], token: str = ADMIN_TOKEN) -> list[ReplicaTarget]:
    return [ReplicaTarget(url=s.url, token=token) for s in servers]


def models(server: Server) -> list[str]:
    return [m["id"] for m in server.get("/v1/models")["data"]]


def greedy(server: Server, model: str) -> tuple[list[int], list[float]]:
    body = {"model": model, "messages": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            "logprobs": True, "return_token_ids": True}
    r = HTTP.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["meta_info"]["weight_version"] == model
    choice = out["choices"][0]
    return choice["token_ids"], [t["logprob"] for t in choice["logprobs"]["content"]]


def closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


@pytest.mark.parametrize("senders,version", [(1, 1), (3, 2)])
def test_push_makes_a_version_servable_on_every_replica(pair: list[Server], volume: Path,
                                                        senders: int, version: int) -> None:
    name, path = f"policy-v{version}", volume / f"policy-v{version}"
    report = push(path, name, targets(pair), senders=senders)
    assert report.failed == {} and sorted(report.ok) == [s.url for s in pair], report
    assert report.retries == 0 and report.bytes_sent > 2 * path.joinpath("adapter_model.safetensors").stat().st_size
    for srv in pair:
        assert name in models(srv)
    # the pushed bytes serve exactly what the same directory loaded directly serves
    direct = f"direct-v{version}"
    r = HTTP.post(pair[0].url + "/v1/load_lora_adapter", headers=pair[0].admin(),
                  json={"lora_name": direct, "lora_path": str(path)}, timeout=60)
    assert r.status_code == 200, r.text
    ids_a, lp_a = greedy(pair[0], name)
    ids_b, lp_b = greedy(pair[1], name)
    ids_d, lp_d = greedy(pair[0], direct)
    assert ids_a == ids_b == ids_d and len(ids_a) == 8
    assert lp_a == pytest.approx(lp_d, abs=1e-5) and lp_b == pytest.approx(lp_d, abs=1e-5)
    assert greedy(pair[0], "base") != (ids_a, lp_a)  # the adapter is really applied


def test_ranks_push_their_own_shards_then_rank_zero_commits(pair: list[Server], volume: Path) -> None:
    """The trainer's flow: W ranks each pack and send their shards; a barrier; rank 0 commits."""
    name, path, world = "policy-v3", volume / "policy-v3", 4
    packed = [push_shards(path, name, targets(pair), rank=r, world_size=world) for r in range(world)]
    manifests, reports = [m for m, _ in packed], [r for _, r in packed]
    assert [len(r.ok) for r in reports] == [2] * world
    assert all(m == manifests[0] for m in manifests)  # every rank packed the same bytes
    sent = PushReport.merge(reports)
    assert sent.ok == reports[0].ok and sent.failed == {}
    committed = push_commit(path, name, sent.usable(targets(pair)), world_size=world, manifest=manifests[0])
    assert sorted(committed.ok) == [s.url for s in pair] and committed.failed == {}
    assert all(name in models(s) for s in pair)
    again = push(path, name, targets(pair), senders=2)  # a resumed trainer pushing the same version
    assert sorted(again.already) == sorted(again.ok) == [s.url for s in pair] and again.bytes_sent == 0


def test_a_replica_that_is_down_is_reported_and_the_others_serve(pair: list[Server], volume: Path) -> None:
    dead = closed_port_url()
    report = push(volume / "policy-v4", "policy-v4", [*targets(pair), ReplicaTarget(dead, ADMIN_TOKEN)],
                  senders=2, retries=2, backoff_s=0.01)
    assert sorted(report.ok) == [s.url for s in pair]
    assert list(report.failed) == [dead] and "ConnectError" in report.failed[dead]
    assert "refused" in report.failed[dead] and report.retries == 0  # nothing listens: no backoff
    assert all("policy-v4" in models(s) for s in pair)


def test_a_wrong_token_is_reported_with_the_401(pair: list[Server], volume: Path,
                                                tiny_model_dir: Path, tmp_path: Path) -> None:
    from burstrl.model.lora import make_random_adapter

    path = publish(volume, 5, make_random_adapter(tiny_model_dir, tmp_path / "v5", seed=15))
    good, bad = pair[0], pair[1]
    report = push(path, "policy-v5", [ReplicaTarget(good.url, ADMIN_TOKEN), ReplicaTarget(bad.url, "wrong")],
                  senders=2, backoff_s=0.01)
    assert report.ok == [good.url] and list(report.failed) == [bad.url]
    assert "HTTP 401" in report.failed[bad.url] and "bearer token" in report.failed[bad.url]
    assert report.retries == 0  # a 4xx is not retried
    assert "policy-v5" in models(good) and "policy-v5" not in models(bad)


@pytest.mark.slow  # 2-6 s: kept out of the fast lane
def test_a_late_joiner_serves_the_newest_version_at_once(tiny_model_dir: Path, volume: Path,
                                                         tmp_path: Path) -> None:
    from burstrl.model.lora import make_random_adapter

    newest = publish(volume, 9, make_random_adapter(tiny_model_dir, tmp_path / "v9", seed=19))
    broken = publish(volume, 10, newest)  # same files as v9, then damaged: must be skipped
    (broken / "adapter_model.safetensors").write_bytes(b"truncated")
    srv = start_server(tiny_model_dir, tmp_path / "late", "--adapter_volume", str(volume))
    try:
        served = models(srv)
        assert "policy-v9" in served and "policy-v10" not in served
        assert greedy(srv, "policy-v9")[0]
        assert "loaded policy-v9 from the adapter volume" in srv.replica.log.read_text()
        report = push(newest, "policy-v9", targets([srv]))  # it already serves it: nothing to send
        assert report.already == [srv.url] and report.bytes_sent == 0
    finally:
        stop_server(srv)


@pytest.mark.slow  # 2-6 s: kept out of the fast lane
def test_a_replica_with_an_empty_volume_serves_the_base_model(tiny_model_dir: Path, tmp_path: Path) -> None:
    srv = start_server(tiny_model_dir, tmp_path / "empty", "--adapter_volume", str(tmp_path / "none"))
    try:
        assert models(srv) == ["base"]
    finally:
        stop_server(srv)


@pytest.mark.slow
def test_push_over_tls_checks_the_certificate(tiny_model_dir: Path, volume: Path, tmp_path: Path,
                                              tls_cert: tuple[Path, Path]) -> None:
    cert, key = tls_cert
    srv = start_server(tiny_model_dir, tmp_path / "tls", "--server.ssl_certfile", str(cert),
                       "--server.ssl_keyfile", str(key))
    try:
        untrusted = push(volume / "policy-v1", "policy-v1", [ReplicaTarget(srv.url, ADMIN_TOKEN)], retries=0)
        assert list(untrusted.failed) == [srv.url] and "CERTIFICATE_VERIFY_FAILED" in untrusted.failed[srv.url]
        trusted = push(volume / "policy-v1", "policy-v1", [ReplicaTarget(srv.url, ADMIN_TOKEN, verify=str(cert))],
                       senders=2)
        assert trusted.ok == [srv.url] and trusted.failed == {}
        r = httpx.get(srv.url + "/v1/models", verify=ssl.create_default_context(cafile=str(cert)))
        assert "policy-v1" in [m["id"] for m in r.json()["data"]]
    finally:
        stop_server(srv)


def test_unload_old_retires_old_versions(pair: list[Server], volume: Path) -> None:
    for v in (6, 7):
        report = push(publish(volume, v, volume / "policy-v4"), f"policy-v{v}", targets(pair))
        assert not report.failed, report
    pinned = {"model": "policy-v6", "messages": PROMPT, "max_tokens": 2, "session_id": "pinned-v6"}
    assert HTTP.post(pair[0].url + "/v1/chat/completions", json=pinned, timeout=60).status_code == 200
    report = unload_old(targets(pair), keep_names={"policy-v7"})
    assert report.failed == {} and sorted(report.ok) == [s.url for s in pair]
    assert report.unloaded[pair[0].url]["policy-v6"] == "retiring"  # its session still runs on it
    assert report.unloaded[pair[1].url]["policy-v6"] == "unloaded"
    for srv in pair:
        served = models(srv)
        assert "policy-v7" in served
        assert all(n in ("base", "policy-v7") or n.startswith("direct-") for n in served)  # others left alone
    again = HTTP.post(pair[0].url + "/v1/chat/completions", json=pinned, timeout=60)
    assert again.status_code == 200  # the pinned rollout finishes on its version
    assert "policy-v6" in pair[0].get("/v1/loads")["retiring_versions"]
    assert HTTP.delete(pair[0].url + "/v1/traces/pinned-v6", headers=pair[0].admin()).status_code == 200
    assert "policy-v6" not in pair[0].get("/v1/loads")["retiring_versions"]


def test_shards_go_to_the_bulk_listener_while_the_replica_keeps_serving(pair: list[Server], volume: Path) -> None:
    bulk = pair[0].get("/v1/adapters/bulk")
    assert isinstance(bulk["port"], int) and bulk["tls"] is False
    assert HTTP.get(pair[0].url + "/v1/adapters/bulk", timeout=30).status_code == 401  # admin only
    path = publish(volume, 8, volume / "policy-v4")
    answers: list[int] = []
    done = threading.Event()

    def poll() -> None:
        while not done.is_set():
            answers.append(HTTP.get(pair[0].url + "/health", timeout=60).status_code)

    poller = threading.Thread(target=poll)
    poller.start()
    try:
        report = push(path, "policy-v8", targets(pair), senders=2)
    finally:
        done.set()
        poller.join()
    assert report.failed == {} and sorted(report.ok) == [s.url for s in pair], report
    assert answers and set(answers) == {200}
    assert "policy-v8" in models(pair[0]) and "policy-v8" in models(pair[1])
    root = {m["id"]: m["root"] for m in pair[0].get("/v1/models")["data"]}["policy-v8"]
    assert root.startswith("upload:sha256:")  # loaded from the pushed bytes, not from a directory


@pytest.mark.slow  # 2-6 s: kept out of the fast lane
def test_a_replica_without_a_bulk_listener_takes_shards_on_its_main_server(tiny_model_dir: Path, volume: Path,
                                                                          tmp_path: Path) -> None:
    srv = start_server(tiny_model_dir, tmp_path / "nobulk", "--server.bulk_port", "-1")
    try:
        assert srv.get("/v1/adapters/bulk") == {"port": None, "tls": False}
        report = push(volume / "policy-v2", "policy-v2", [ReplicaTarget(srv.url, ADMIN_TOKEN)], senders=2)
        assert report.ok == [srv.url] and report.failed == {}, report
        ids, _ = greedy(srv, "policy-v2")
        assert len(ids) == 8
    finally:
        stop_server(srv)


@pytest.mark.slow  # a trainer and a replica, ~12 CPU-s: make test only (the fast lane keeps the push itself)
def test_the_trainer_pushes_its_serving_dtype_and_the_replica_serves_those_values(
        pair: list[Server], tiny_model_dir: Path, tmp_path: Path) -> None:
    """`weights.serving_dtype = bfloat16` (auto with model.dtype bfloat16): the trainer casts before
    packing, the push carries about half the bytes, the volume keeps float32, and each replica serves
    exactly what loading the cast files directly serves."""
    from burstrl.config import ModelConfig, TrainConfig, WeightsConfig
    from burstrl.model.lora import make_random_adapter
    from burstrl.trainer.dist import Dist
    from burstrl.trainer.publish import publish_version, serving_dtype, serving_files

    adapter = make_random_adapter(tiny_model_dir, tmp_path / "adapter", seed=21)
    sent = {}
    for step, dtype in ((31, "float32"), (32, "bfloat16")):
        cfg = TrainConfig(run_dir=str(tmp_path / "run"), model=ModelConfig(dtype=dtype),
                          weights=WeightsConfig(volume=str(tmp_path / "volume"), replicas=[s.url for s in pair],
                                                admin_token=ADMIN_TOKEN, async_push=False))
        assert serving_dtype(cfg) == dtype  # auto follows model.dtype
        figures = publish_version(cfg, step, adapter, Dist())
        assert figures["push_ok"] == 2, figures
        sent[dtype] = figures["push_bytes"]
    assert sent["bfloat16"] < 0.6 * sent["float32"]
    volume_file = tmp_path / "volume" / "policy-v32" / "adapter_model.safetensors"
    assert volume_file.read_bytes() == (adapter / "adapter_model.safetensors").read_bytes()  # float32 kept
    cast_dir = tmp_path / "cast"
    cast_dir.mkdir()
    for name, data in serving_files(adapter, "bfloat16").items():
        (cast_dir / name).write_bytes(data)
    r = HTTP.post(pair[0].url + "/v1/load_lora_adapter", headers=pair[0].admin(),
                  json={"lora_name": "direct-bf16", "lora_path": str(cast_dir)}, timeout=60)
    assert r.status_code == 200, r.text
    ids_d, lp_d = greedy(pair[0], "direct-bf16")
    for srv in pair:
        ids, lp = greedy(srv, "policy-v32")
        assert ids == ids_d and lp == pytest.approx(lp_d, abs=1e-5)
    assert greedy(pair[0], "policy-v31")[1] != lp_d  # float32 serves other values: the cast really happened
