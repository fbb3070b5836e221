"""Publish a committed step's adapter as `policy-vN`: the volume first, then every replica.

Rank 0 writes the version to the volume (atomic, sha256 manifest) and prunes old versions; then
every rank pushes its shards (rank r sends shards r, r+W, ...) to every replica in parallel, and
rank 0 sends each replica the manifest and the commit. A replica that fails is reported and counted,
never fatal: it will load the newest version from the volume when it restarts.

A version must be finite to be published: an adapter holding NaN or inf (a diverged step) stops the
trainer with `NonFiniteAdapter` before anything reaches the volume or a replica, so no replica ever
serves it and no late joiner loads it.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from burstrl.config import TrainConfig
from burstrl.protocol.adapters import Packer
from burstrl.protocol.versions import version_name

if TYPE_CHECKING:  # no torch for what needs none (`serving_dtype`: the tenant launcher's catch-up push)
    from burstrl.trainer.dist import Dist


class NonFiniteAdapter(ValueError):
    """The adapter of a step holds NaN or inf values; it is never published."""


def volume_dir(cfg: TrainConfig) -> Path:
    return Path(cfg.weights.volume) if cfg.weights.volume else Path(cfg.run_dir) / "adapters"


def publish_version(cfg: TrainConfig, step: int, adapter_dir: Path, dist: Dist,
                    packer: Packer | None = None) -> dict[str, Any]:
    """Make `policy-v{step}` servable; every rank calls this. Returns push figures (rank 0's view)."""
    refuse_non_finite(step, adapter_dir, dist)
    if dist.is_main:
        write_to_volume(cfg, step, adapter_dir)
    return push_version(cfg, step, dist, packer)


def refuse_non_finite(step: int, adapter_dir: Path, dist: Dist) -> None:
    """Raise `NonFiniteAdapter` on every rank if the step's adapter holds NaN or inf.

    Rank 0 (which wrote the checkpoint) reads the file and every rank gets its verdict, so all ranks
    stop together instead of some waiting forever in the push's collectives.
    """
    bad = dist.broadcast(first_non_finite(adapter_dir) if dist.is_main else None)
    if bad is not None:
        raise NonFiniteAdapter(f"{version_name(step)}: tensor {bad!r} of {adapter_dir} holds NaN or inf; "
                               "refusing to publish it (nothing written to the volume or pushed)")


def first_non_finite(adapter_dir: Path) -> str | None:
    """The name of the first (sorted) tensor of the adapter's safetensors with a NaN or inf, if any."""
    import torch
    from safetensors import safe_open

    with safe_open(str(Path(adapter_dir) / "adapter_model.safetensors"), framework="pt") as f:
        for key in sorted(f.keys()):
            tensor = f.get_tensor(key)
            if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                return key
    return None


def serving_files(adapter_dir: Path, dtype: str) -> dict[str, bytes]:
    """The adapter's two files with its floating tensors cast to the replicas' serving dtype, in memory.

    Why: PEFT saves float32, replicas serve bfloat16 and cast on load; cast once here, the push
    carries half the bytes (half the hashing, copying and receiving on every replica) and the
    replica's cast becomes a copy. The values served are the same (torch rounds to nearest even
    either way); a value that overflows the dtype becomes inf and the replica refuses the version,
    as it would have after its own cast. The volume keeps the float32 files (late joiners, resumes).
    """
    import torch
    from safetensors.torch import load_file, save

    target = getattr(torch, dtype)
    if not isinstance(target, torch.dtype) or not target.is_floating_point:
        raise ValueError(f"not a floating torch dtype: {dtype!r}")
    tensors = load_file(str(Path(adapter_dir) / "adapter_model.safetensors"))
    cast = {k: t.to(target) if t.is_floating_point() else t for k, t in tensors.items()}
    return {"adapter_config.json": (Path(adapter_dir) / "adapter_config.json").read_bytes(),
            "adapter_model.safetensors": save(cast, metadata={"format": "pt"})}


def serving_dtype(cfg: TrainConfig) -> str:
    """The dtype pushed to replicas: `weights.serving_dtype`, its auto resolved from `model.dtype`.

    Why auto follows the model and not the device: the replicas serve `model.dtype` when it names
    one, while "auto" there means float32 on CPU and bfloat16 on GPU, per replica, which the trainer
    cannot see; pushing float32 is then always exact (the replica casts on load).
    """
    chosen = cfg.weights.serving_dtype
    if chosen != "auto":
        return chosen
    return cfg.model.dtype if cfg.model.dtype in ("bfloat16", "float16") else "float32"


def write_to_volume(cfg: TrainConfig, step: int, adapter_dir: Path) -> None:
    """Rank 0: the version on the volume (atomic; late joiners load it from there), old ones pruned."""
    from burstrl.weights.volume import gc, publish

    publish(volume_dir(cfg), step, adapter_dir)
    gc(volume_dir(cfg), keep=cfg.weights.keep_versions, protect={step})


def push_version(cfg: TrainConfig, step: int, dist: Dist, packer: Packer | None = None) -> dict[str, Any]:
    """Push the published version to every replica: shards split across ranks, rank 0 commits.

    Each rank packs (reads and hashes) the version once, into `packer`'s buffer when given (kept
    from version to version); rank 0 commits with the manifest of that same pack.
    """
    w = cfg.weights
    volume, name = volume_dir(cfg), version_name(step)
    targets = dist.broadcast(_targets(cfg) if dist.is_main else None)
    dist.barrier()
    if not targets:
        return {"push_ok": 0, "push_failed": 0}
    from burstrl.weights.push import PushReport, push_commit, push_shards

    dtype = serving_dtype(cfg)
    files = serving_files(volume / name, dtype) if dtype != "float32" else None
    manifest, mine = push_shards(volume / name, name, targets, dist.rank, dist.world, retries=w.push_retries,
                                 packer=packer, files=files)
    sent = PushReport.merge(dist.gather(mine))  # every rank's shards are in (or failed)
    if not dist.is_main:
        return {}
    final = push_commit(volume / name, name, sent.usable(targets), dist.world, retries=w.push_retries,
                        manifest=manifest)
    report = PushReport.merge([sent, final])
    from burstrl.weights.gc import unload_old

    keep = {version_name(n) for n in range(max(1, step - w.keep_versions + 1), step + 1)}
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


class Publisher:
    """Publishes each committed step; with one rank the push to the replicas runs in the background.

    Why: on the benchmark machine the push took ~0.1 s per replica (half of a step at 4 replicas),
    time the trainer can spend waiting for and training on the next batch instead. The version is
    on the volume before `publish` returns (late joiners see it at once); pushes stay in order, since
    each one is joined before the next starts (and on `close`); a push that raises re-raises in the
    trainer at the next join. With several ranks the push needs collectives on the trainer's
    thread, so it stays synchronous. The figures a call returns are those of the last push that
    finished (the previous step's, when pushing in the background).
    """

    def __init__(self, cfg: TrainConfig, dist: Dist) -> None:
        self.cfg, self.dist = cfg, dist
        self.background = cfg.weights.async_push and dist.world == 1
        self.thread: threading.Thread | None = None
        self.figures: dict[str, Any] = {}
        self.error: BaseException | None = None
        self.packer = Packer()  # one buffer for every version's pack; pushes never overlap (see wait)

    def publish(self, step: int, adapter_dir: Path) -> dict[str, Any]:
        done = self.wait()
        if not self.background:
            return publish_version(self.cfg, step, adapter_dir, self.dist, self.packer)
        refuse_non_finite(step, adapter_dir, self.dist)
        write_to_volume(self.cfg, step, adapter_dir)
        self.thread = threading.Thread(target=self._push, args=(step,), name=f"push-v{step}", daemon=True)
        self.thread.start()
        return done

    def _push(self, step: int) -> None:
        start = time.monotonic()
        try:
            self.figures = {**push_version(self.cfg, step, self.dist, self.packer), "push_version": step,
                            "push_s": time.monotonic() - start}
        except BaseException as exc:  # re-raised by the trainer's thread in wait()
            self.error = exc

    def wait(self) -> dict[str, Any]:
        """Join the push in flight; its figures (empty if none ran since the last call)."""
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        if self.error is not None:
            error, self.error = self.error, None
            raise error
        figures, self.figures = self.figures, {}
        return figures
