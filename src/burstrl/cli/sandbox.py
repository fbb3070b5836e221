"""`burstrl sandbox sim|node`: the sandbox cluster simulator and the node agent."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from burstrl.cli.app import (
    command_config,
    fail,
    keys_help,
    print_config,
    sandbox_app,
)


@sandbox_app.command("sim", **keys_help("SimConfig in burstrl/sandbox/sim.py, its `workload` in burstrl/sandbox/simload.py"))
def sandbox_sim(
    ctx: typer.Context,
    policies: str = typer.Option("reference,image_affinity,ours", "--policies", help="Comma-separated policies."),
    seeds: str = typer.Option("0,1,2", "--seeds", help="Comma-separated seeds (the same trace per seed)."),
    sweep: str | None = typer.Option(None, "--sweep", help="LO:HI:STEP loads per node: find each policy's "
                                     "max density at 0 evictions and 0 OOM, then compare at the reference's."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the resolved sim config and exit."),
) -> None:
    """Simulate sandbox placement on a cluster (1 s ticks, generated rollouts); print a JSON report.
    [CONFIG.toml|json ...] then --key value overrides (`--nodes 4 --duration_s 600 --workload.zipf 1.1`)."""

    from burstrl.sandbox.placement import POLICY_NAMES
    from burstrl.sandbox.sim import SimConfig, compare, run_seeds

    names = [p.strip() for p in policies.split(",") if p.strip()]
    unknown = [p for p in names if p not in POLICY_NAMES]
    if unknown or not names:
        fail(f"unknown policy {', '.join(unknown) or '(none given)'}; choose from {', '.join(POLICY_NAMES)}")
    try:
        seed_list = [int(x) for x in seeds.split(",") if x.strip()]
    except ValueError:
        fail(f"--seeds {seeds!r}: expected comma-separated integers, e.g. 0,1,2")
    if not seed_list:
        fail("--seeds: give at least one seed")
    try:
        loads = _sweep_loads(sweep) if sweep else None
    except ValueError as exc:
        fail(f"{exc}")
    cfg = command_config(SimConfig, ctx, [])
    if dry_run:
        return print_config(cfg)
    if loads is not None:
        report = compare(cfg, {name: {} for name in names}, seed_list, loads)
    else:
        report = {name: run_seeds(cfg, name, {}, seed_list) for name in names}
    typer.echo(json.dumps(report, indent=1))


@sandbox_app.command("node")
def sandbox_node(
    host: str = typer.Option("127.0.0.1", "--host", help="Address to serve on; sandboxes' ports bind here too."),
    port: int = typer.Option(0, "--port", help="Port (0 = any free port; the ready line says which)."),
    backend: str = typer.Option("auto", "--backend", help="namespace, oci, runsc or auto."),
    state_dir: Path | None = typer.Option(None, "--state-dir", help="Sandbox dirs (short: socket paths <= 107 bytes)."),
    layer_cache: Path | None = typer.Option(None, "--layer-cache", help="The node's layer cache dir."),
    cache_gb: float = typer.Option(20.0, "--cache-gb", help="Layer cache size, GB."),
    name: str | None = typer.Option(None, "--name", help="Node name in reports (default: the hostname)."),
    token_file: str | None = typer.Option(None, "--token-file", help="Bearer token file (else env BURSTRL_NODE_TOKEN)."),
    cpus: float | None = typer.Option(None, "--cpus", help="Allocatable vCPU (default: the CPUs this process may use)."),
    memory_mb: int | None = typer.Option(None, "--memory-mb", help="Allocatable memory (default: MemTotal)."),
    max_sandboxes: int | None = typer.Option(None, "--max-sandboxes", help="At most this many at once."),
    sample_s: float = typer.Option(1.0, "--sample-s", help="Seconds between usage samples."),
    sweep_glob: str | None = typer.Option(None, "--sweep-glob", help="Other agents' state dirs (a glob): "
                                          "those whose agent is gone are swept at start (sandboxes, mounts, dirs)."),
    tenant_key_file: str | None = typer.Option(None, "--tenant-key-file", help="The fleet's tenant key (a mode-600 "
                                               "file): tenant tokens act for their tenant, on its sandboxes only."),
    tenant_max_sandboxes: int | None = typer.Option(None, "--tenant-max-sandboxes", help="Live sandboxes per tenant "
                                                    "(beyond: 429)."),
    tenant_caps: str | None = typer.Option(None, "--tenant-caps", help="Per-tenant caps over the default: a=2,b=8."),
    tenant_weights: str | None = typer.Option(None, "--tenant-weights", help="Fair-share weights of the "
                                              "--max-sandboxes slots among active tenants: a=2,b=1 (unlisted: 1)."),
    tenant_active_s: float = typer.Option(30.0, "--tenant-active-s", help="A tenant that asked for a sandbox "
                                          "within this long keeps its fair share."),
) -> None:
    """Run the agent of one sandbox node: create/close sandboxes, report usage and cached layers (HTTP)."""
    import os
    import socket

    from burstrl.sandbox.layercache import LayerCache
    from burstrl.sandbox.node import NodeAgent, read_token, serve
    from burstrl.sandbox.nodeusage import node_allocatable

    try:
        token = read_token(token_file)
    except (ValueError, OSError) as exc:
        fail(str(exc))
    if cpus is not None and cpus <= 0 or memory_mb is not None and memory_mb <= 0 or sample_s <= 0:
        fail("--cpus, --memory-mb and --sample-s must be positive")
    cache_root = layer_cache or Path(os.environ.get("BURSTRL_CACHE") or Path.home() / ".cache" / "burstrl") / "sandbox-layers"
    cache = LayerCache(cache_root, max_bytes=int(cache_gb * 1e9))
    alloc = node_allocatable(cpus, memory_mb << 20 if memory_mb else None)
    state = state_dir or Path("/tmp") / f"burstrl-node-{os.getuid()}"
    from burstrl.sandbox.node_shares import parse_weights
    from burstrl.sandbox.node_tenants import NodeTenancy, parse_caps, read_tenant_key

    try:
        tenancy = NodeTenancy(read_tenant_key(tenant_key_file) if tenant_key_file else "", tenant_max_sandboxes,
                              parse_caps(tenant_caps), parse_weights(tenant_weights), tenant_active_s)
    except (ValueError, OSError) as exc:
        fail(str(exc))
    if (tenant_max_sandboxes is not None or tenant_caps or tenant_weights) and not tenancy.key:
        fail("--tenant-max-sandboxes, --tenant-caps and --tenant-weights need --tenant-key-file")
    if tenant_active_s <= 0:
        fail("--tenant-active-s must be positive")
    try:
        agent = NodeAgent(name or socket.gethostname(), backend, state, cache, host, alloc, max_sandboxes, sample_s,
                          sweep_glob, tenancy)
    except ValueError as exc:  # a state dir it refuses, an unknown backend: named, not a traceback
        fail(str(exc))
    serve(agent, host, port, token)


def _sweep_loads(spec: str) -> list[float]:
    """'LO:HI:STEP' -> [LO, LO+STEP, ..., <= HI]."""
    parts = spec.split(":")
    if len(parts) != 3:
        raise ValueError(f"--sweep {spec!r}: expected LO:HI:STEP, e.g. 20:40:2")
    lo, hi, step = (float(x) for x in parts)
    if not (0 < lo <= hi and step > 0):
        raise ValueError(f"--sweep {spec!r}: need 0 < LO <= HI and STEP > 0")
    return [lo + i * step for i in range(int((hi - lo) / step + 1e-9) + 1)]


