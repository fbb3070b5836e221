"""A sandbox's writable /work, shared by every backend: its own size-limited filesystem, seeded
from the image's /work by an overlay (or a copy where no overlay can be mounted).

Why a filesystem of its own (`quota.sized_dir`, `SandboxSpec.workdir_mb`): a plain host dir bound
at /work let sandboxed code fill the host's disk (2 GiB written inside took 2.15 GB of it). As
root /work (or, under an overlay, its upper and work dirs) lives on an ext4 image on a loop
device, so a write past the limit is ENOSPC inside and the host gives at most `workdir_mb`. Run
by an ordinary user nothing can be mounted: /work is a plain dir, `LimitsReport.disk` says
"none" and a warning says so once.

Layout under the sandbox's dir: `work` (bound at /work), and with an image `q` (the sized fs
holding the overlay's `upper` and `ovwork`), `work.img`/`q.img` (the sparse images).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

from burstrl.sandbox.backends.base import SandboxSpec, SandboxState, warn_once
from burstrl.sandbox.backends.quota import SizedDir, sized_dir


def default_layer_cache() -> Any:
    """The node's layer cache when none was given: $BURSTRL_CACHE/sandbox-layers, 20 GiB."""
    from burstrl.sandbox.layercache import LayerCache

    root = Path(os.environ.get("BURSTRL_CACHE") or Path.home() / ".cache" / "burstrl")
    return LayerCache(root / "sandbox-layers", max_bytes=20 << 30)


def prepare_root(backend: Any, spec: SandboxSpec, work: Path, state: SandboxState) -> Path | None:
    """Make `work` (an empty dir) the sandbox's sized /work, seeded from the image's /work; return
    the image's merged root if it can run the daemon (has /usr/bin/python3), else None (the
    host's system dirs). The image stays pinned in the cache (`state.image`) until teardown;
    the sized dirs are in `state.sized` for `release_work`, the image's `Env` in
    `state.image_env`."""
    if spec.image is None:
        _sized(state, work, spec)
        return None
    from burstrl.sandbox.images import read_image
    from burstrl.sandbox.layercache import writable_copy

    if backend.layer_cache is None:
        backend.layer_cache = default_layer_cache()
    image = read_image(Path(spec.image))
    backend.layer_cache.pin(image)
    state.image = image
    state.image_env = dict(e.split("=", 1) for e in image.env if "=" in e)
    root = backend.layer_cache.rootfs(image)
    if not (root / "work").is_dir():
        _sized(state, work, spec)
    elif not overlay_work(root / "work", work, _sized(state, work.parent / "q", spec).path):
        release_work(state)
        _sized(state, work, spec)
        writable_copy(root, "/work", work)
    return root if os.path.lexists(root / "usr/bin/python3") else None


def _sized(state: SandboxState, path: Path, spec: SandboxSpec) -> SizedDir:
    sized = sized_dir(path, spec.workdir_mb)
    state.sized.append(sized)
    if sized.kind == "none":
        warn_once(f"/work has no size limit here ({sized.reason}): sandboxed code can fill this disk")
    return sized


def disk_report(state: SandboxState) -> tuple[str, tuple[str, ...]]:
    """How /work's size is held ("ext4-loop", "tmpfs", "none") and why not, for `LimitsReport`."""
    sized = state.sized
    kind = sized[-1].kind if sized else "none"
    return kind, tuple(f"disk: {s.reason}" for s in sized[-1:] if s.kind == "none")


def overlay_work(lower: Path, work: Path, scratch: Path) -> bool:
    """Mount the image's /work read-only below the sandbox's own upper dir (in `scratch`, the
    sized fs), at `work`.

    Why: a copy of a task repo costs its size at every sandbox start (~0.3 s for 17 MB here), an
    overlay costs one mount (~5 ms) and keeps the cached layer shared and untouched. Needs the
    right to mount (root, as in CI); False means "copy instead", warned about once. metacopy=on
    where the kernel has it: handing /work to the sandbox uid (a chown of every file) then copies
    up metadata only, not the data.
    """
    upper, ovwork = scratch / "upper", scratch / "ovwork"
    upper.mkdir()
    ovwork.mkdir()
    opts = f"lowerdir={lower},upperdir={upper},workdir={ovwork}"
    for extra in (",metacopy=on", ""):
        r = subprocess.run(["mount", "-t", "overlay", "overlay", "-o", opts + extra, str(work)],
                           capture_output=True, text=True, check=False)
        if r.returncode == 0:
            return True
    warn_once(f"cannot mount an overlay for /work ({r.stderr.strip() or r.returncode}); "
              "each sandbox copies its image's /work instead")
    return False


def release_work(state: SandboxState) -> None:
    """Unmount /work's overlay (if any), then its sized filesystems, newest first; the images go
    with them. Before the sandbox's dir is removed: rmtree must never walk a mounted fs."""
    work = state.path / "work"
    if os.path.ismount(work):
        subprocess.run(["umount", "-l", str(work)], capture_output=True, check=False)
    sized, state.sized = state.sized, []
    for one in reversed(sized):
        one.close()
