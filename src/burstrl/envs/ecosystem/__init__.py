"""Environments written for the ecosystem's standards, run unmodified: verifiers and OpenEnv.

Why adapters and not a port: researchers write an environment once, for one standard, and pick the
trainer; a verifiers taskset or an OpenEnv server must train here as it is. Each adapter is a
burstrl `Environment` (envs.base) named "verifiers:<module>" or "openenv:<url>" in
`orchestrator.envs` (envs.registry binds the name to a subclass); underneath, every model call goes
to the router as the attempt's session (`SessionClient.sdk_http` forces the session id and the
group's version on whatever the environment's own client sends), so the replica captures exact
token ids and logprobs, the rollout is version-pinned and lands in the durable store, as for a
native environment. The standards' packages are optional extras, imported only here.
"""
