"""Sandbox backends: where a sandbox's processes run and how they are isolated and limited.

`namespace` (the default) uses bubblewrap; `oci` runs an OCI runtime bundle with runc, crun or
runsc (gVisor). Both start the same daemon (`burstrl.sandbox.daemon`) as the entry process from
a read-only mount of this package's source, and hand back the same `Sandbox`. The harness talks
to the daemon over a unix socket in a per-sandbox dir on the host.
"""

from __future__ import annotations

from typing import Any

from burstrl.sandbox.backends.base import LimitsReport, Sandbox, SandboxBackend, SandboxSpec

__all__ = ["LimitsReport", "Sandbox", "SandboxBackend", "SandboxSpec", "make_backend"]


def make_backend(name: str = "namespace", **kwargs: Any) -> SandboxBackend:
    """A backend by name: "namespace" or "oci" (kwargs go to its constructor)."""
    if name == "namespace":
        from burstrl.sandbox.backends.namespace import NamespaceBackend

        return NamespaceBackend(**kwargs)
    if name == "oci":
        from burstrl.sandbox.backends.oci import OciBackend

        return OciBackend(**kwargs)
    raise ValueError(f"unknown sandbox backend {name!r}; expected 'namespace' or 'oci'")
