"""Peak tensor memory of a piece of code, on any device (CPU included).

Why: `torch.cuda.max_memory_allocated` has no CPU counterpart, and a process's peak RSS only ever
rises (the allocator keeps freed pages), so modes measured one after another in one process cannot
be told apart by RSS. `PeakMemory` is a dispatch mode that adds the bytes of every storage an op
creates while it is active and subtracts them when the storage is freed (PyTorch keeps one Python
object per live storage, so a weakref finalizer fires exactly then). Tensors made before the mode
(weights, inputs) are not counted: the figure is what the measured code allocated on top.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class PeakMemory(TorchDispatchMode):
    """`with PeakMemory() as m: ...` then `m.peak` (bytes); `m.live` is what is still allocated."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._tracked: dict[int, int] = {}  # id(storage) -> bytes, while the storage lives

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = {id(a.untyped_storage()) for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._track(t, inputs)
        return out

    def _track(self, t: torch.Tensor, inputs: set[int]) -> None:
        storage = t.untyped_storage()
        key = id(storage)
        if key in self._tracked or key in inputs or storage.nbytes() == 0:
            return  # counted already, a view or in-place result of an input, or empty
        size = storage.nbytes()
        self._tracked[key] = size
        self.live += size
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._free, key)

    def _free(self, key: int) -> None:
        self.live -= self._tracked.pop(key, 0)


def mib(nbytes: float) -> float:
    return nbytes / 2**20
