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
    from burstrl.weights.push import PushReport, push_commit, push_shards

    mine = push_shards(volume / name, name, targets, dist.rank, dist.world, retries=w.push_retries)
    sent = PushReport.merge(dist.gather(mine))  # every rank's shards are in (or failed)
    if not dist.is_main:
        return {}
    final = push_commit(volume / name, name, sent.usable(targets), dist.world, retries=w.push_retries)
    report = PushReport.merge([sent, final])
    from burstrl.weights.gc import unload_old

    keep = {f"policy-v{n}" for n in range(max(1, step - w.keep_versions + 1), step + 1)}
    unload_old(targets, keep)  # a replica keeps a version alive while sessions still use it
    return {"push_ok": len(report.ok), "push_failed": len(report.failed),
            "push_failures": report.failed, "push_bytes": sent.bytes_sent}


def _targets(cfg: TrainConfig) -> list:
    w = cfg.weights
    if not w.replicas and not w.replicas_file:
        return []
    from burstrl.weights.push import read_targets

    token = w.admin_token or os.environ.get("BURSTRL_ADMIN_TOKEN", "")
    verify: bool | str = w.ca_file or w.verify_tls
    return read_targets(w.replicas, w.replicas_file, token, verify)
