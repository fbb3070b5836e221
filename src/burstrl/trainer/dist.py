"""torch.distributed for the trainer's data-parallel ranks, and a no-op stand-in for one rank.

Rank 0 alone reads the rollout store and writes checkpoints; it broadcasts each step's batch to the
others. Gradients of the LoRA parameters are summed across ranks in one flat all-reduce (the loss is
already divided by the whole batch's token count, so the sum is the full-batch gradient).
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


class Dist:
    """This process's rank in the trainer group (world 1: no process group at all)."""

    def __init__(self, backend: str = "auto", device: torch.device | None = None) -> None:
        self.rank = int(os.environ.get("BURSTRL_RANK", os.environ.get("RANK", "0")))
        self.world = int(os.environ.get("BURSTRL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
        self.device = device or torch.device("cpu")
        if self.device.type == "cuda" and self.device.index is None:  # one GPU per rank on a node
            self.device = torch.device("cuda", self.rank % max(torch.cuda.device_count(), 1))
            torch.cuda.set_device(self.device)
        if self.world > 1:
            if backend == "auto":
                backend = "nccl" if self.device.type == "cuda" else "gloo"
            dist.init_process_group(backend=backend, rank=self.rank, world_size=self.world,
                                    timeout=timedelta(hours=24))  # rank 0 may wait long for data

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's object on every rank."""
        if self.world == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's object, in rank order, on every rank."""
        if self.world == 1:
            return [obj]
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def sum_(self, tensor: torch.Tensor) -> torch.Tensor:
        return self._reduce(tensor, dist.ReduceOp.SUM)

    def max_(self, tensor: torch.Tensor) -> torch.Tensor:
        return self._reduce(tensor, dist.ReduceOp.MAX)

    def _reduce(self, tensor: torch.Tensor, op: Any) -> torch.Tensor:
        """All-reduce in place; a CPU tensor travels through the device (NCCL reduces GPU tensors only)."""
        if self.world > 1:
            moved = tensor.to(self.device)
            dist.all_reduce(moved, op=op)
            tensor.copy_(moved)
        return tensor

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    def sum_grads(self, params: list[torch.nn.Parameter]) -> None:
        """All-reduce (sum) every parameter's gradient as one flat buffer."""
        if self.world == 1:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        offset = 0
        for p in params:
            n = p.numel()
            p.grad = flat[offset:offset + n].view_as(p).clone()
            offset += n

    def close(self) -> None:
        if self.world > 1 and dist.is_initialized():
            dist.destroy_process_group()
