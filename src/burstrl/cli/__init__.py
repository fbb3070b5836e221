"""The `burstrl` command: one subcommand per role, each a thin shell over its package.

Why thin and lazy: `burstrl --help` and `--dry-run` must answer at once, and a role process must
not pay for imports it never uses, so torch, transformers, fastapi and even pydantic are imported
inside the commands that need them. `app.py` holds the Typer app and the helpers the command modules
share; importing a command module registers its commands (`burstrl --help` lists them in that order).
"""

import importlib

from burstrl.cli.app import app, main

for _module in ("roles", "evals", "images", "tasks", "sandbox", "fleet"):  # registers their commands, in help order
    importlib.import_module(f"burstrl.cli.{_module}")

__all__ = ["app", "main"]
