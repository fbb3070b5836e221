"""Checkpoints: the adapter, optimizer, scheduler and RNG states of a complete step.

Commit protocol (a crash at any instant leaves the old or the new step complete, never a mix):

1. write `checkpoints/step-N` through a temp dir + rename (a half-written one is never named);
2. commit the step in the rollout store: one transaction marks the step's groups consumed and
   records the step with its checkpoint path. This transaction is the commit point;
3. publish `policy-vN` (volume, then push to replicas).

On resume the store's last step S names the checkpoint to load; `step-M` dirs with M > S are
leftovers of a crash between 1 and 2 and are deleted (their groups are still buffered). Publishing
after the commit keeps versions immutable: a crash before the commit never published `policy-vN`,
and a crash after it re-publishes the same weights from the checkpoint (idempotent).
"""

from __future__ import annotations

import os
import random
import shutil
import uuid
from pathlib import Path
from typing import Any

import torch

from burstrl.atomic import fsync_dir


class CheckpointError(RuntimeError):
    """A checkpoint the store says exists is missing or unreadable."""


def step_dir(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step-{step}"


def save(run_dir: Path, step: int, model: Any, optimizer: torch.optim.Optimizer, scheduler: Any,
         extra: dict[str, Any]) -> Path:
    """Write step N's checkpoint atomically; returns its directory."""
    final = step_dir(run_dir, step)
    tmp = final.with_name(f".tmp-{final.name}-{uuid.uuid4().hex[:8]}")
    tmp.mkdir(parents=True)
    model.save_pretrained(str(tmp / "adapter"))
    state = {
        "step": step,
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
        **extra,
    }
    torch.save(state, tmp / "trainer_state.pt")
    _fsync_tree(tmp)
    if final.exists():  # a leftover of a crash before its commit: never referenced by the store
        shutil.rmtree(final)
    os.rename(tmp, final)
    fsync_dir(final.parent)
    return final


def load_state(path: Path) -> dict[str, Any]:
    """The trainer state of a checkpoint dir (the adapter is loaded by the caller)."""
    file = path / "trainer_state.pt"
    if not file.is_file() or not (path / "adapter" / "adapter_model.safetensors").is_file():
        raise CheckpointError(f"checkpoint {path} is missing or incomplete; cannot resume from it")
    return torch.load(file, map_location="cpu", weights_only=False)


def restore_rng(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["rng"]["torch"])
    random.setstate(state["rng"]["python"])


def prune(run_dir: Path, last_committed: int, keep: int = 2) -> None:
    """Delete uncommitted leftovers (step > last) and all but the newest `keep` committed ones."""
    root = run_dir / "checkpoints"
    if not root.is_dir():
        return
    for path in root.iterdir():
        if path.name.startswith(".tmp-"):
            shutil.rmtree(path, ignore_errors=True)
            continue
        if not path.name.startswith("step-"):
            continue
        n = int(path.name.removeprefix("step-"))
        if n > last_committed or n <= last_committed - keep:
            shutil.rmtree(path, ignore_errors=True)


def _fsync_tree(root: Path) -> None:
    for path in root.rglob("*"):
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
    fsync_dir(root)


