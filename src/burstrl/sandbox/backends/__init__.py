"""Sandbox backends: where a sandbox's processes run and how they are isolated and limited.

`namespace` uses bubblewrap; `oci` runs an OCI runtime bundle with runc; `runsc` is
`oci` with gVisor's runsc, whose user-space kernel stands between sandboxed code and the host's.
`auto` (the default) is the safest of them that works on this machine: runsc where it runs (as
root, on Linux), else namespace. All start the same daemon (`burstrl.sandbox.daemon`) as the
entry process from a read-only mount of this package's source, and hand back the same
`Sandbox`. The harness talks to the daemon over a unix socket on the host.
"""

from __future__ import annotations

import functools
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from burstrl.sandbox.backends.base import LimitsReport, Sandbox, SandboxBackend, SandboxSpec

__all__ = ["BACKENDS", "LimitsReport", "Sandbox", "SandboxBackend", "SandboxSpec", "make_backend", "safest_backend"]

BACKENDS = ("auto", "namespace", "oci", "runsc")


@functools.cache
def safest_backend() -> str:
    """"runsc" if gVisor runs a trivial bundle here (probed once per process, ~0.3 s), else
    "namespace". runsc needs root here; an ordinary user gets namespace."""
    if os.geteuid() != 0 or shutil.which("runsc") is None:
        return "namespace"
    from burstrl.sandbox.backends.oci import runtime_works

    probe = Path(tempfile.mkdtemp(prefix="sbxprobe", dir="/tmp"))
    try:
        ok, _ = runtime_works("runsc", probe)
    finally:
        shutil.rmtree(probe, ignore_errors=True)
    return "runsc" if ok else "namespace"


def make_backend(name: str = "auto", **kwargs: Any) -> SandboxBackend:
    """A backend by name, one of `BACKENDS` (kwargs go to its constructor)."""
    if name == "auto":
        name = safest_backend()
    if name == "namespace":
        from burstrl.sandbox.backends.namespace import NamespaceBackend

        return NamespaceBackend(**kwargs)
    if name in ("oci", "runsc"):
        from burstrl.sandbox.backends.oci import OciBackend

        if name == "runsc":
            kwargs["runtime"] = "runsc"
        return OciBackend(**kwargs)
    raise ValueError(f"unknown sandbox backend {name!r}; expected one of {', '.join(BACKENDS)}")
