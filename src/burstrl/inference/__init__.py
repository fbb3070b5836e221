"""Inference replica (`burstrl serve`): engine, KV cache, adapters, capture, OpenAI server.

Owns one model and its adapter versions. Talks HTTP to the router and orchestrator (OpenAI API,
`/v1/traces`, `/v1/loads`, `/metrics`) and to the trainer (adapter load and sharded upload).
Modules: runner (forward pass), kvcache (session caches, decode batch, budget), prefix (shared
prefixes, keyed by version), sampling, lora, adapters (versions, uploads), sessions (capture), chat
(token continuity), request (one call), engine (decode loop), limits and jsonscan (request sizes
checked before work), workers (parsing and tokenizing off the event loop), openai_api/api_common/
streaming/server/admin_routes (HTTP: `APIRouter`s that find the replica on `app.state`), metrics,
replica (the parts wired together). What other roles must agree on (version names, headers, the upload
manifest, the ready line) is in `burstrl.protocol`, so no other role imports this package.
"""
