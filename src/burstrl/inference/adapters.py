"""Adapter versions on a replica: load, retire, and assemble sharded uploads in memory.

Why retire instead of unload: a rollout is pinned to the version it started on. Unloading
`policy-v3` while a session still uses it would strand that rollout, so an unloaded version stops
taking new sessions at once and is freed when its last session is released.

Sharded upload (packing and manifest in `burstrl.protocol.adapters`): the trainer ranks each send
a byte range of the adapter directory packed as a tar (to the bulk listener, `inference.bulk`, or
`PUT /v1/adapters/{name}/shards/{i}?of={n}`), rank 0 `PUT`s a manifest with the sha256 of every
shard and the root over them (`protocol.adapters.shard_root`), and `POST .../commit` verifies
everything and loads the adapter straight from the received bytes. Shards are staged in memory
(hashed once, as they arrive; nothing is hashed again at commit), never on disk:
a push is a few hundred MB at most and the volume, not the replica, keeps versions for late
joiners. Nothing is served until all checks pass; a corrupt or incomplete upload is refused and
its staging dropped. An upload that is never committed (a trainer that died mid-push) is dropped
once idle for `upload_ttl_s`, and all staged uploads together may hold at most `max_staged_bytes`,
so abandoned or hostile shards cannot exhaust the replica's memory.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import shutil
import tarfile
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from burstrl.inference.lora import AdapterError, LoraAdapter, Shapes, load_adapter, load_adapter_bytes, module_shapes
from burstrl.protocol.adapters import ADAPTER_FILES, MAX_SHARDS, Manifest, UploadError, shard_root
from burstrl.protocol.tenants import local, scoped_pattern

MAX_STAGED_BYTES = 8 << 30  # all uploads in flight together; a push is a few hundred MB
MAX_FREE_BYTES = 1 << 30  # receive buffers kept for the next push
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")  # used with fullmatch: no "..", no "\n"
SCOPED_NAME = scoped_pattern(NAME)  # a stored name: a client's, or `<tenant>~<name>` (inference.tenancy)


class AdapterRegistry:
    """Loaded adapter versions by name, with retirement and sharded-upload staging.

    `shapes` (lora.module_shapes of the base model) makes every load check each A/B against its
    projection; without it only ranks and layer indices are checked.
    """

    def __init__(self, state_dir: Path, num_layers: int, dtype: torch.dtype, device: torch.device,
                 shapes: Shapes | None = None, upload_ttl_s: float = 600.0,
                 max_staged_bytes: int = MAX_STAGED_BYTES, max_free_bytes: int = MAX_FREE_BYTES) -> None:
        self.state_dir = state_dir
        self.num_layers, self.dtype, self.device = num_layers, dtype, device
        self.shapes, self.upload_ttl_s, self.max_staged_bytes = shapes, upload_ttl_s, max_staged_bytes
        self.active: dict[str, LoraAdapter] = {}
        self.retiring: dict[str, LoraAdapter] = {}
        self._uploads: dict[str, _Upload] = {}
        self._staged_bytes = 0
        self.max_free_bytes = max_free_bytes
        self._free: list[bytearray] = []  # receive buffers given back by committed or dropped uploads
        self._free_bytes = 0
        self._lock = threading.Lock()
        # called with every newly built adapter before it is served (the engine's LoRA probe);
        # raises AdapterError to refuse it
        self.verify: Callable[[LoraAdapter], object] | None = None
        # called with every version freed (no session can name it any more): the engine lets it go
        self.release: Callable[[LoraAdapter], None] | None = None
        # uploads staged on disk by an earlier version of this code are abandoned
        shutil.rmtree(self.state_dir / "uploads", ignore_errors=True)

    @classmethod
    def for_layers(cls, state_dir: Path, layers: list[torch.nn.Module], dtype: torch.dtype,
                   device: torch.device, upload_ttl_s: float = 600.0) -> AdapterRegistry:
        """A registry that checks every adapter against these HF decoder layers (runner.layers)."""
        return cls(state_dir, len(layers), dtype, device, module_shapes(layers), upload_ttl_s)

    def names(self) -> list[str]:
        with self._lock:
            return list(self.active)

    def paths(self) -> dict[str, str]:
        """Where each served version was loaded from (`root` in `/v1/models`)."""
        with self._lock:
            return {name: adapter.path for name, adapter in self.active.items()}

    def for_new_session(self, name: str) -> LoraAdapter | None:
        """The adapter a new session on `name` gets; KeyError if not served for new sessions."""
        with self._lock:
            return self.active[name]

    def for_session(self, name: str) -> LoraAdapter:
        """The adapter of an existing session (retiring versions still serve their sessions)."""
        with self._lock:
            if name in self.active:
                return self.active[name]
            return self.retiring[name]

    def load(self, name: str, path: str | Path) -> LoraAdapter:
        if not _valid_name(name):
            raise AdapterError(f"adapter name must match {NAME.pattern} and not be 'base'")
        adapter = load_adapter(name, path, self.num_layers, self.dtype, self.device, self.shapes)
        return self._admit(adapter, AdapterError)

    def unload(self, name: str, in_use: dict[str, int]) -> str:
        """Stop new sessions on `name`; free it now if no session uses it. Returns the state."""
        with self._lock:
            if name not in self.active:
                raise KeyError(name)
            adapter = self.active.pop(name)
            if in_use.get(name, 0):
                self.retiring[name] = adapter
                return "retiring"
        self._released([adapter])
        return "unloaded"

    def collect(self, in_use: dict[str, int]) -> list[str]:
        """Free retiring versions whose last session has been released."""
        with self._lock:
            done = [n for n in self.retiring if not in_use.get(n, 0)]
            freed = [self.retiring.pop(n) for n in done]
        self._released(freed)
        return done

    def _released(self, adapters: list[LoraAdapter]) -> None:
        if self.release is not None:
            for adapter in adapters:
                self.release(adapter)

    # ---- sharded upload ----
    def staged(self) -> list[str]:
        """Names with an upload in flight (shards or a manifest staged, not committed)."""
        with self._lock:
            return list(self._uploads)

    def staged_bytes(self) -> int:
        with self._lock:
            return self._staged_bytes

    def sweep_uploads(self, now: float | None = None) -> list[str]:
        """Drop uploads idle for `upload_ttl_s`; returns the names removed."""
        now = time.monotonic() if now is None else now
        with self._lock:
            stale = [n for n, up in self._uploads.items() if now - up.touched > self.upload_ttl_s]
            for name in stale:
                self._drop(name)
        return stale

    def check_shard(self, name: str, index: int, of: int, size: int) -> None:
        """Refuse a shard before its bytes are read (bad name or index, too large to stage)."""
        _check_name(name)
        if not 0 <= index < of <= MAX_SHARDS:
            raise UploadError(f"shard index must satisfy 0 <= i < of <= {MAX_SHARDS}")
        self.sweep_uploads()
        with self._lock:
            if self._staged_bytes + size > self.max_staged_bytes:
                raise UploadError(f"staged uploads would exceed {self.max_staged_bytes} bytes; "
                                  "commit or wait for abandoned uploads to expire")

    def put_shard(self, name: str, index: int, of: int, data: bytes | bytearray, sha256: str | None,
                  digest: str | None = None) -> None:
        """Stage shard `index` of `of`; `digest` is its sha256 when the receiver hashed it while reading.

        A shard sent again (a retry) replaces the earlier copy.
        """
        self.check_shard(name, index, of, len(data))
        if digest is None:
            digest = hashlib.sha256(data).hexdigest()  # once, on arrival: commit compares, never rehashes
        if sha256 is not None and digest != sha256.lower():
            raise UploadError(f"shard {index}: sha256 mismatch")
        with self._lock:
            up = self._touch(name)
            old = up.shards.pop((index, of), None)
            added = len(data) - (len(old[0]) if old else 0)
            if self._staged_bytes + added > self.max_staged_bytes:  # raced with another upload
                if old is not None:
                    up.shards[(index, of)] = old
                raise UploadError(f"staged uploads would exceed {self.max_staged_bytes} bytes")
            up.shards[(index, of)] = (data, digest)
            self._staged_bytes += added
            if old is not None:
                self._keep(old[0])

    def put_manifest(self, name: str, data: Any) -> Manifest:
        _check_name(name)
        manifest = Manifest.parse(data)
        if manifest.name not in (name, local(name)):  # a tenant's manifest names the version as it knows it
            raise UploadError(f"manifest names {manifest.name!r}, not {name!r}")
        self.sweep_uploads()
        with self._lock:
            self._touch(name).manifest = manifest
        return manifest

    def commit(self, name: str) -> LoraAdapter:
        """Verify the staged shards against the manifest, load from memory. Staging is always dropped.

        Runs in a worker thread; the lock is held only to take the staging and to register the
        result, so other uploads and generation go on while the bytes are hashed and converted.
        """
        _check_name(name)
        with self._lock:
            up = self._uploads.get(name)
            self._drop(name, recycle=False)  # its buffers are read below, then given back
            if name in self.active or name in self.retiring:
                self._recycle(up)
                raise UploadError(f"adapter {name!r} is already loaded; versions never change")
        if up is None or up.manifest is None:
            raise UploadError("no manifest uploaded")
        try:
            adapter = self._load_upload(name, up)
        finally:  # the adapter holds copies (lora._build), never views of the received bytes
            with self._lock:
                self._recycle(up)
        return self._admit(adapter, UploadError)

    def _admit(self, adapter: LoraAdapter, error: type[Exception]) -> LoraAdapter:
        """Prove a built version and serve it, unless its name was taken meanwhile (then let it go again)."""
        if self.verify is not None:
            self.verify(adapter)
        with self._lock:
            taken = adapter.name in self.active or adapter.name in self.retiring
            if not taken:
                self.active[adapter.name] = adapter
        if taken:
            self._released([adapter])
            raise error(f"adapter {adapter.name!r} is already loaded; versions never change")
        return adapter

    def _load_upload(self, name: str, up: _Upload) -> LoraAdapter:
        blob = _assemble(up, self.take_buffer)
        try:
            files = _members(blob)
            label = f"upload:sha256:{up.manifest.sha256}"
            tensors = read_safetensors(files["adapter_model.safetensors"], f"{label}/adapter_model.safetensors")
            return load_adapter_bytes(name, label, bytes(files["adapter_config.json"]), tensors, self.num_layers,
                                      self.dtype, self.device, self.shapes)
        finally:  # the joined copy goes back here; the shards themselves are recycled by commit
            if not any(blob is data for data, _ in up.shards.values()):
                self.give_back(blob)  # (a shard given back twice would be handed to two receivers)

    def take_buffer(self, size: int) -> bytearray:
        """A buffer for a shard of `size` bytes: one a finished upload gave back, else a new one.

        Why: a fresh buffer costs a first touch of every page as the body is read into it (0.15-0.25 s
        per 105 MB on the benchmark VM); pushes of one run have the same shard sizes.
        """
        with self._lock:
            for i, buf in enumerate(self._free):
                if len(buf) == size:
                    self._free_bytes -= size
                    return self._free.pop(i)
        return bytearray(size)

    def give_back(self, buffer: bytes | bytearray) -> None:
        """Return a buffer from `take_buffer` that was not staged (a refused or truncated shard)."""
        with self._lock:
            self._keep(buffer)

    def _recycle(self, up: _Upload | None) -> None:
        """Give an upload's buffers back for later shards. Lock held."""
        for data, _ in (up.shards.values() if up is not None else ()):
            self._keep(data)

    def _keep(self, buffer: bytes | bytearray) -> None:
        if isinstance(buffer, bytearray) and 0 < len(buffer) <= self.max_free_bytes:
            self._free.append(buffer)
            self._free_bytes += len(buffer)
        while self._free_bytes > self.max_free_bytes:
            self._free_bytes -= len(self._free.pop(0))

    def _touch(self, name: str) -> _Upload:
        """This name's staging (made on first use), its idle clock restarted. Lock held."""
        up = self._uploads.setdefault(name, _Upload())
        up.touched = time.monotonic()
        return up

    def _drop(self, name: str, recycle: bool = True) -> None:
        """Forget a staged upload and its bytes (kept for later shards unless `recycle` is off). Lock held."""
        up = self._uploads.pop(name, None)
        if up is not None:
            self._staged_bytes -= sum(len(data) for data, _ in up.shards.values())
            if recycle:
                self._recycle(up)


@dataclass
class _Upload:
    """One name's upload in flight: shards by (index, of) -> (bytes, sha256 hex), the manifest."""

    shards: dict[tuple[int, int], tuple[bytes | bytearray, str]] = field(default_factory=dict)
    manifest: Manifest | None = None
    touched: float = 0.0


def _valid_name(name: str) -> bool:
    return SCOPED_NAME.fullmatch(name) is not None and local(name) != "base"


def _check_name(name: str) -> None:
    if not _valid_name(name):
        raise UploadError(f"adapter name must match {NAME.pattern} and not be 'base'")


def _assemble(up: _Upload, take_buffer: Callable[[int], bytearray]) -> bytes | bytearray:
    """The whole upload, every shard's digest compared with the manifest and the root checked.

    No byte is hashed here: each shard was hashed as it arrived, and the whole's digest is the root
    over those digests (`protocol.adapters.shard_root`), so a changed, missing, reordered or extra
    shard is refused without a second pass. A one-shard upload is used as it is; several are
    copied into one buffer (`take_buffer`, reused from push to push) for the tar and safetensors
    readers, which need the bytes in one piece.
    """
    manifest = up.manifest
    parts = []
    for i, want in enumerate(manifest.shard_sha256):
        got = up.shards.get((i, manifest.num_shards))
        if got is None:
            raise UploadError(f"shard {i} of {manifest.num_shards} missing")
        if got[1] != want.lower():
            raise UploadError(f"shard {i}: sha256 does not match the manifest")
        parts.append(got)
    size = sum(len(data) for data, _ in parts)
    if size != manifest.total_bytes or shard_root([d for _, d in parts]) != manifest.sha256.lower():
        raise UploadError("assembled adapter does not match the manifest sha256/size")
    if len(parts) == 1:
        return parts[0][0]
    blob, offset = take_buffer(size), 0
    for data, _ in parts:
        blob[offset:offset + len(data)] = data
        offset += len(data)
    return blob


def _members(blob: bytes | bytearray) -> dict[str, memoryview]:
    """The two PEFT files of the tar as views into `blob` (nothing copied, nothing written).

    Only regular files with exactly the two PEFT names are accepted. Bytes that match their
    manifest can still be no tar at all (or a truncated one): that is the sender's error, refused
    like any other bad upload rather than a server error.
    """
    view = memoryview(blob)
    try:
        with tarfile.open(fileobj=_ViewReader(view), mode="r:") as tar:
            members = tar.getmembers()
    except (tarfile.TarError, EOFError) as exc:
        raise UploadError(f"upload is not a readable tar archive: {exc!r}") from None
    names = [m.name for m in members]
    plain = all(m.type in (tarfile.REGTYPE, tarfile.AREGTYPE) for m in members)  # no links, no sparse
    if sorted(names) != sorted(ADAPTER_FILES) or not plain:
        raise UploadError(f"upload must contain exactly {sorted(ADAPTER_FILES)} as files")
    out = {}
    for m in members:
        if m.offset_data + m.size > len(view):
            raise UploadError(f"upload is not a readable tar archive: {m.name} is truncated")
        out[m.name] = view[m.offset_data:m.offset_data + m.size]
    return out


SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                      "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                      "U8": torch.uint8, "BOOL": torch.bool}
MAX_SAFETENSORS_HEADER = 100 << 20  # the format's own limit


def read_safetensors(view: memoryview, where: str) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file held in `view`, as tensors over its bytes (no copy).

    Why not `safetensors.torch.load`: it copies every tensor out of a `bytes` (and the caller would
    first copy the view into one); the loader copies once anyway, when it converts to the serving
    dtype. Every header field is checked against the buffer, so hostile bytes are an `AdapterError`,
    never a read outside the file.
    """
    def bad(why: str) -> AdapterError:
        return AdapterError(f"{where}: cannot be read as safetensors ({why})")

    if len(view) < 8:
        raise bad("shorter than its header length")
    size = int.from_bytes(view[:8], "little")
    if size > min(len(view) - 8, MAX_SAFETENSORS_HEADER):
        raise bad(f"header of {size} bytes in a file of {len(view)}")
    try:
        header = json.loads(bytes(view[8:8 + size]))
    except ValueError as exc:
        raise bad(f"header is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise bad("header is not a JSON object")
    data, out = view[8 + size:], {}
    for key, info in header.items():
        if key == "__metadata__":
            continue
        if not isinstance(info, dict) or info.get("dtype") not in SAFETENSORS_DTYPES:
            raise bad(f"tensor {key!r}: unknown dtype")
        shape, offsets = info.get("shape"), info.get("data_offsets")
        if (not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape)
                or not isinstance(offsets, list) or len(offsets) != 2
                or not all(type(o) is int for o in offsets)):
            raise bad(f"tensor {key!r}: bad shape or data_offsets")
        dtype, (begin, end) = SAFETENSORS_DTYPES[info["dtype"]], offsets
        count = math.prod(shape)
        if not 0 <= begin <= end <= len(data) or end - begin != count * dtype.itemsize:
            raise bad(f"tensor {key!r}: data_offsets {offsets} do not fit shape {shape} in {len(data)} bytes")
        with warnings.catch_warnings():  # a read-only buffer: the loader only reads (and copies) it
            warnings.simplefilter("ignore", UserWarning)
            flat = (torch.frombuffer(data, dtype=dtype, count=count, offset=begin) if count
                    else torch.empty(0, dtype=dtype))
        out[key] = flat.view(shape)
    return out


class _ViewReader:
    """A read-only file over a memoryview, for tarfile to read headers from (no copy of the data)."""

    def __init__(self, view: memoryview) -> None:
        self.view, self.pos = view, 0

    def read(self, size: int = -1) -> bytes:
        end = len(self.view) if size is None or size < 0 else min(len(self.view), self.pos + size)
        out = bytes(self.view[self.pos:end])
        self.pos = max(self.pos, end)
        return out

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self.pos, 2: len(self.view)}[whence]
        self.pos = max(0, base + offset)
        return self.pos

    def tell(self) -> int:
        return self.pos
