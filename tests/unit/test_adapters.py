import hashlib
import io
import json
import tarfile
import threading
import time

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import Qwen3Config, Qwen3ForCausalLM

from burstrl.inference.adapters import AdapterRegistry
from burstrl.inference.lora import MLP_PROJ, AdapterError, load_adapter, module_shapes
from burstrl.protocol.adapters import Manifest, Packer, UploadError, pack_adapter, shard_root

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


def _staged(registry, name):
    return name in registry.staged()


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
    assert [hashlib.sha256(s).hexdigest() for s in shards] == manifest.shard_sha256
    # the whole's digest is the root over the ordered shard digests (each byte hashed once)
    digests = b"".join(hashlib.sha256(s).digest() for s in shards)
    assert hashlib.sha256(digests).hexdigest() == manifest.sha256 == shard_root(manifest.shard_sha256)
    order = list(reversed(range(num_shards)))  # any arrival order
    _upload(registry, "policy-v1", manifest, shards, order=order)
    adapter = registry.commit("policy-v1")
    assert adapter.name == "policy-v1"
    _same_weights(adapter, load_adapter("x", adapter_dirs[0], LAYERS, torch.float32, CPU))
    assert registry.names() == ["policy-v1"]
    assert registry.for_new_session("policy-v1") is adapter
    assert not _staged(registry, "policy-v1") and registry.staged_bytes() == 0
    assert adapter.path == f"upload:sha256:{manifest.sha256}"  # loaded from memory: nothing on disk
    assert not any(registry.state_dir.rglob("*")) if registry.state_dir.exists() else True


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


def test_tar_of_the_packer_is_what_tarfile_reads(adapter_dirs):
    """The hand-built tar holds exactly the two files, byte for byte."""
    _, shards = pack_adapter(adapter_dirs[0], 3, "x")
    with tarfile.open(fileobj=io.BytesIO(b"".join(shards))) as tar:
        got = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}
    assert got == _files(adapter_dirs[0])


def test_packer_reuses_its_buffer_and_packs_each_version_afresh(adapter_dirs):
    """The trainer keeps one Packer: the second version lands in the first one's buffer, with its own
    bytes and digests (no byte of the first left over), and commits like a fresh pack."""
    packer = Packer()
    first, shards = packer.pack(adapter_dirs[0], 2, "policy-v1")
    buffer = shards[0].obj
    second, shards = packer.pack(adapter_dirs[1], 2, "policy-v2")
    assert shards[0].obj is buffer  # no new buffer: no first touch of fresh pages per version
    assert (second, [bytes(s) for s in shards]) == _as_bytes(pack_adapter(adapter_dirs[1], 2, "policy-v2"))
    assert second.sha256 != first.sha256
    with pytest.raises(TypeError):
        shards[0][0] = 0  # senders get read-only views
    registry = AdapterRegistry(adapter_dirs[0].parent / "state-packer", LAYERS, torch.float32, CPU)
    _upload(registry, "policy-v2", second, shards)
    _same_weights(registry.commit("policy-v2"), load_adapter("x", adapter_dirs[1], LAYERS, torch.float32, CPU))


def test_packing_from_memory_gives_the_same_bytes_as_from_files(adapter_dirs):
    """A version the trainer holds in memory packs to exactly the tar of the same files on disk."""
    from_files = _as_bytes(Packer().pack(adapter_dirs[0], 3, "policy-v1"))
    assert _as_bytes(Packer().pack_bytes(_files(adapter_dirs[0]), 3, "policy-v1")) == from_files
    with pytest.raises(ValueError, match="exactly"):
        Packer().pack_bytes({**_files(adapter_dirs[0]), "extra.bin": b"x"}, 1, "policy-v1")


def _as_bytes(packed):
    manifest, shards = packed
    return manifest, [bytes(s) for s in shards]


def test_packer_takes_a_version_of_another_size(adapter_dirs, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(adapter_dirs[0], copy)
    packer = Packer()
    packer.pack(copy, 1, "x")
    with open(copy / "adapter_model.safetensors", "ab") as f:
        f.write(b"more")
    manifest, shards = packer.pack(copy, 1, "x")  # a new size: a new layout, still consistent
    assert manifest.total_bytes == len(shards[0]) and shard_root([hashlib.sha256(shards[0]).hexdigest()]) == \
        manifest.sha256


def test_manifest_round_trips_json(adapter_dirs):
    manifest, _ = pack_adapter(adapter_dirs[0], 2, "policy-v1")
    again = Manifest.parse(json.loads(json.dumps(manifest.to_json())))
    assert again == manifest


def _refused(registry, name, match):
    with pytest.raises(UploadError, match=match):
        registry.commit(name)
    assert not _staged(registry, name)
    assert name not in registry.names()
    with pytest.raises(KeyError):
        registry.for_new_session(name)


def test_shard_sha_header_mismatch_is_refused(registry, adapter_dirs):
    manifest, shards = pack_adapter(adapter_dirs[0], 3, "policy-v1")
    registry.put_shard("policy-v1", 0, 3, shards[0], manifest.shard_sha256[0])
    with pytest.raises(UploadError, match="shard 1: sha256 mismatch"):
        registry.put_shard("policy-v1", 1, 3, bytes(shards[1]) + b"x", manifest.shard_sha256[1])
    with pytest.raises(UploadError, match="sha256 mismatch"):
        registry.put_shard("policy-v1", 2, 3, shards[2], "0" * 64)
    # the corrupt shard was never staged
    assert registry.staged() == ["policy-v1"] and registry.staged_bytes() == len(shards[0])
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


def test_tampered_shard_under_a_consistent_root_refused(registry, adapter_dirs):
    """An attacker who changes a shard and rewrites its digest and the root in the manifest is caught
    only if the replica checks its own digests: here the header is left out, so the commit must."""
    manifest, shards = pack_adapter(adapter_dirs[0], 3, "policy-v1")
    shards = [bytes(s) for s in shards]
    shards[1] = shards[1][:-1] + bytes([shards[1][-1] ^ 1])
    manifest.shard_sha256[1] = "0" * 64  # a digest that is not the tampered shard's
    manifest.sha256 = shard_root(manifest.shard_sha256)
    _upload(registry, "policy-v1", manifest, shards, with_sha=False)
    _refused(registry, "policy-v1", "shard 1: sha256 does not match the manifest")


def test_tampered_shard_with_its_digest_but_the_old_root_refused(registry, adapter_dirs):
    """The shard's new digest in the manifest, the root left as packed: the root check refuses it."""
    manifest, shards = pack_adapter(adapter_dirs[0], 3, "policy-v1")
    shards = [bytes(s) for s in shards]
    shards[2] = shards[2][:-1] + bytes([shards[2][-1] ^ 1])
    manifest.shard_sha256[2] = hashlib.sha256(shards[2]).hexdigest()
    _upload(registry, "policy-v1", manifest, shards)
    _refused(registry, "policy-v1", "sha256/size")


def test_reordered_shards_refused(registry, adapter_dirs):
    """Shards sent under each other's index, the manifest's digests swapped to match: the root differs."""
    manifest, shards = pack_adapter(adapter_dirs[0], 3, "policy-v1")
    shards = [shards[1], shards[0], shards[2]]
    d = manifest.shard_sha256
    manifest.shard_sha256 = [d[1], d[0], d[2]]
    _upload(registry, "policy-v1", manifest, shards)
    _refused(registry, "policy-v1", "sha256/size")


def test_extra_shard_refused(registry, adapter_dirs):
    """One more shard (and its digest) than was packed: the root and the size refuse it."""
    manifest, shards = pack_adapter(adapter_dirs[0], 2, "policy-v1")
    extra = b"\0" * 1024
    manifest.shard_sha256.append(hashlib.sha256(extra).hexdigest())
    manifest.num_shards = 3
    _upload(registry, "policy-v1", manifest, [*shards, extra])
    _refused(registry, "policy-v1", "sha256/size")
    manifest.total_bytes += len(extra)  # the size made to fit: the root still refuses
    _upload(registry, "policy-v1", manifest, [*shards, extra])
    _refused(registry, "policy-v1", "sha256/size")


def test_manifest_of_an_older_sender_is_refused(registry, adapter_dirs):
    """A manifest whose sha256 is of the joined bytes (no `root`) is refused, never misread."""
    manifest, shards = pack_adapter(adapter_dirs[0], 2, "policy-v1")
    old = {k: v for k, v in manifest.to_json().items() if k != "root"}
    old["sha256"] = hashlib.sha256(b"".join(shards)).hexdigest()
    with pytest.raises(UploadError, match="root must be"):
        registry.put_manifest("policy-v1", old)
    with pytest.raises(UploadError, match="64 hex digits"):
        registry.put_manifest("policy-v1", {**manifest.to_json(), "sha256": "z" * 64})


def test_multi_shard_commit_reuses_its_join_buffer(registry, adapter_dirs):
    """Several shards are joined into a buffer given back after the commit and taken by the next one."""
    for version in (1, 2):
        manifest, shards = pack_adapter(adapter_dirs[0], 2, f"policy-v{version}")
        received = []
        for shard in shards:  # as the bulk listener receives: into buffers the registry hands out
            received.append(registry.take_buffer(len(shard)))
            received[-1][:] = shard
        _upload(registry, f"policy-v{version}", manifest, received)
        registry.commit(f"policy-v{version}")
        assert registry._free_bytes == 2 * manifest.total_bytes  # the two shards and the join, no more


def test_a_stray_shard_of_another_split_never_puts_a_buffer_back_twice(registry, adapter_dirs):
    """Shards staged under two splits (0 of 1, and 0 of 2) with a one-shard manifest: the commit
    serves the one-shard upload, and each received buffer goes back once (a buffer kept twice would
    later be handed to two shard receivers at once, one overwriting the other after its hash)."""
    manifest, [whole] = pack_adapter(adapter_dirs[0], 1, "policy-v1")
    _, halves = pack_adapter(adapter_dirs[0], 2, "policy-v1")
    one = registry.take_buffer(len(whole))
    one[:] = whole
    stray = registry.take_buffer(len(halves[0]))
    stray[:] = halves[0]
    registry.put_shard("policy-v1", 0, 2, stray, None)
    registry.put_shard("policy-v1", 0, 1, one, None)
    registry.put_manifest("policy-v1", manifest.to_json())
    registry.commit("policy-v1")
    kept = [id(b) for b in registry._free]
    assert sorted(kept) == sorted({id(one), id(stray)}) and registry._free_bytes == len(one) + len(stray)


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
    digests = [hashlib.sha256(s).hexdigest() for s in shards]
    manifest = Manifest(name=name, num_shards=num_shards, total_bytes=len(blob), sha256=shard_root(digests),
                        shard_sha256=digests)
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
    assert registry.names() == [] and registry.staged() == []


def test_corrupt_tar_refused(registry):
    _upload_blob(registry, "policy-v1", b"this is not a tar archive" * 40)
    with pytest.raises((UploadError, tarfile.TarError)):
        registry.commit("policy-v1")
    assert not _staged(registry, "policy-v1")
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
    served = registry.commit("policy-v1")
    registry.put_shard("other-in-flight", 0, 2, b"abc", None)
    for name in ("..", "."):
        with pytest.raises((UploadError, AdapterError)):
            registry.commit(name)
        assert registry.for_new_session("policy-v1") is served, f"commit({name!r}) touched a served adapter"
        assert registry.staged() == ["other-in-flight"]
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
    manifest, shards = pack_adapter(adapter_dirs[1], 2, "policy-v1")
    _upload(registry, "policy-v1", manifest, shards)
    with pytest.raises((AdapterError, UploadError), match="already loaded"):
        registry.commit("policy-v1")
    assert not _staged(registry, "policy-v1") and registry.staged_bytes() == 0
    assert registry.for_new_session("policy-v1") is served


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
    assert registry.staged() == [] and registry.staged_bytes() == 0
    left = sorted(str(p.relative_to(registry.state_dir)) for p in registry.state_dir.rglob("*"))
    assert not [p for p in left if "policy-v1" in p], left  # nothing unpacked to disk


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


# ---- validation before serving (a bad adapter never reaches the engine thread) ----

@pytest.fixture(scope="module")
def tiny_runner(tiny_model_dir):
    from burstrl.inference.runner import ModelRunner
    from burstrl.model.hf import load_model

    return ModelRunner(load_model(tiny_model_dir, "float32", "cpu"))


@pytest.fixture(scope="module")
def tiny_adapter(tiny_model_dir, tmp_path_factory):
    from burstrl.model.lora import make_random_adapter

    return make_random_adapter(tiny_model_dir, tmp_path_factory.mktemp("tiny") / "good", seed=1)


def _load_tiny(path, runner, dtype=torch.float32):
    return load_adapter("v", path, runner.num_layers, dtype, CPU, module_shapes(runner.layers))


def _key(tensors, module, ab, layer=0):
    return next(k for k in tensors if f"layers.{layer}." in k and f".{module}.lora_{ab}." in k)


def _edited(good, out, tensors=None, config=None, raw_config=None, raw_weights=None):
    """A copy of the adapter `good` with its tensors / config edited or its files replaced by bytes."""
    from safetensors.torch import load_file, save_file

    out.mkdir()
    cfg = json.loads((good / "adapter_config.json").read_text())
    if config is not None:
        config(cfg)
    raw = raw_config if raw_config is not None else json.dumps(cfg)
    (out / "adapter_config.json").write_bytes(raw if isinstance(raw, bytes) else raw.encode())
    weights = load_file(str(good / "adapter_model.safetensors"))
    if tensors is not None:
        tensors(weights)
    if raw_weights is not None:
        (out / "adapter_model.safetensors").write_bytes(raw_weights(good / "adapter_model.safetensors"))
    else:
        save_file(weights, str(out / "adapter_model.safetensors"))
    return out


def _set(module, ab, make):
    def edit(t):
        key = _key(t, module, ab)
        t[key] = make(t[key])
    return edit


def _poison(module, ab, value):
    def make(x):
        x = x.clone()
        x[0, 0] = value
        return x
    return _set(module, ab, make)


def _config(key, value):
    return lambda cfg: cfg.__setitem__(key, value)


BAD_ADAPTERS = {
    "wide_a": dict(tensors=_set("q_proj", "A", lambda x: torch.randn(x.shape[0], x.shape[1] + 1))),
    "tall_b": dict(tensors=_set("down_proj", "B", lambda x: torch.randn(x.shape[0] + 1, x.shape[1]))),
    "k_b_in_q": dict(tensors=lambda t: t.__setitem__(_key(t, "k_proj", "B"), t[_key(t, "q_proj", "B")].clone())),
    "rank_mismatch": dict(tensors=_set("v_proj", "A", lambda x: torch.randn(x.shape[0] + 1, x.shape[1]))),
    "nan": dict(tensors=_poison("o_proj", "B", float("nan"))),
    "inf": dict(tensors=_poison("gate_proj", "A", float("inf"))),
    "int_tensor": dict(tensors=_set("up_proj", "A", lambda x: x.to(torch.int32))),
    "r_zero": dict(config=_config("r", 0)),
    "r_string": dict(config=_config("r", "4")),
    "r_bool": dict(config=_config("r", True)),
    "r_huge": dict(config=_config("r", 4097)),
    "alpha_nan": dict(config=_config("lora_alpha", float("nan"))),
    "alpha_zero": dict(config=_config("lora_alpha", 0)),
    "alpha_string": dict(config=_config("lora_alpha", "16")),
    "alpha_huge_int": dict(config=_config("lora_alpha", 10 ** 400)),
    "config_not_json": dict(raw_config="{not json"),
    "config_not_object": dict(raw_config="[8, 16]"),
    "config_not_utf8": dict(raw_config=b"\xff\xfe{"),
    "truncated_safetensors": dict(raw_weights=lambda f: f.read_bytes()[: f.stat().st_size // 2]),
    "corrupt_safetensors": dict(raw_weights=lambda f: b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header}"),
    "random_bytes": dict(raw_weights=lambda f: bytes(range(256)) * 8),
}


@pytest.mark.parametrize("case", sorted(BAD_ADAPTERS))
def test_bad_adapter_is_refused_with_adapter_error(tiny_runner, tiny_adapter, tmp_path, case):
    bad = _edited(tiny_adapter, tmp_path / case, **BAD_ADAPTERS[case])
    with pytest.raises(AdapterError) as err:
        _load_tiny(bad, tiny_runner)
    assert str(bad) in str(err.value)  # the message names the file


def test_good_tiny_adapter_loads_against_the_base_shapes(tiny_runner, tiny_adapter, tmp_path):
    adapter = _load_tiny(tiny_adapter, tiny_runner)
    assert len(adapter.weights) == tiny_runner.num_layers * 7
    same = _load_tiny(_edited(tiny_adapter, tmp_path / "copy"), tiny_runner)
    _same_weights(adapter, same)


def test_value_that_overflows_the_serving_dtype_is_refused(tiny_runner, tiny_adapter, tmp_path):
    big = _edited(tiny_adapter, tmp_path / "big", tensors=_poison("q_proj", "B", 1e6))
    _load_tiny(big, tiny_runner)  # finite in float32
    with pytest.raises(AdapterError, match="NaN or inf"):
        _load_tiny(big, tiny_runner, torch.float16)  # inf in float16


def test_finite_values_whose_sum_overflows_still_load(tiny_runner, tiny_adapter, tmp_path):
    """The finiteness check sums each tensor first (a NaN or inf makes the sum non-finite); a sum that
    overflows from finite values must fall back to the exact check, not refuse a good adapter."""
    huge = _edited(tiny_adapter, tmp_path / "huge", tensors=_set("q_proj", "B", lambda x: torch.full_like(x, 3e38)))
    adapter = _load_tiny(huge, tiny_runner)
    assert all(bool(torch.isfinite(a).all() and torch.isfinite(b).all()) for a, b, _ in adapter.weights.values())
    for bad in (float("nan"), float("inf"), float("-inf")):  # one bad value among the huge ones
        poisoned = _edited(huge, tmp_path / f"huge-{bad}", tensors=_poison("q_proj", "B", bad))
        with pytest.raises(AdapterError, match="NaN or inf"):
            _load_tiny(poisoned, tiny_runner)


def test_shapes_survive_the_runners_fused_projections(tiny_model_dir, tiny_runner):
    from burstrl.model.hf import load_model

    plain = load_model(tiny_model_dir, "float32", "cpu")
    shapes = module_shapes(tiny_runner.layers)
    assert shapes == module_shapes(list(plain.model.layers))
    for (layer, name), (in_f, out_f) in shapes.items():
        parent = tiny_runner.layers[layer].mlp if name in MLP_PROJ else tiny_runner.layers[layer].self_attn
        assert tuple(getattr(parent, name).weight.shape) == (out_f, in_f)


def test_registry_for_layers_checks_shapes(tiny_runner, tiny_adapter, tmp_path):
    registry = AdapterRegistry.for_layers(tmp_path / "state", tiny_runner.layers, torch.float32, CPU)
    wide = _edited(tiny_adapter, tmp_path / "wide", **BAD_ADAPTERS["wide_a"])
    with pytest.raises(AdapterError, match="expects lora_A"):
        registry.load("policy-v1", wide)
    assert registry.names() == []
    registry.load("policy-v1", tiny_adapter)
    assert registry.names() == ["policy-v1"]


@pytest.mark.parametrize("blob", [b"not a tar archive at all " * 40, b"\x00" * 100 + b"junk" * 200])
def test_non_tar_upload_is_an_upload_error(registry, blob):
    _upload_blob(registry, "policy-v1", blob)
    _refused(registry, "policy-v1", "tar")


def test_truncated_tar_upload_is_an_upload_error(registry, adapter_dirs):
    whole = _tar(list(_files(adapter_dirs[0]).items()))
    _upload_blob(registry, "policy-v1", whole[: len(whole) // 2 + 7])
    _refused(registry, "policy-v1", "tar")


def test_stale_staging_is_swept_and_fresh_kept(tmp_path, adapter_dirs):
    registry = AdapterRegistry(tmp_path / "state", LAYERS, torch.float32, CPU, upload_ttl_s=60)
    manifest, shards = pack_adapter(adapter_dirs[0], 2, "stale")
    _upload(registry, "stale", manifest, shards)
    registry._uploads["stale"].touched -= 61  # idle for longer than the TTL
    registry.put_shard("fresh", 0, 2, b"abc", None)  # any upload call sweeps
    assert registry.staged() == ["fresh"]
    assert registry.staged_bytes() == 3  # the stale upload's bytes are given back
    with pytest.raises(UploadError, match="manifest"):
        registry.commit("stale")


def test_an_upload_in_progress_refreshes_its_idle_clock(tmp_path):
    registry = AdapterRegistry(tmp_path / "state", LAYERS, torch.float32, CPU, upload_ttl_s=60)
    registry.put_shard("slow", 0, 2, b"abc", None)
    registry._uploads["slow"].touched -= 59
    registry.put_shard("slow", 1, 2, b"def", None)  # touched again
    assert registry.sweep_uploads(now=time.monotonic() + 30) == []
    assert registry.sweep_uploads(now=time.monotonic() + 61) == ["slow"]
    assert registry.staged_bytes() == 0


def test_a_new_registry_clears_uploads_staged_on_disk_by_older_versions(tmp_path):
    (tmp_path / "state" / "uploads" / "abandoned").mkdir(parents=True)
    AdapterRegistry(tmp_path / "state", LAYERS, torch.float32, CPU)
    assert not (tmp_path / "state" / "uploads").exists()


def test_staging_is_bounded_and_resent_shards_replace(tmp_path):
    registry = AdapterRegistry(tmp_path / "state", LAYERS, torch.float32, CPU, max_staged_bytes=10)
    registry.put_shard("a", 0, 2, b"12345", None)
    registry.put_shard("a", 0, 2, b"12345", None)  # a retry replaces, it does not add
    registry.put_shard("b", 0, 1, b"12345", None)
    assert registry.staged_bytes() == 10
    with pytest.raises(UploadError, match="exceed"):
        registry.put_shard("c", 0, 1, b"x", None)
    with pytest.raises(UploadError, match="exceed"):
        registry.check_shard("a", 1, 2, 1)
    with pytest.raises(UploadError, match="manifest"):
        registry.commit("b")  # consumes b's staging, even refused
    registry.put_shard("c", 0, 1, b"x", None)
    assert registry.staged_bytes() == 6


def test_duplicate_member_tar_refused(registry, adapter_dirs):
    files = list(_files(adapter_dirs[0]).items())
    _upload_blob(registry, "policy-v1", _tar(files + [files[0]]))
    _refused(registry, "policy-v1", "exactly")


def test_concurrent_commits_of_one_name_serve_one_adapter(registry, adapter_dirs):
    manifest, shards = pack_adapter(adapter_dirs[0], 2, "policy-v1")
    _upload(registry, "policy-v1", manifest, shards)
    results, start = [], threading.Barrier(4)

    def commit():
        start.wait()
        try:
            results.append(registry.commit("policy-v1"))
        except UploadError as exc:
            results.append(exc)

    threads = [threading.Thread(target=commit) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    served = [r for r in results if not isinstance(r, Exception)]
    assert len(served) == 1 and registry.for_new_session("policy-v1") is served[0]
    assert registry.staged() == []


# ---- safetensors read in place (a pushed version is never written to disk) ----

def _st(header, data=b""):
    raw = json.dumps(header).encode()
    return memoryview(len(raw).to_bytes(8, "little") + raw + data)


def test_read_safetensors_matches_the_library(adapter_dirs):
    from safetensors.torch import load

    from burstrl.inference.adapters import read_safetensors

    raw = (adapter_dirs[0] / "adapter_model.safetensors").read_bytes()
    ours, theirs = read_safetensors(memoryview(bytearray(raw)), "x"), load(raw)
    assert set(ours) == set(theirs)
    for key, t in theirs.items():
        assert ours[key].dtype == t.dtype and torch.equal(ours[key], t)


@pytest.mark.parametrize("view,why", [
    (memoryview(b"\x01\x00"), "shorter"),
    (memoryview((10**9).to_bytes(8, "little") + b"{}"), "header of"),
    (_st([1, 2]), "not a JSON object"),
    (memoryview((4).to_bytes(8, "little") + b"{x:1"), "not JSON"),
    (_st({"a": {"dtype": "F99", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4), "unknown dtype"),
    (_st({"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, b"\0" * 4), "bad shape"),
    (_st({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0]}}, b"\0" * 4), "bad shape"),
    (_st({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 4), "do not fit"),
    (_st({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 0]}}, b"\0" * 4), "do not fit"),
    (_st({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 8]}}, b"\0" * 8), "do not fit"),
    (_st({"a": {"dtype": "F32", "shape": [10**6, 10**6], "data_offsets": [0, 4]}}, b"\0" * 4), "do not fit"),
    (_st({"a": "F32"}), "unknown dtype"),
])
def test_read_safetensors_refuses_hostile_headers(view, why):
    from burstrl.inference.adapters import read_safetensors

    with pytest.raises(AdapterError, match=why):
        read_safetensors(view, "x")


def test_pushed_safetensors_with_a_lying_header_is_refused(registry, adapter_dirs):
    files = _files(adapter_dirs[0])
    weights = files["adapter_model.safetensors"]
    size = int.from_bytes(weights[:8], "little")
    header = json.loads(weights[8:8 + size])
    key = next(k for k in header if k != "__metadata__")
    header[key]["data_offsets"][1] += 4  # one element more than its shape, reading past its bytes
    raw = json.dumps(header).encode()
    files["adapter_model.safetensors"] = len(raw).to_bytes(8, "little") + raw + weights[8 + size:]
    _upload_blob(registry, "policy-v1", _tar(list(files.items())))
    with pytest.raises(AdapterError, match="safetensors"):
        registry.commit("policy-v1")
    assert registry.names() == [] and registry.staged() == []


def test_receive_buffers_are_reused_after_commit_and_drop(tmp_path, adapter_dirs):
    registry = AdapterRegistry(tmp_path / "state", LAYERS, torch.float32, CPU, max_free_bytes=1 << 20)
    manifest, shards = pack_adapter(adapter_dirs[0], 1, "policy-v1")
    buf = registry.take_buffer(len(shards[0]))
    buf[:] = shards[0]
    registry.put_shard("policy-v1", 0, 1, buf, None)
    registry.put_manifest("policy-v1", manifest.to_json())
    served = registry.commit("policy-v1")
    assert registry.take_buffer(len(shards[0])) is buf  # given back by the commit
    buf[:] = b"\0" * len(buf)  # reusing it must not change the served adapter (it holds copies)
    _same_weights(served, load_adapter("x", adapter_dirs[0], LAYERS, torch.float32, CPU))
    registry.put_shard("abandoned", 0, 2, buf, None)
    registry.sweep_uploads(now=time.monotonic() + 10**6)
    assert registry.take_buffer(len(buf)) is buf  # given back by the sweep
    assert registry.take_buffer(len(buf)) is not buf
    registry.give_back(bytearray(2 << 20))  # larger than the pool: not kept
    assert registry._free_bytes == 0
