"""What crosses process boundaries: names, headers, shapes and process hand-offs every role agrees on.

Why a package of its own: the replica, the router, the trainer, the orchestrator and the launcher
are separate processes, and what they must agree on (how a version is named, which headers carry a
session, what an error body looks like, how a shard upload is packed, how a child says it is ready)
used to live inside whichever role wrote it first, so a light process (the router, the launcher)
imported a heavy one (the replica, which pulls torch) to read a constant. Everything here is
standard library only: no torch, no FastAPI, no other burstrl package, so any role can import it.

Modules: `versions` (`base`, `policy-vN`), `http` (session headers and ids, OpenAI error and model
list shapes, body limits, bearer checks), `adapters` (the sharded-upload manifest and packing),
`process` (socket binding, the JSON ready line, starting and stopping a role's process group).
"""
