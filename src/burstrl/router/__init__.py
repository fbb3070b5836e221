"""The router: which replica serves each rollout session.

This package owns the placement of sessions on inference replicas (a new session goes to one
replica and every later call of it stays there, so that the replica's session KV cache is hit),
the placement policies (`headroom` and its baselines, in `policies`), and a trace-driven
discrete-event simulator that compares them on one trace (`sim`). The OpenAI-compatible proxy
server, the replica registry and failover are built on top of `policies` later; the policies are
pure functions of a snapshot of replica state so that the server and the simulator share them.
"""
