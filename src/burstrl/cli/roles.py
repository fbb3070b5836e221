"""`burstrl serve`, `train`, `run`, `orchestrate`, `route serve|sim`, `scale`, `sandboxd`: one command per role process."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from burstrl.cli.app import (
    CONFIG_COMMAND,
    app,
    command_config,
    fail,
    keys_help,
    print_config,
    print_run_config,
    route_app,
)

if TYPE_CHECKING:
    from burstrl.config import RunConfig


@route_app.command("sim", **keys_help("RouterSimConfig in burstrl/router/sim.py"))
def route_sim(
    ctx: typer.Context,
    config: Path | None = typer.Option(None, "--config", help="Sim parameters, TOML or JSON (= a CONFIG file)."),
    policies: str = typer.Option(",".join(("kv", "headroom", "random", "round_robin", "weighted_random", "smooth_wrr",
                                          "least_sessions", "least_requests", "cache_aware")), "--policies",
                                 help="Comma-separated policies, all run on the same trace."),
    k: int = typer.Option(2, "--k", min=1, help="Replicas sampled per new session (kv, headroom)."),
    trace: Path | None = typer.Option(None, "--trace", help="Replay a Mooncake JSONL trace instead of generating one."),
    sessions: str | None = typer.Option(None, "--sessions", help="With --trace: `request` (one session per request) "
                                        "or `infer` (turns grouped from hash chains); else the generated sessions."),
    block_size: int | None = typer.Option(None, "--block-size", min=1, help="Tokens per block (default 512 with "
                                          "--trace, Mooncake's; else the config's block_size)."),
    rate_scale: float = typer.Option(1.0, "--rate-scale", help="With --trace: replay at this multiple of the rate."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the resolved sim config and exit."),
) -> None:
    """Compare placement policies in the discrete-event simulator (one trace, every policy):
    [CONFIG.toml|json ...] then --key value overrides of the sim's parameters."""

    from burstrl.router.catalog import POLICY_NAMES
    from burstrl.router.replay import TraceError, load_mooncake
    from burstrl.router.sim import RouterSimConfig, format_table, simulate

    names = [p.strip() for p in policies.split(",") if p.strip()]
    unknown = [p for p in names if p not in POLICY_NAMES]
    if unknown or not names:
        fail(f"unknown policy {', '.join(unknown) or '(none given)'}; choose from {', '.join(POLICY_NAMES)}")
    extra = []
    if sessions is not None and trace is None:
        extra += ["--sessions", sessions]  # the generated trace's session count
    if block_size is not None or trace is not None:
        extra += ["--block_size", str(block_size or 512)]
    cfg = command_config(RouterSimConfig, ctx, extra, files=[str(config)] if config is not None else [])
    if dry_run:
        return print_config(cfg)
    try:
        replay = None if trace is None else load_mooncake(trace, sessions or "request", cfg.block_size, rate_scale)
    except (OSError, UnicodeError, TraceError) as exc:
        fail(f"{exc}")
    results = simulate(cfg, names, k=k, trace=replay)
    typer.echo(json.dumps(results) if as_json else format_table(results))


@route_app.command("serve", **CONFIG_COMMAND)
def route_serve(
    ctx: typer.Context,
    port: int | None = typer.Option(None, "--port", help="Bind port (= --port in the config; 0 = any)."),
    host: str | None = typer.Option(None, "--host", help="Bind address."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the resolved config and exit."),
) -> None:
    """Run the session router in front of replicas: [CONFIG.toml ...] then --key value overrides."""
    from burstrl.config import RouteConfig

    sugar = {"--port": port, "--host": host}
    cfg = command_config(RouteConfig, ctx, [f"{key}={value}" for key, value in sugar.items() if value is not None])
    if dry_run:
        return print_config(cfg)
    from burstrl.router.registry import RouteError
    from burstrl.router.server import run_router

    try:
        run_router(cfg)
    except RouteError as exc:
        fail(exc.message)



@app.command(**CONFIG_COMMAND)
def serve(
    ctx: typer.Context,
    model: str | None = typer.Option(None, "--model", help="Model directory (= --model.path)."),
    port: int | None = typer.Option(None, "--port", help="Bind port (= --server.port)."),
    host: str | None = typer.Option(None, "--host", help="Bind address (= --server.host)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the resolved config and exit."),
) -> None:
    """Run one inference replica: [CONFIG.toml ...] then --section.key value overrides."""
    from burstrl.config import ServeConfig

    sugar = {"--model.path": model, "--server.port": port, "--server.host": host}
    cfg = command_config(ServeConfig, ctx, [f"{key}={value}" for key, value in sugar.items() if value is not None])
    if dry_run:
        return print_config(cfg)
    if cfg.model.path and not (Path(cfg.model.path).expanduser() / "config.json").is_file():
        fail(f"{cfg.model.path}: not a model directory")  # as eval says it (the hub client's traceback, before)
    from burstrl.inference.server import run_replica
    from burstrl.inference.vllm.process import VllmStartError

    try:
        run_replica(cfg)
    except VllmStartError as exc:  # no vLLM environment, a refused setting, or vLLM failed to start or prove
        fail(str(exc))


@app.command(**CONFIG_COMMAND)
def train(
    ctx: typer.Context,
    resume: bool = typer.Option(False, "--resume", help="Continue from the last committed step."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the resolved config and exit."),
) -> None:
    """GRPO on a LoRA adapter from the rollout store: [CONFIG.toml ...] then overrides."""
    import logging

    from burstrl.config import TrainConfig

    cfg = command_config(TrainConfig, ctx, [])
    if not cfg.model.path:
        fail("model.path is required (--model.path DIR)")
    if dry_run:
        return print_config(cfg)
    from burstrl.store.store import StoreError
    from burstrl.trainer.checkpoint import CheckpointError
    from burstrl.trainer.launch import run_trainer
    from burstrl.trainer.loop import TrainError

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        code = run_trainer(cfg, resume)
    except (TrainError, CheckpointError, StoreError) as exc:
        fail(str(exc))
    raise typer.Exit(code)


def run_config(ctx: typer.Context, dry_run: bool, fleet: bool = False) -> RunConfig:
    """The checked run config of `burstrl run` or (`fleet`) `burstrl fleet up`: CONFIG files (none = the
    bundled quickstart's) then overrides; an empty model.path set to the warm-started tiny model (a run's
    SWE env: the SWE warm start; a fleet: always the plain one); with --dry-run printed and exit 0; a
    preflight error exits 2."""
    from burstrl.config import RunConfig
    from burstrl.launcher.preflight import (
        QUICKSTART,
        PreflightError,
        check,
        quickstart_model,
        quickstart_model_dir,
        quickstart_swe_model,
    )

    cfg = command_config(RunConfig, ctx, [], default_files=[str(QUICKSTART)])
    if fleet and cfg.fleet.url:
        fail("fleet.url is a run's setting (the fleet to join), not a fleet's")
    if not cfg.model.path:
        typer.echo("model.path is empty: using the warm-started tiny model (made and cached on first use)", err=True)
        swe, forgetful = "swe" in cfg.orchestrator.envs, cfg.model.warm_start == "forgetful"
        if fleet:  # the replicas' model, made even for --dry-run
            cfg.model.path = str(quickstart_model())
        else:
            cfg.model.path = str(quickstart_model_dir(swe, forgetful) if dry_run else
                                 quickstart_swe_model(forgetful) if swe else quickstart_model())
    if dry_run:
        print_run_config(cfg)
        raise typer.Exit()
    try:
        check(cfg)
    except PreflightError as exc:
        fail(str(exc))
    return cfg


@app.command("run", **CONFIG_COMMAND)
def run_command(
    ctx: typer.Context,
    resume: bool = typer.Option(False, "--resume", help="Continue the run in run_dir from its last committed step."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the resolved config and exit."),
) -> None:
    """Run RL end to end (router, replicas, trainer, orchestrator); no CONFIG = the bundled quickstart."""
    cfg = run_config(ctx, dry_run)
    from burstrl.launcher.run import Launcher, LaunchError, run_launcher

    launcher = Launcher
    if cfg.fleet.url:  # a shared fleet's tenant: only the trainer and the orchestrator are the run's
        from burstrl.launcher.tenant_run import TenantLauncher as launcher
    try:
        code = run_launcher(cfg, resume, launcher)
    except LaunchError as exc:
        fail(str(exc))
    raise typer.Exit(code)


@app.command(**CONFIG_COMMAND)
def orchestrate(
    ctx: typer.Context,
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the resolved config and exit."),
) -> None:
    """Generate groups of rollouts through the router into the store: [CONFIG.toml ...] then overrides."""
    from burstrl.config import OrchestrateConfig

    cfg = command_config(OrchestrateConfig, ctx, [])
    if dry_run:
        return print_config(cfg)
    from burstrl.orchestrator.loop import run_orchestrator

    try:
        run_orchestrator(cfg)
    except ValueError as exc:  # an unknown environment
        fail(str(exc))


@app.command()
def scale(
    run_dir: Path = typer.Argument(..., help="The live run's directory."),
    replicas: int = typer.Option(..., "--replicas", min=0, help="Replicas in all (reserved ones stay; the "
                                 "on-demand pool grows or drains to match)."),
) -> None:
    """Resize a live run's inference fleet."""
    from burstrl.launcher.control import ControlError, request_scale

    try:
        answer = request_scale(run_dir, replicas)
    except ControlError as exc:
        fail(str(exc))
    if not answer.get("ok"):
        fail(answer.get("error", "refused"))
    typer.echo(f"scaling to {answer['reserved']} reserved + {answer['on_demand']} on-demand replicas")


@app.command()
def sandboxd(
    socket_path: str | None = typer.Option(None, "--socket", help="Unix socket to listen on (mode 0600)."),
    host: str = typer.Option("127.0.0.1", "--host", help="TCP bind address (with --port)."),
    port: int | None = typer.Option(None, "--port", help="TCP port instead of a socket (0 = any free port)."),
    token_file: str | None = typer.Option(None, "--token-file", help="Token file (default: env SANDBOX_TOKEN)."),
    root: str = typer.Option("/", "--root", help="File requests must resolve inside this directory."),
    work_dir: str | None = typer.Option(None, "--work-dir", help="Default cwd and base of relative paths."),
) -> None:
    """Run the sandbox command daemon (usually started inside a sandbox as python3 -m burstrl.sandbox.daemon)."""
    from burstrl.sandbox.daemon import run_sandboxd

    try:
        code = run_sandboxd(socket_path, host, port, token_file, root, work_dir)
    except (ValueError, OSError) as exc:
        fail(str(exc))
    raise typer.Exit(code)


