"""The router (`burstrl route serve`): which replica serves each rollout session.

This package owns the placement of sessions on inference replicas (a new session goes to one
replica and every later call of it stays there, so that the replica's session KV cache is hit):
the placement policies (`headroom` and its baselines, in `policies`), the registry of replicas
and sessions (`registry`), the OpenAI-compatible proxy with `/v1/assign` and failover (`server`),
its capped relay of answers (`relay`), the scrapes of the replicas with their checked answers
(`scrape`, `answers`), its Prometheus text (`metrics`),
a trace-driven discrete-event simulator that compares the policies on one trace (`sim`), and a
soak of the session maps on a simulated clock (`soak`). It
talks HTTP to the replicas (proxied calls, `/v1/loads` and `/v1/models` scrapes) and to whoever
registers replicas (the launcher, later). The policies are pure functions of a snapshot of replica
state so that the server and the simulator share them.
"""
