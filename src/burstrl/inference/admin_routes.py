"""Admin endpoints of a replica: adapter versions (vLLM shapes) and sharded uploads.

All need the admin token, or with tenancy (`server.tenant_key`) a tenant token, which reaches its
own namespace only (`inference.tenancy`): the name in the route is the tenant's, stored as
`<tenant>~<name>`, so another tenant's versions are never reachable (404, never data). A tenant
pushes versions as uploads (shards, manifest, commit); loading from a host path
(`/v1/load_lora_adapter`) stays the admin's, since a path names the host's files, not the tenant's.
Loading is synchronous: when the call returns 200 the version serves new
sessions; an adapter or upload that fails any check returns 4xx and is never served. File work
(validating, hashing, sweeping abandoned uploads) runs off the event loop so generation never stalls.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request

from burstrl.inference import tenancy
from burstrl.inference.api_common import ApiError, read_json, read_limited, replica_of
from burstrl.inference.lora import AdapterError
from burstrl.inference.replica import InferenceReplica
from burstrl.protocol.adapters import UploadError

router = APIRouter()


def _refused(rep: InferenceReplica, status: int, exc: Exception | str) -> ApiError:
    """An adapter or upload that failed a check: counted, and answered with `status`."""
    rep.counters.uploads_refused += 1
    return ApiError(status, str(exc))


async def _field(rep: InferenceReplica, request: Request, name: str) -> str:
    data = await read_json(request, rep.cfg.server.max_body_bytes)
    value = data.get(name) if isinstance(data, dict) else None
    if not isinstance(value, str) or not value:
        raise ApiError(400, f"'{name}' (a non-empty string) is required")
    return value


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(request: Request) -> dict[str, Any]:
    rep = replica_of(request)
    if tenancy.owning(rep, request).tenant is not None:
        raise ApiError(403, "a tenant pushes versions as uploads (PUT /v1/adapters/{name}/shards/{i}, "
                            "/manifest, POST /commit): lora_path names the host's files", "permission_error")
    data = await read_json(request, rep.cfg.server.max_body_bytes)
    if not isinstance(data, dict) or not all(isinstance(data.get(k), str) for k in ("lora_name", "lora_path")):
        raise ApiError(400, "'lora_name' and 'lora_path' (strings) are required")
    if not _is_dir(data["lora_path"]):
        raise _refused(rep, 400, ValueError(f"lora_path {data['lora_path']!r} is not a directory"))
    try:
        await asyncio.to_thread(rep.registry.load, data["lora_name"], data["lora_path"])
    except AdapterError as exc:
        raise _refused(rep, 400, exc) from None
    rep.counters.adapters_loaded += 1
    return {"status": "loaded", "lora_name": data["lora_name"]}


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(request: Request) -> dict[str, Any]:
    rep = replica_of(request)
    caller = tenancy.owning(rep, request)
    name = await _field(rep, request, "lora_name")
    try:
        state = rep.registry.unload(caller.name(name), rep.sessions.versions_in_use())
    except KeyError:
        raise ApiError(404, f"adapter {name!r} is not loaded") from None
    return {"status": state, "lora_name": name}


@router.put("/v1/adapters/{name}/shards/{index}")
async def put_shard(name: str, index: int, request: Request, of: int) -> dict[str, Any]:
    rep = replica_of(request)
    caller = tenancy.owning(rep, request)
    data = await read_limited(request, rep.cfg.server.max_shard_bytes)
    try:
        # off the event loop: hashing and writing a large shard must not stall generation
        await asyncio.to_thread(rep.registry.put_shard, caller.name(name), index, of, data,
                                request.headers.get("x-shard-sha256"))
    except UploadError as exc:
        raise _refused(rep, 400, caller.say(str(exc))) from None
    return {"name": name, "shard": index, "of": of, "bytes": len(data)}


@router.get("/v1/adapters/bulk")
async def bulk_listener(request: Request) -> dict[str, Any]:
    """Where to send shards in bulk (`inference.bulk`): the port on this host, or null if off."""
    rep = replica_of(request)
    tenancy.owning(rep, request)
    if rep.bulk is None:
        return {"port": None, "tls": False}
    return {"port": rep.bulk.port, "tls": rep.bulk.tls}


@router.put("/v1/adapters/{name}/manifest")
async def put_manifest(name: str, request: Request) -> dict[str, Any]:
    rep = replica_of(request)
    caller = tenancy.owning(rep, request)
    data = await read_json(request, rep.cfg.server.max_body_bytes)
    try:
        manifest = await asyncio.to_thread(rep.registry.put_manifest, caller.name(name), data)
    except UploadError as exc:
        raise _refused(rep, 400, caller.say(str(exc))) from None
    return {"name": name, "num_shards": manifest.num_shards}


@router.post("/v1/adapters/{name}/commit")
async def commit(name: str, request: Request) -> dict[str, Any]:
    rep = replica_of(request)
    caller = tenancy.owning(rep, request)
    try:
        await asyncio.to_thread(rep.registry.commit, caller.name(name))
    except (UploadError, AdapterError) as exc:
        raise _refused(rep, 422, caller.say(str(exc))) from None
    rep.counters.adapters_loaded += 1
    return {"status": "loaded", "lora_name": name}


def _is_dir(path: str) -> bool:
    """Whether `path` names a directory; a name the OS refuses (too long, NUL byte) is not one."""
    try:
        return Path(path).is_dir()
    except (OSError, ValueError):
        return False
