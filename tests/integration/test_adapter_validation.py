"""A bad adapter or upload fails alone with a 4xx: the replica's engine keeps serving everyone else."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file

from burstrl.protocol.adapters import Manifest, shard_root
from tests.http_client import HTTP

from .conftest import Server

pytestmark = pytest.mark.slow  # real processes: `make test` runs it, `make test-fast` (<= 2 min) does not

COMPLETION = {"model": "base", "prompt": [1, 2, 3], "max_tokens": 4}


def _copy(good: Path, out: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    out.mkdir()
    return (json.loads((good / "adapter_config.json").read_text()),
            load_file(str(good / "adapter_model.safetensors")))


def _write(out: Path, cfg: dict, tensors: dict[str, torch.Tensor]) -> Path:
    (out / "adapter_config.json").write_text(json.dumps(cfg))
    save_file(tensors, str(out / "adapter_model.safetensors"))
    return out


def _key(tensors: dict, module: str, ab: str) -> str:
    return next(k for k in tensors if "layers.0." in k and f".{module}.lora_{ab}." in k)


def _bad_adapter(good: Path, out: Path, case: str) -> Path:
    """A copy of the good adapter broken in one way (see BAD_CASES)."""
    cfg, tensors = _copy(good, out)
    a, b = _key(tensors, "q_proj", "A"), _key(tensors, "down_proj", "B")
    if case == "wide_a":
        tensors[a] = torch.randn(tensors[a].shape[0], tensors[a].shape[1] + 1)
    elif case == "tall_b":
        tensors[b] = torch.randn(tensors[b].shape[0] + 1, tensors[b].shape[1])
    elif case == "rank_mismatch":
        tensors[a] = torch.randn(tensors[a].shape[0] + 1, tensors[a].shape[1])
    elif case in ("nan", "inf"):
        tensors[b] = tensors[b].clone()
        tensors[b][0, 0] = float(case)
    elif case == "int_tensor":
        tensors[a] = tensors[a].to(torch.int32)
    elif case == "r_zero":
        cfg["r"] = 0
    elif case == "r_string":
        cfg["r"] = "4"
    elif case == "alpha_nan":
        cfg["lora_alpha"] = float("nan")
    _write(out, cfg, tensors)
    if case == "bad_json":
        (out / "adapter_config.json").write_text("{not json")
    elif case == "truncated_safetensors":
        data = (out / "adapter_model.safetensors").read_bytes()
        (out / "adapter_model.safetensors").write_bytes(data[: len(data) // 2])
    return out


BAD_CASES = ["wide_a", "tall_b", "rank_mismatch", "nan", "inf", "int_tensor", "r_zero", "r_string",
             "alpha_nan", "bad_json", "truncated_safetensors"]


def still_serves(server: Server) -> None:
    r = HTTP.post(server.url + "/v1/completions", json=COMPLETION, timeout=60)
    assert r.status_code == 200, r.text
    assert HTTP.get(server.url + "/health", timeout=30).status_code == 200


def refused(r: httpx.Response, status: int | None = None) -> dict:
    assert 400 <= r.status_code < 500, (r.status_code, r.text)
    assert status is None or r.status_code == status, (r.status_code, r.text)
    error = r.json()["error"]
    assert isinstance(error, dict) and error["message"]
    return error


def load(server: Server, name: str, path: Path | str) -> httpx.Response:
    return HTTP.post(server.url + "/v1/load_lora_adapter", headers=server.admin(), timeout=60,
                     json={"lora_name": name, "lora_path": str(path)})


@pytest.mark.parametrize("case", BAD_CASES)
def test_bad_adapter_is_refused_and_the_replica_keeps_serving(server: Server, adapters: dict[str, Path],
                                                               tmp_path: Path, case: str) -> None:
    bad = _bad_adapter(adapters["policy-v1"], tmp_path / case, case)
    name = f"bad-{case.replace('_', '-')}"
    error = refused(load(server, name, bad), 400)
    assert str(bad) in error["message"]
    assert name not in [m["id"] for m in server.get("/v1/models")["data"]]
    assert HTTP.post(server.url + "/v1/completions", json={**COMPLETION, "model": name}).status_code == 404
    still_serves(server)


@pytest.mark.parametrize("where", ["missing", "file"])
def test_lora_path_that_is_not_a_directory_is_400(server: Server, adapters: dict[str, Path], where: str) -> None:
    path = adapters["policy-v1"] / ("nowhere" if where == "missing" else "adapter_config.json")
    error = refused(load(server, f"bad-path-{where}", path), 400)
    assert "not a directory" in error["message"]
    still_serves(server)


def test_good_adapter_still_loads_and_serves(server: Server, adapters: dict[str, Path]) -> None:
    r = load(server, "good-after-bad", adapters["policy-v2"])
    assert r.status_code == 200, r.text
    r = HTTP.post(server.url + "/v1/completions", json={**COMPLETION, "model": "good-after-bad"}, timeout=60)
    assert r.status_code == 200, r.text
    still_serves(server)


def test_consistent_non_tar_upload_is_refused(server: Server) -> None:
    """Shards and manifest agree with each other, but the bytes are no tar: 4xx, not 500."""
    name, blob, n = "junk-upload", b"this is not a tar archive " * 100, 3
    step = -(-len(blob) // n)
    shards = [blob[i * step:(i + 1) * step] for i in range(n)]
    digests = [hashlib.sha256(s).hexdigest() for s in shards]
    manifest = Manifest(name=name, num_shards=n, total_bytes=len(blob), sha256=shard_root(digests),
                        shard_sha256=digests)
    for i, data in enumerate(shards):
        r = HTTP.put(f"{server.url}/v1/adapters/{name}/shards/{i}", params={"of": n}, content=data,
                     headers={**server.admin(), "X-Shard-SHA256": manifest.shard_sha256[i]}, timeout=60)
        assert r.status_code == 200, r.text
    r = HTTP.put(f"{server.url}/v1/adapters/{name}/manifest", json=manifest.to_json(), headers=server.admin())
    assert r.status_code == 200, r.text
    error = refused(HTTP.post(f"{server.url}/v1/adapters/{name}/commit", headers=server.admin(), timeout=60))
    assert "tar" in error["message"]
    still_serves(server)
