"""Publish a committed step's adapter as `policy-vN`: the volume first, then every replica.

Rank 0 writes the version to the volume (atomic, sha256 manifest) and prunes old versions; then
every rank pushes its shards (rank r sends shards r, r+W, ...) to every replica in parallel, and
rank 0 sends each replica the manifest and the commit. A replica that fails is reported and counted,
never fatal: it will load the newest version from the volume when it restarts.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from burstrl.config import TrainConfig
from burstrl.trainer.dist import Dist


def volume_dir(cfg: TrainConfig) -> Path:
    return Path(cfg.weights.volume) if cfg.weights.volume else Path(cfg.run_dir) / "adapters"


def publish_version(cfg: TrainConfig, step: int, adapter_dir: Path, dist: Dist) -> dict[str, Any]:
    """Make `policy-v{step}` servable; every rank calls this. Returns push figures (rank 0's view)."""
    from burstrl.weights.volume import gc, publish

    w = cfg.weights
    volume, name = volume_dir(cfg), f"policy-v{step}"
    if dist.is_main:
        publish(volume, step, adapter_dir)
        gc(volume, keep=w.keep_versions, protect={step})
    targets = dist.broadcast(_targets(cfg) if dist.is_main else None)
    dist.barrier()
    if not targets:
        return {"push_ok": 0, "push_failed": 0}
    from burstrl.weights.push import push_commit, push_shards

    report = push_shards(volume / name, name, targets, dist.rank, dist.world, retries=w.push_retries)
    dist.barrier()
    if not dist.is_main:
        return {}
    final = push_commit(volume / name, name, targets, dist.world, retries=w.push_retries)
    failed = {**report.failed, **final.failed}
    return {"push_ok": len(targets) - len(failed), "push_failed": len(failed),
            "push_failures": failed, "push_bytes": report.bytes_sent}


def _targets(cfg: TrainConfig) -> list:
    w = cfg.weights
    if not w.replicas and not w.replicas_file:
        return []
    from burstrl.weights.push import read_targets

    token = w.admin_token or os.environ.get("BURSTRL_ADMIN_TOKEN", "")
    verify: bool | str = w.ca_file or w.verify_tls
    return read_targets(w.replicas, w.replicas_file, token, verify)
