"""`burstrl fleet status`: a shared fleet's replicas and, per tenant, its versions and live sessions.

Why read the replicas with the fleet's admin token: only it sees every tenant's names as stored
(`run-a~policy-v3`, `run-a~s17`), which is what tells the tenants apart; the router's replica list
is public. The admin token is in FLEET_DIR/admin.token (mode 600), so only the fleet's owner can ask.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx

from burstrl.deadline import CallFailed, fetch, sync_client
from burstrl.launcher.shared_fleet import fleet_info
from burstrl.protocol.tenants import local, owner

MAX_BYTES = 16 << 20


def _get(http: httpx.Client, url: str, token: str = "") -> Any:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        return fetch(http, "GET", url, deadline=5.0, max_bytes=MAX_BYTES, headers=headers).check().json()
    except (CallFailed, ValueError):
        return None


def fleet_status(fleet_dir: Path) -> dict[str, Any]:
    """The router's health, each replica (URL, pool, health, load) and each tenant's versions and sessions."""
    info = fleet_info(fleet_dir)
    admin = Path(info["admin_token_file"]).read_text().strip()
    router = info["router"]
    tenants: dict[str, dict[str, Any]] = {}
    replicas = []
    with sync_client(timeout=5.0) as http:
        health = _get(http, f"{router}/health")
        for r in (_get(http, f"{router}/v1/replicas") or {}).get("replicas", []):
            models = _get(http, f"{r['url']}/v1/models", admin) or {}
            loads = _get(http, f"{r['url']}/v1/loads", admin) or {}
            names = [m["id"] for m in models.get("data", [])]
            sessions = [s["session_id"] for s in loads.get("sessions", [])]
            for name in names:
                if owner(name):
                    _tenant(tenants, owner(name))["versions"].add(local(name))
            for sid in sessions:
                if owner(sid):
                    _tenant(tenants, owner(sid))["sessions"] += 1
            replicas.append({"url": r["url"], "pool": r["pool"], "healthy": r["healthy"], "draining": r["draining"],
                             "sessions": len(sessions), "running": loads.get("num_running_reqs"),
                             "token_usage": loads.get("token_usage"), "versions": len(names)})
    return {"router": router, "router_up": health is not None, "replicas": replicas,
            "tenants": {t: {"versions": sorted(v["versions"]), "sessions": v["sessions"]}
                        for t, v in sorted(tenants.items())}}


def _tenant(tenants: dict[str, dict[str, Any]], name: str) -> dict[str, Any]:
    return tenants.setdefault(name, {"versions": set(), "sessions": 0})


def format_status(status: dict[str, Any]) -> str:
    lines = [f"router {status['router']} ({'up' if status['router_up'] else 'NOT ANSWERING'})", "replicas:"]
    for r in status["replicas"]:
        health = "draining" if r["draining"] else "healthy" if r["healthy"] else "unhealthy"
        usage = r["token_usage"]
        lines.append(f"  {r['url']}  {r['pool']}  {health}  sessions={r['sessions']} running={r['running']} "
                     f"kv={'-' if usage is None else f'{usage:.0%}'} versions={r['versions']}")
    lines.append("tenants:" if status["tenants"] else "tenants: none on the replicas")
    for name, t in status["tenants"].items():
        lines.append(f"  {name}: versions {', '.join(t['versions']) or '-'}; live sessions {t['sessions']}")
    return "\n".join(lines)
