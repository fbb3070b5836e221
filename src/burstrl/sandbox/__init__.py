"""Sandboxes: isolated places where agent rollouts run untrusted, model-written code.

This package owns the command daemon that runs inside every sandbox (`daemon`, `runtime`, and
what they import), the types it speaks (`protocol`), the harness-side clients (`client`), and,
beside them, the backends that create sandboxes, the images they boot from and the pool that
bounds and cleans them up.

Who talks to whom: the harness (a rollout runner in the orchestrator) talks to `sandboxd` inside a
sandbox over a unix socket (the default) or TCP, with the shared secret in `X-Sandbox-Token`.
The sandbox itself has no network.

Why this `__init__` imports nothing: the daemon is started as `python3 -m burstrl.sandbox.daemon`
from a read-only mount of `src/` inside images that hold only a Python 3, so everything on its
import path (this file, `burstrl/__init__`, protocol, runtime, output, files, daemon, connections,
guard, client) is standard library only and cheap to import.
"""


def __getattr__(name: str):  # lazy: `from burstrl.sandbox import open_sandbox` loads the backends only then
    if name in ("open_sandbox", "SandboxPool"):
        from burstrl.sandbox import pool

        return getattr(pool, name)
    raise AttributeError(f"module 'burstrl.sandbox' has no attribute {name!r}")
