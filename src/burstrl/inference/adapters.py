"""Adapter versions on a replica: load, retire, and assemble sharded uploads.

Why retire instead of unload: a rollout is pinned to the version it started on. Unloading
`policy-v3` while a session still uses it would strand that rollout, so an unloaded version stops
taking new sessions at once and is freed when its last session is released.

Sharded upload (packing and manifest in `burstrl.protocol.adapters`): the trainer ranks each `PUT`
a byte range of the adapter directory packed as a tar (`/v1/adapters/{name}/shards/{i}?of={n}`),
rank 0 `PUT`s a manifest with the sha256 of every shard and of the whole, and `POST .../commit`
verifies everything and loads it. Nothing is served until all checks pass; a corrupt or incomplete
upload is refused and its staging area deleted. An upload that is never committed (a trainer that
died mid-push) is deleted once idle for `upload_ttl_s`, so abandoned shards cannot fill the
replica's disk.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import tarfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

from burstrl.inference.lora import AdapterError, LoraAdapter, Shapes, load_adapter, module_shapes
from burstrl.protocol.adapters import ADAPTER_FILES, MAX_SHARDS, Manifest, UploadError

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")  # used with fullmatch: no "..", no "\n"


class AdapterRegistry:
    """Loaded adapter versions by name, with retirement and sharded-upload staging.

    `shapes` (lora.module_shapes of the base model) makes every load check each A/B against its
    projection; without it only ranks and layer indices are checked.
    """

    def __init__(self, state_dir: Path, num_layers: int, dtype: torch.dtype, device: torch.device,
                 shapes: Shapes | None = None, upload_ttl_s: float = 600.0) -> None:
        self.state_dir = state_dir
        self.num_layers, self.dtype, self.device = num_layers, dtype, device
        self.shapes, self.upload_ttl_s = shapes, upload_ttl_s
        self.active: dict[str, LoraAdapter] = {}
        self.retiring: dict[str, LoraAdapter] = {}
        self._lock = threading.Lock()
        # a new process has no upload in flight: whatever a previous one staged is abandoned
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
        if not NAME.fullmatch(name) or name == "base":
            raise AdapterError(f"adapter name must match {NAME.pattern} and not be 'base'")
        adapter = load_adapter(name, path, self.num_layers, self.dtype, self.device, self.shapes)
        with self._lock:
            if name in self.active or name in self.retiring:
                raise AdapterError(f"adapter {name!r} is already loaded; versions never change")
            self.active[name] = adapter
        return adapter

    def unload(self, name: str, in_use: dict[str, int]) -> str:
        """Stop new sessions on `name`; free it now if no session uses it. Returns the state."""
        with self._lock:
            if name not in self.active:
                raise KeyError(name)
            adapter = self.active.pop(name)
            if in_use.get(name, 0):
                self.retiring[name] = adapter
                return "retiring"
            return "unloaded"

    def collect(self, in_use: dict[str, int]) -> list[str]:
        """Free retiring versions whose last session has been released."""
        with self._lock:
            done = [n for n in self.retiring if not in_use.get(n, 0)]
            for n in done:
                del self.retiring[n]
            return done

    # ---- sharded upload ----
    def _staging(self, name: str) -> Path:
        if not NAME.fullmatch(name) or name == "base":
            raise UploadError(f"adapter name must match {NAME.pattern} and not be 'base'")
        return self.state_dir / "uploads" / name

    def _touch_staging(self, name: str) -> Path:
        """Sweep abandoned uploads, then create or refresh this one's staging dir (its idle clock)."""
        self.sweep_uploads()
        staging = self._staging(name)
        staging.mkdir(parents=True, exist_ok=True)
        os.utime(staging)
        return staging

    def sweep_uploads(self, now: float | None = None) -> list[str]:
        """Delete staging dirs idle for `upload_ttl_s` (their mtime); returns the names removed."""
        now = time.time() if now is None else now
        try:
            entries = list((self.state_dir / "uploads").iterdir())
        except FileNotFoundError:
            return []
        removed = []
        for entry in entries:
            try:
                stale = now - entry.stat().st_mtime > self.upload_ttl_s
            except FileNotFoundError:  # removed by a concurrent sweep or commit
                continue
            if stale:
                shutil.rmtree(entry, ignore_errors=True)
                removed.append(entry.name)
        return removed

    def put_shard(self, name: str, index: int, of: int, data: bytes, sha256: str | None) -> None:
        if not 0 <= index < of <= MAX_SHARDS:
            raise UploadError(f"shard index must satisfy 0 <= i < of <= {MAX_SHARDS}")
        digest = hashlib.sha256(data).hexdigest()  # once, on arrival: commit compares, never rehashes
        if sha256 is not None and digest != sha256.lower():
            raise UploadError(f"shard {index}: sha256 mismatch")
        staging = self._touch_staging(name)
        final = staging / f"shard-{index}.of-{of}"
        tmp = final.with_name(final.name + ".tmp")
        tmp.write_bytes(data)
        final.with_name(final.name + ".sha256").write_text(digest)
        tmp.rename(final)

    def put_manifest(self, name: str, data: Any) -> Manifest:
        manifest = Manifest.parse(data)
        if manifest.name != name:
            raise UploadError(f"manifest names {manifest.name!r}, not {name!r}")
        staging = self._touch_staging(name)
        (staging / "manifest.json").write_text(json.dumps(manifest.to_json()))
        return manifest

    def commit(self, name: str) -> LoraAdapter:
        """Verify the staged shards against the manifest, unpack, load. Staging is always removed."""
        staging = self._staging(name)
        unpacked = self.state_dir / "unpacking" / name  # its own namespace: no staging dir collides
        try:
            with self._lock:
                if name in self.active or name in self.retiring:
                    raise UploadError(f"adapter {name!r} is already loaded; versions never change")
            blob = self._assemble(staging)
            shutil.rmtree(unpacked, ignore_errors=True)
            unpacked.mkdir(parents=True)
            _extract(blob, unpacked)
            target = self.state_dir / "adapters" / name
            shutil.rmtree(target, ignore_errors=True)  # a refused earlier attempt, never served
            target.parent.mkdir(parents=True, exist_ok=True)
            unpacked.rename(target)
            return self.load(name, target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
            shutil.rmtree(unpacked, ignore_errors=True)

    def _assemble(self, staging: Path) -> bytes:
        if not (staging / "manifest.json").is_file():
            raise UploadError("no manifest uploaded")
        manifest = Manifest.parse(json.loads((staging / "manifest.json").read_text()))
        parts, whole = [], hashlib.sha256()
        for i, want in enumerate(manifest.shard_sha256):
            path = staging / f"shard-{i}.of-{manifest.num_shards}"
            digest = path.with_name(path.name + ".sha256")
            if not path.is_file() or not digest.is_file():
                raise UploadError(f"shard {i} of {manifest.num_shards} missing")
            if digest.read_text() != want:
                raise UploadError(f"shard {i}: sha256 does not match the manifest")
            data = path.read_bytes()
            whole.update(data)
            parts.append(data)
        blob = b"".join(parts)
        if len(blob) != manifest.total_bytes or whole.hexdigest() != manifest.sha256:
            raise UploadError("assembled adapter does not match the manifest sha256/size")
        return blob


def _extract(blob: bytes, target: Path) -> None:
    """Unpack only the two PEFT files, as regular files (no links, no paths).

    Bytes that match their manifest can still be no tar at all (or a truncated one): that is the
    sender's error, refused like any other bad upload rather than a server error.
    """
    try:
        with tarfile.open(fileobj=io.BytesIO(blob), mode="r:") as tar:
            members = tar.getmembers()
            names = {m.name for m in members}
            if names != ADAPTER_FILES or not all(m.isfile() for m in members):
                raise UploadError(f"upload must contain exactly {sorted(ADAPTER_FILES)} as files")
            tar.extractall(target, filter="data")
    except (tarfile.TarError, EOFError) as exc:  # FilterError and ReadError are TarErrors
        raise UploadError(f"upload is not a readable tar archive: {exc!r}") from None
