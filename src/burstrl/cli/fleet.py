"""`burstrl fleet ...`: a fleet shared by several runs (tenants): start it, see it, mint tenants' tokens.

`burstrl fleet up` runs the fleet's supervisor (launcher/shared_fleet.py) in the foreground until
SIGTERM/SIGINT; `burstrl fleet status` reads it (launcher/fleet_status.py). Why a command for tokens: a tenant token is `<tenant>.<HMAC(key, tenant)>` (`protocol.tenants`), which
any holder of the fleet's tenant key can compute; the person running the fleet gives each run
its token without ever handing out the key itself.
"""

from __future__ import annotations

from pathlib import Path

import typer

from burstrl.cli.app import CONFIG_COMMAND, fail, fleet_app


@fleet_app.command("token")
def token(
    tenant: str = typer.Argument(..., help="The tenant (run) name: 1-32 characters of [a-z0-9-]."),
    key_file: Path = typer.Option(..., "--key-file", help="File holding the fleet's tenant key "
                                  "(the replicas' server.tenant_key); not readable by others."),
) -> None:
    """Print TENANT's bearer token under the fleet's tenant key."""
    from burstrl.protocol.tenants import TenantError, tenant_token

    try:
        mode = key_file.stat().st_mode
        key = key_file.read_text().strip()
    except OSError as exc:
        fail(f"--key-file {key_file}: {exc.strerror or exc}")
    if mode & 0o077:
        fail(f"--key-file {key_file} is readable by other users (mode {mode & 0o777:o}): chmod 600 it")
    try:
        typer.echo(tenant_token(key, tenant))
    except TenantError as exc:
        fail(str(exc))


@fleet_app.command("up", **CONFIG_COMMAND)
def up(
    ctx: typer.Context,
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the resolved config and exit."),
) -> None:
    """Start a shared fleet (router + replicas with a tenant key) in --run_dir and serve until SIGTERM/SIGINT.

    The config is a run config: its model, engine, router and fleet sections apply (no CONFIG = the
    bundled quickstart's). Runs join with burstrl run --fleet.url URL --fleet.token TOKEN."""
    from burstrl.cli.roles import run_config

    cfg = run_config(ctx, dry_run, fleet=True)
    import logging

    from burstrl.launcher.run import LaunchError
    from burstrl.launcher.shared_fleet import SharedFleet

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        code = SharedFleet(cfg).run()
    except LaunchError as exc:
        fail(str(exc))
    raise typer.Exit(code)


@fleet_app.command("status")
def status(
    run_dir: Path = typer.Option(..., "--run_dir", help="The fleet's directory (burstrl fleet up --run_dir)."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of text."),
) -> None:
    """A live fleet's replicas (URL, pool, health, load) and each tenant's versions and live sessions."""
    import json

    from burstrl.launcher.fleet_status import fleet_status, format_status
    from burstrl.launcher.run import LaunchError

    try:
        answer = fleet_status(run_dir)
    except (LaunchError, OSError) as exc:
        fail(str(exc))
    typer.echo(json.dumps(answer, indent=1) if as_json else format_status(answer))
