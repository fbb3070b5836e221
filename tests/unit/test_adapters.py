import hashlib
import io
import json
import tarfile

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import Qwen3Config, Qwen3ForCausalLM

from burstrl.inference.adapters import AdapterRegistry, Manifest, UploadError, pack_adapter
from burstrl.inference.lora import AdapterError, load_adapter

CPU = torch.device("cpu")
LAYERS = 2


def _make_adapter(path, seed):
    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    lora = LoraConfig(r=2, lora_alpha=4, init_lora_weights=False,
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    get_peft_model(Qwen3ForCausalLM(cfg), lora).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def adapter_dirs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("peft")
    return _make_adapter(tmp / "one", seed=1), _make_adapter(tmp / "two", seed=2)


@pytest.fixture
def registry(tmp_path):
    return AdapterRegistry(tmp_path / "state", LAYERS, torch.float32, CPU)


def _staging(registry, name):
    return registry.state_dir / "uploads" / name


def _upload(registry, name, manifest, shards, with_sha=True, order=None):
    for i in order if order is not None else range(len(shards)):
        sha = manifest.shard_sha256[i] if with_sha else None
        registry.put_shard(name, i, manifest.num_shards, shards[i], sha)
    registry.put_manifest(name, manifest.to_json())


def _same_weights(a, b):
    assert set(a.weights) == set(b.weights)
    for key, (wa, wb, sa) in a.weights.items():
        xa, xb, sb = b.weights[key]
        assert torch.equal(wa, xa) and torch.equal(wb, xb) and sa == sb


# ---- sharded upload ----

@pytest.mark.parametrize("num_shards", [1, 3, 7])
def test_pack_upload_commit_round_trip(registry, adapter_dirs, num_shards):
    manifest, shards = pack_adapter(adapter_dirs[0], num_shards, "policy-v1")
    assert len(shards) == num_shards == manifest.num_shards
    assert sum(len(s) for s in shards) == manifest.total_bytes
    assert hashlib.sha256(b"".join(shards)).hexdigest() == manifest.sha256
    order = list(reversed(range(num_shards)))  # any arrival order
    _upload(registry, "policy-v1", manifest, shards, order=order)
    adapter = registry.commit("policy-v1")
    assert adapter.name == "policy-v1"
    _same_weights(adapter, load_adapter("x", adapter_dirs[0], LAYERS, torch.float32, CPU))
    assert registry.names() == ["policy-v1"]
    assert registry.for_new_session("policy-v1") is adapter
    assert not _staging(registry, "policy-v1").exists()
    target = registry.state_dir / "adapters" / "policy-v1"
    assert sorted(p.name for p in target.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]


def test_upload_without_shard_headers(registry, adapter_dirs):
    manifest, shards = pack_adapter(adapter_dirs[1], 2, "policy-v2")
    _upload(registry, "policy-v2", manifest, shards, with_sha=False)
    registry.commit("policy-v2")
    assert registry.names() == ["policy-v2"]


def test_pack_depends_only_on_file_contents(adapter_dirs, tmp_path):
    """Trainer ranks pack their own copies: times, owners and modes must not change the bytes."""
    import os
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(adapter_dirs[0], copy)
    for f in copy.iterdir():
        os.utime(f, (1_000_000_000.5, 1_000_000_000.5))
        f.chmod(0o600)
    assert pack_adapter(copy, 3, "policy-v1") == pack_adapter(adapter_dirs[0], 3, "policy-v1")
    with tarfile.open(fileobj=io.BytesIO(b"".join(pack_adapter(copy, 1, "x")[1]))) as tar:
        assert all(m.mtime == 0 and m.uid == 0 and m.uname == "" for m in tar.getmembers())


def test_manifest_round_trips_json(adapter_dirs):
    manifest, _ = pack_adapter(adapter_dirs[0], 2, "policy-v1")
    again = Manifest.parse(json.loads(json.dumps(manifest.to_json())))
    assert again == manifest


def _refused(registry, name, match):
    with pytest.raises(UploadError, match=match):
        registry.commit(name)
    assert not _staging(registry, name).exists()
    assert name not in registry.names()
    with pytest.raises(KeyError):
        registry.for_new_session(name)


def test_shard_sha_header_mismatch_is_refused(registry, adapter_dirs):
    manifest, shards = pack_adapter(adapter_dirs[0], 3, "policy-v1")
    registry.put_shard("policy-v1", 0, 3, shards[0], manifest.shard_sha256[0])
    with pytest.raises(UploadError, match="shard 1: sha256 mismatch"):
        registry.put_shard("policy-v1", 1, 3, shards[1] + b"x", manifest.shard_sha256[1])
    with pytest.raises(UploadError, match="sha256 mismatch"):
        registry.put_shard("policy-v1", 2, 3, shards[2], "0" * 64)
    # the corrupt shard was never staged
    assert sorted(p.name for p in _staging(registry, "policy-v1").iterdir()) == ["shard-0.of-3", "shard-0.of-3.sha256"]
    registry.put_shard("policy-v1", 2, 3, shards[2], manifest.shard_sha256[2].upper())
    registry.put_manifest("policy-v1", manifest.to_json())
    _refused(registry, "policy-v1", "shard 1 of 3 missing")


def test_shard_resent_after_header_mismatch_commits(registry, adapter_dirs):
    manifest, shards = pack_adapter(adapter_dirs[0], 2, "policy-v1")
    with pytest.raises(UploadError):
        registry.put_shard("policy-v1", 0, 2, b"garbage", manifest.shard_sha256[0])
    _upload(registry, "policy-v1", manifest, shards)
    registry.commit("policy-v1")
    assert registry.names() == ["policy-v1"]


def test_bad_shard_index_refused(registry):
    for index, of in [(-1, 2), (2, 2), (0, 0), (0, 4097)]:
        with pytest.raises(UploadError, match="shard index"):
            registry.put_shard("policy-v1", index, of, b"x", None)


def test_missing_shard_refused(registry, adapter_dirs):
    manifest, shards = pack_adapter(adapter_dirs[0], 3, "policy-v1")
    _upload(registry, "policy-v1", manifest, shards, order=[0, 2])
    _refused(registry, "policy-v1", "shard 1 of 3 missing")


def test_shard_of_another_split_is_missing(registry, adapter_dirs):
    manifest, shards = pack_adapter(adapter_dirs[0], 2, "policy-v1")
    registry.put_shard("policy-v1", 0, 3, shards[0], None)  # "?of=3" does not match the manifest
    registry.put_shard("policy-v1", 1, 2, shards[1], None)
    registry.put_manifest("policy-v1", manifest.to_json())
    _refused(registry, "policy-v1", "shard 0 of 2 missing")


def test_shard_bytes_differ_from_manifest_refused(registry, adapter_dirs):
    manifest, shards = pack_adapter(adapter_dirs[0], 3, "policy-v1")
    shards = list(shards)
    shards[1] = bytes([shards[1][0] ^ 1]) + shards[1][1:]
    _upload(registry, "policy-v1", manifest, shards, with_sha=False)
    _refused(registry, "policy-v1", "shard 1: sha256 does not match the manifest")


def test_whole_sha_mismatch_refused(registry, adapter_dirs):
    manifest, shards = pack_adapter(adapter_dirs[0], 2, "policy-v1")
    manifest.sha256 = "f" * 64
    _upload(registry, "policy-v1", manifest, shards)
    _refused(registry, "policy-v1", "does not match the manifest sha256/size")
    manifest, shards = pack_adapter(adapter_dirs[0], 2, "policy-v1")
    manifest.total_bytes += 1
    _upload(registry, "policy-v1", manifest, shards)
    _refused(registry, "policy-v1", "sha256/size")


def test_no_manifest_refused(registry, adapter_dirs):
    manifest, shards = pack_adapter(adapter_dirs[0], 2, "policy-v1")
    for i, shard in enumerate(shards):
        registry.put_shard("policy-v1", i, 2, shard, None)
    _refused(registry, "policy-v1", "no manifest")


def test_manifest_naming_another_adapter_refused(registry, adapter_dirs):
    manifest, shards = pack_adapter(adapter_dirs[0], 2, "policy-v2")
    for i, shard in enumerate(shards):
        registry.put_shard("policy-v1", i, 2, shard, None)
    with pytest.raises(UploadError, match="'policy-v2', not 'policy-v1'"):
        registry.put_manifest("policy-v1", manifest.to_json())
    _refused(registry, "policy-v1", "no manifest")


@pytest.mark.parametrize("data, word", [
    ({}, "bad manifest"),
    ({"name": "a", "num_shards": "x", "total_bytes": 1, "sha256": "", "shard_sha256": []}, "bad manifest"),
    ({"name": "a", "num_shards": 2, "total_bytes": 1, "sha256": "", "shard_sha256": ["a"]}, "num_shards"),
    ({"name": "a", "num_shards": 0, "total_bytes": 1, "sha256": "", "shard_sha256": []}, "num_shards"),
    ({"name": "a", "num_shards": 1, "total_bytes": 1, "sha256": "", "shard_sha256": None}, "bad manifest"),
    ("not a dict", "bad manifest"),
])
def test_bad_manifest_refused(registry, data, word):
    with pytest.raises(UploadError, match=word):
        registry.put_manifest("a", data)


def _tar(members):
    """(name, bytes) files, (name, '->target') symlinks, (name, '=>target') hard links, (name, '/') dirs."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            if isinstance(data, str) and data.startswith("->"):
                info.type, info.linkname = tarfile.SYMTYPE, data[2:]
                tar.addfile(info)
            elif isinstance(data, str) and data.startswith("=>"):
                info.type, info.linkname = tarfile.LNKTYPE, data[2:]
                tar.addfile(info)
            elif data == "/":
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
            else:
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _upload_blob(registry, name, blob, num_shards=2):
    step = -(-len(blob) // num_shards)
    shards = [blob[i * step:(i + 1) * step] for i in range(num_shards)]
    manifest = Manifest(name=name, num_shards=num_shards, total_bytes=len(blob),
                        sha256=hashlib.sha256(blob).hexdigest(),
                        shard_sha256=[hashlib.sha256(s).hexdigest() for s in shards])
    _upload(registry, name, manifest, shards)


def _files(directory):
    return {n: (directory / n).read_bytes() for n in ("adapter_config.json", "adapter_model.safetensors")}


def test_hand_built_tar_commits(registry, adapter_dirs):
    _upload_blob(registry, "policy-v1", _tar(list(_files(adapter_dirs[0]).items())))
    registry.commit("policy-v1")
    assert registry.names() == ["policy-v1"]


@pytest.mark.parametrize("case", ["extra", "symlink", "hardlink", "traversal", "missing", "dir"])
def test_tar_with_bad_members_refused(registry, adapter_dirs, tmp_path, case):
    files = _files(adapter_dirs[0])
    outside = tmp_path / "outside.txt"
    outside.write_text("secret")
    members = list(files.items())
    if case == "extra":
        members.append(("evil.py", b"print('hi')"))
    elif case == "symlink":
        members[0] = ("adapter_config.json", f"->{outside}")
    elif case == "hardlink":
        members = [("adapter_model.safetensors", files["adapter_model.safetensors"]),
                   ("adapter_config.json", "=>adapter_model.safetensors")]
    elif case == "traversal":
        members.append(("../../escape.txt", b"x"))
    elif case == "missing":
        members = members[1:]
    elif case == "dir":
        members[0] = ("adapter_config.json", "/")
    _upload_blob(registry, "policy-v1", _tar(members))
    _refused(registry, "policy-v1", "exactly")
    assert outside.read_text() == "secret"
    assert not (registry.state_dir / "escape.txt").exists()
    assert not (tmp_path / "escape.txt").exists()
    target = registry.state_dir / "adapters" / "policy-v1"
    assert not any(target.rglob("*")) if target.exists() else True


def test_corrupt_tar_refused(registry):
    _upload_blob(registry, "policy-v1", b"this is not a tar archive" * 40)
    with pytest.raises((UploadError, tarfile.TarError)):
        registry.commit("policy-v1")
    assert not _staging(registry, "policy-v1").exists()
    assert registry.names() == []


def test_upload_bad_names_refused(registry):
    for name in ("base", "a/b", "", "x" * 65, "sp ace"):
        with pytest.raises(UploadError, match="adapter name"):
            registry.put_shard(name, 0, 1, b"x", None)
        with pytest.raises(UploadError, match="adapter name"):
            registry.commit(name)


def test_dot_names_are_refused_and_never_delete_state(registry, adapter_dirs):
    manifest, shards = pack_adapter(adapter_dirs[0], 1, "policy-v1")
    _upload(registry, "policy-v1", manifest, shards)
    registry.commit("policy-v1")
    kept = registry.state_dir / "adapters" / "policy-v1" / "adapter_config.json"
    (registry.state_dir / "uploads").mkdir(exist_ok=True)
    (registry.state_dir / "uploads" / "other-in-flight").mkdir()
    for name in ("..", "."):
        with pytest.raises((UploadError, AdapterError)):
            registry.commit(name)
        assert kept.is_file(), f"commit({name!r}) deleted a served adapter's files"
        assert (registry.state_dir / "uploads" / "other-in-flight").is_dir()
        with pytest.raises((UploadError, AdapterError)):
            registry.put_shard(name, 0, 1, b"x", None)
        with pytest.raises(AdapterError):
            registry.load(name, adapter_dirs[1])


# ---- registry: load / unload / retire ----

def test_load_same_name_twice_refused(registry, adapter_dirs):
    registry.load("policy-v1", adapter_dirs[0])
    with pytest.raises(AdapterError, match="already loaded"):
        registry.load("policy-v1", adapter_dirs[1])
    assert registry.names() == ["policy-v1"]
    assert registry.for_new_session("policy-v1").path == str(adapter_dirs[0])


def test_load_name_of_retiring_version_refused(registry, adapter_dirs):
    registry.load("policy-v1", adapter_dirs[0])
    assert registry.unload("policy-v1", {"policy-v1": 1}) == "retiring"
    with pytest.raises(AdapterError, match="already loaded"):
        registry.load("policy-v1", adapter_dirs[1])


def test_load_bad_names_refused(registry, adapter_dirs):
    for name in ("base", "a/b", "", "x" * 65):
        with pytest.raises(AdapterError, match="adapter name"):
            registry.load(name, adapter_dirs[0])
    with pytest.raises(AdapterError):
        registry.load("policy-v9", adapter_dirs[0].parent / "nowhere")
    assert registry.names() == []


def test_commit_of_loaded_name_refused_without_touching_its_files(registry, adapter_dirs):
    manifest, shards = pack_adapter(adapter_dirs[0], 2, "policy-v1")
    _upload(registry, "policy-v1", manifest, shards)
    served = registry.commit("policy-v1")
    before = _files(registry.state_dir / "adapters" / "policy-v1")
    manifest, shards = pack_adapter(adapter_dirs[1], 2, "policy-v1")
    _upload(registry, "policy-v1", manifest, shards)
    with pytest.raises((AdapterError, UploadError), match="already loaded"):
        registry.commit("policy-v1")
    assert not _staging(registry, "policy-v1").exists()
    assert registry.for_new_session("policy-v1") is served
    assert _files(registry.state_dir / "adapters" / "policy-v1") == before


def test_unload_in_use_retires_then_collect_frees(registry, adapter_dirs):
    adapter = registry.load("policy-v1", adapter_dirs[0])
    registry.load("policy-v2", adapter_dirs[1])
    in_use = {"policy-v1": 2, "policy-v2": 1}
    assert registry.unload("policy-v1", in_use) == "retiring"
    assert registry.names() == ["policy-v2"]
    with pytest.raises(KeyError):
        registry.for_new_session("policy-v1")
    assert registry.for_session("policy-v1") is adapter  # existing sessions keep it
    assert registry.collect(in_use) == []
    in_use["policy-v1"] = 1
    assert registry.collect(in_use) == []
    assert registry.for_session("policy-v1") is adapter
    in_use["policy-v1"] = 0
    assert registry.collect(in_use) == ["policy-v1"]
    with pytest.raises(KeyError):
        registry.for_session("policy-v1")
    assert registry.collect({}) == []
    assert registry.names() == ["policy-v2"]
    # once freed the name may be loaded again
    registry.load("policy-v1", adapter_dirs[0])
    assert registry.names() == ["policy-v2", "policy-v1"]


def test_unload_not_in_use_frees_now(registry, adapter_dirs):
    registry.load("policy-v1", adapter_dirs[0])
    assert registry.unload("policy-v1", {"policy-v2": 3}) == "unloaded"
    assert registry.names() == [] and registry.retiring == {}
    with pytest.raises(KeyError):
        registry.for_session("policy-v1")


def test_unload_unknown_or_retiring_raises(registry, adapter_dirs):
    with pytest.raises(KeyError):
        registry.unload("policy-v1", {})
    registry.load("policy-v1", adapter_dirs[0])
    registry.unload("policy-v1", {"policy-v1": 1})
    with pytest.raises(KeyError):
        registry.unload("policy-v1", {"policy-v1": 1})


def test_adapter_name_with_trailing_newline_refused(registry, adapter_dirs):
    with pytest.raises(UploadError, match="adapter name"):
        registry.put_shard("policy-v1\n", 0, 1, b"x", None)
    with pytest.raises(AdapterError, match="adapter name"):
        registry.load("policy-v1\n", adapter_dirs[0])


def test_refused_tar_leaves_nothing_under_uploads(registry, adapter_dirs):
    members = list(_files(adapter_dirs[0]).items()) + [("extra.txt", b"x")]
    _upload_blob(registry, "policy-v1", _tar(members))
    with pytest.raises(UploadError):
        registry.commit("policy-v1")
    left = sorted(str(p.relative_to(registry.state_dir)) for p in registry.state_dir.rglob("*"))
    assert not [p for p in left if "policy-v1" in p], left  # no staging, unpacking or target dir


def test_commit_does_not_touch_another_uploads_staging(registry, adapter_dirs):
    # every valid name has its own staging area, whatever the commit of another name unpacks into
    other = "policy-v1.unpacked"
    m_other, s_other = pack_adapter(adapter_dirs[1], 2, other)
    _upload(registry, other, m_other, s_other)
    manifest, shards = pack_adapter(adapter_dirs[0], 2, "policy-v1")
    _upload(registry, "policy-v1", manifest, shards)
    registry.commit("policy-v1")
    registry.commit(other)
    assert registry.names() == ["policy-v1", other]
