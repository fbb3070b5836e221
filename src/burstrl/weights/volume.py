"""The versions directory: `policy-vN` directories that appear atomically and never change.

Layout (default RUN_DIR/adapters):

    policy-v3/adapter_config.json
    policy-v3/adapter_model.safetensors
    policy-v3/manifest.json   {"version": 3, "name": "policy-v3",
                               "files": {fname: {"sha256": hex, "bytes": n}}}

Why a rename: a replica that starts while the trainer is publishing must never load half a
version, so a version is written under `.tmp-policy-vN-<random>`, fsynced, and renamed into place
(rename is atomic on one filesystem). Why a manifest: a volume is often a network filesystem and
files can be truncated or damaged after the fact; readers verify the hashes and skip a broken
version instead of serving it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import secrets
import shutil
import time
from pathlib import Path
from typing import Any

from burstrl.atomic import build_dir, sha256_file
from burstrl.protocol.adapters import ADAPTER_FILES
from burstrl.protocol.versions import VERSION_NAME, version_name

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
TMP_PREFIX = ".tmp-"
TMP_MAX_AGE_S = 60.0  # a publish takes seconds; an older temp dir is a crashed writer's leftover
CHUNK = 1 << 20


class VersionExists(FileExistsError):
    """`policy-vN` is already published with different content (versions never change)."""


class VersionCorrupt(ValueError):
    """A version directory does not match its manifest (missing, truncated or altered files)."""


def publish(volume: Path, version: int, adapter_dir: Path) -> Path:
    """Publish the PEFT files of `adapter_dir` as `volume/policy-vN`; returns that directory.

    Idempotent for identical content (a resumed trainer re-publishes the step it crashed after);
    different content under an existing version raises `VersionExists`.
    """
    if version < 1:
        raise ValueError(f"version must be >= 1 (v0 is the base model), got {version}")
    volume, adapter_dir = Path(volume), Path(adapter_dir)
    volume.mkdir(parents=True, exist_ok=True)
    final = volume / version_name(version)
    if final.exists():
        return _same_or_refuse(final, _hash_files(adapter_dir))
    files: dict[str, dict[str, Any]] = {}

    def write(tmp: Path) -> None:
        files.update({name: _copy_hashed(adapter_dir / name, tmp / name) for name in sorted(ADAPTER_FILES)})
        manifest = {"version": version, "name": final.name, "files": files}
        _write_synced(tmp / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True).encode())

    try:
        build_dir(final, write, durable=True, prefix=f"{TMP_PREFIX}{final.name}-")
    except FileExistsError:
        if not final.exists():
            raise
        return _same_or_refuse(final, files or _hash_files(adapter_dir))  # another publisher won the race
    log.info("published %s (%d bytes)", final, sum(f["bytes"] for f in files.values()))
    return final


def verify(path: Path) -> None:
    """Raise `VersionCorrupt` unless `path` holds exactly the files its manifest lists, hashes equal."""
    path = Path(path)
    manifest = read_manifest(path)
    for name, want in manifest["files"].items():
        file = path / name
        if not file.is_file():
            raise VersionCorrupt(f"{path}: {name} is missing")
        if file.stat().st_size != want["bytes"]:
            raise VersionCorrupt(f"{path}: {name} has {file.stat().st_size} bytes, not {want['bytes']}")
        if sha256_file(file) != want["sha256"]:
            raise VersionCorrupt(f"{path}: {name} sha256 does not match the manifest")


def read_manifest(path: Path) -> dict[str, Any]:
    """The manifest of a version directory, checked for shape and for naming this directory."""
    path = Path(path)
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        version, name, files = int(manifest["version"]), manifest["name"], manifest["files"]
        sizes = {f: (str(v["sha256"]), int(v["bytes"])) for f, v in files.items()}
    except FileNotFoundError:
        raise VersionCorrupt(f"{path}: no {MANIFEST}") from None
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise VersionCorrupt(f"{path}: bad {MANIFEST}: {exc!r}") from None
    if name != path.name or version_name(version) != name:
        raise VersionCorrupt(f"{path}: manifest names {name!r} (version {version})")
    if set(sizes) != ADAPTER_FILES:
        raise VersionCorrupt(f"{path}: manifest lists {sorted(sizes)}, expected {sorted(ADAPTER_FILES)}")
    return manifest


def versions(volume: Path) -> list[int]:
    """Version numbers of the `policy-vN` directories in `volume`, ascending (not verified)."""
    volume = Path(volume)
    if not volume.is_dir():
        return []
    found = (VERSION_NAME.fullmatch(p.name) for p in volume.iterdir() if p.is_dir())
    return sorted(int(m.group(1)) for m in found if m)


def latest(volume: Path) -> tuple[int, Path] | None:
    """The newest version that verifies, or None; broken newer ones are logged and skipped."""
    for version in reversed(versions(volume)):
        path = Path(volume) / version_name(version)
        try:
            verify(path)
        except VersionCorrupt as exc:
            log.warning("skipping broken version: %s", exc)
            continue
        return version, path
    return None


def gc(volume: Path, keep: int, protect: set[int] = frozenset()) -> list[int]:
    """Delete versions older than the newest `keep`, except protected ones; returns those deleted.

    `protect` is for versions still in use (rollouts pinned to them, a checkpoint). Each deleted
    directory is first renamed to a temp name, so readers never see half a version. Temp dirs
    older than a minute (a crashed publish or gc) are removed too.
    """
    if keep < 1:
        raise ValueError("keep must be >= 1: the newest version is what late joiners load")
    volume = Path(volume)
    if not volume.is_dir():
        return []
    _remove_stale_tmp(volume)
    deleted = []
    for version in versions(volume)[:-keep]:
        if version in protect:
            continue
        path = volume / version_name(version)
        doomed = volume / f"{TMP_PREFIX}gc-{path.name}-{secrets.token_hex(6)}"
        path.rename(doomed)
        shutil.rmtree(doomed)
        deleted.append(version)
    if deleted:
        log.info("gc removed versions %s from %s", deleted, volume)
    return deleted


def _remove_stale_tmp(volume: Path) -> None:
    now = time.time()
    for path in volume.iterdir():
        if path.name.startswith(TMP_PREFIX) and now - path.stat().st_mtime > TMP_MAX_AGE_S:
            log.info("removing leftover %s", path)
            shutil.rmtree(path, ignore_errors=True)


def _same_or_refuse(final: Path, files: dict[str, dict[str, Any]]) -> Path:
    """Return `final` when it holds exactly `files` (and verifies); else raise."""
    existing = read_manifest(final)["files"]
    if existing != files:
        raise VersionExists(f"{final} is already published with different content; versions never change")
    verify(final)
    log.info("%s already published with identical content", final)
    return final


def _hash_files(adapter_dir: Path) -> dict[str, dict[str, Any]]:
    out = {}
    for name in sorted(ADAPTER_FILES):
        path = adapter_dir / name
        out[name] = {"sha256": sha256_file(path), "bytes": path.stat().st_size}
    return out


def _copy_hashed(src: Path, dst: Path) -> dict[str, Any]:
    """Copy one file, hashing it as it is read, and fsync the copy."""
    digest, size = hashlib.sha256(), 0
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        while chunk := fin.read(CHUNK):
            digest.update(chunk)
            fout.write(chunk)
            size += len(chunk)
        fout.flush()
        os.fsync(fout.fileno())
    return {"sha256": digest.hexdigest(), "bytes": size}


def _write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
