"""Publishing policy versions: the versions directory (volume) and the sharded push to replicas.

Owns `policy-vN` from the moment the trainer has saved an adapter until replicas serve it:

- `volume`: the versions directory (default RUN_DIR/adapters). A version appears atomically
  (written under a temp name, fsynced, renamed) with a sha256 manifest and never changes; late
  joining replicas load the newest verified version from it at start, and `gc` trims old ones.
  Plain files only: no torch, no HTTP.
- `push`: trainer ranks send the version, packed as a tar split into one shard per rank, to every
  replica in parallel over HTTP(S) (`PUT /v1/adapters/{name}/shards/{i}`, then rank 0 `PUT`s the
  manifest and `POST`s commit). A replica that keeps failing is reported, never raised: the run
  goes on with the others and that replica catches up from the volume.
- `gc`: tells replicas to stop serving versions nobody needs (`/v1/unload_lora_adapter`; a replica
  keeps a version alive while its sessions use it).

Talks to: the trainer (caller), replicas (their admin HTTP API, bearer token) and the filesystem.
"""
