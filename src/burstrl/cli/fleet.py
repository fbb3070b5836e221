"""`burstrl fleet ...`: a fleet shared by several runs (tenants). Today: minting a tenant's token.

Why a command for it: a tenant token is `<tenant>.<HMAC(key, tenant)>` (`protocol.tenants`), which
any holder of the fleet's tenant key can compute; the person running the fleet gives each run
its token without ever handing out the key itself.
"""

from __future__ import annotations

from pathlib import Path

import typer

from burstrl.cli.app import fail, fleet_app


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
