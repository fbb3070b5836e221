"""The `burstrl` command: one subcommand per role, each a thin shell over its package.

Why thin and lazy: `burstrl --help` and `--dry-run` must answer at once, and a role process must
not pay for imports it never uses, so torch, transformers, fastapi and even pydantic are imported
inside the commands that need them.
"""

from __future__ import annotations

import sys
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

OVERRIDES_HELP = (
    "Any config key can be set with --section.key value (or --section.key=value), "
    "e.g. --engine.max_total_num_tokens 4096; unknown keys are errors."
)
CONFIG_COMMAND = {  # commands that take config files then dotted overrides
    "context_settings": {"allow_extra_args": True, "ignore_unknown_options": True},
    "epilog": OVERRIDES_HELP,
    "options_metavar": "[CONFIG.toml ...] [OPTIONS] [--section.key VALUE ...]",
}


def _keys_help(where: str) -> dict:
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
        _fail(str(exc))
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
        _fail(str(exc))


@route_app.command("sim", **_keys_help("RouterSimConfig in burstrl/router/sim.py"))
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
    import json

    from burstrl.router.catalog import POLICY_NAMES
    from burstrl.router.replay import TraceError, load_mooncake
    from burstrl.router.sim import RouterSimConfig, format_table, simulate

    names = [p.strip() for p in policies.split(",") if p.strip()]
    unknown = [p for p in names if p not in POLICY_NAMES]
    if unknown or not names:
        _fail(f"unknown policy {', '.join(unknown) or '(none given)'}; choose from {', '.join(POLICY_NAMES)}")
    extra = []
    if sessions is not None and trace is None:
        extra += ["--sessions", sessions]  # the generated trace's session count
    if block_size is not None or trace is not None:
        extra += ["--block_size", str(block_size or 512)]
    cfg = _config(RouterSimConfig, ctx, extra, files=[str(config)] if config is not None else [])
    if dry_run:
        return _print_config(cfg)
    try:
        replay = None if trace is None else load_mooncake(trace, sessions or "request", cfg.block_size, rate_scale)
    except (OSError, UnicodeError, TraceError) as exc:
        _fail(f"{exc}")
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
    cfg = _config(RouteConfig, ctx, [f"{key}={value}" for key, value in sugar.items() if value is not None])
    if dry_run:
        return _print_config(cfg)
    from burstrl.router.registry import RouteError
    from burstrl.router.server import run_router

    try:
        run_router(cfg)
    except RouteError as exc:
        _fail(exc.message)


@image_app.command("build")
def image_build(
    src: Path = typer.Argument(..., help="Directory whose tree becomes the new layer."),
    out: Path = typer.Option(..., "--out", help="OCI layout directory to write (must be missing or empty)."),
    base: Path | None = typer.Option(None, "--base", help="OCI layout whose layers go underneath."),
    dest: str = typer.Option("/work", "--dest", help="Where SRC's tree sits inside the image."),
    compression: str = typer.Option("zstd", "--compression", help="Layer compression: zstd or gzip."),
    tag: str = typer.Option("latest", "--tag", help="Tag of the image in OUT's index."),
    force: bool = typer.Option(False, "--force", help="Replace a non-empty OUT."),
) -> None:
    """Build an image: BASE's layers + one layer of SRC at DEST; print the manifest digest."""
    from burstrl.sandbox.images import ImageError, build_image

    if compression not in ("zstd", "gzip"):
        _fail(f"unknown compression {compression!r}; choose zstd or gzip")
    try:
        ref = build_image(src, out, base=base, dest=dest, compression=compression, tag=tag, force=force)
    except (ImageError, OSError) as exc:
        _fail(str(exc))
    typer.echo(ref.manifest_digest)


@image_app.command("inspect")
def image_inspect(
    layout: Path = typer.Argument(..., help="OCI layout directory."),
    tag: str = typer.Option("latest", "--tag", help="Which image of the layout."),
    verify: bool = typer.Option(True, "--verify/--no-verify", help="Hash every layer blob too."),
) -> None:
    """Print an image's manifest digest, config and layers as JSON (every blob checked)."""
    import json

    from burstrl.sandbox.images import ImageError, describe, read_image, verify_image

    try:
        image = read_image(layout, tag)
        if verify:
            verify_image(image)
    except (ImageError, OSError) as exc:
        _fail(str(exc))
    typer.echo(json.dumps(describe(image), indent=2))


@image_app.command("pull")
def image_pull(
    ref: str = typer.Argument(..., help="Image reference: [REGISTRY/]NAME[:TAG][@sha256:DIGEST]."),
    out: Path = typer.Option(..., "--out", help="OCI layout directory to write (must be missing or empty)."),
    insecure: bool = typer.Option(False, "--insecure", help="Plain HTTP (a registry without TLS, e.g. on loopback)."),
    platform: str = typer.Option("linux/amd64", "--platform", help="os/arch[/variant] picked from a manifest list."),
    force: bool = typer.Option(False, "--force", help="Replace a non-empty OUT."),
) -> None:
    """Pull an image from a registry into OUT, layers recompressed to zstd; print the manifest digest.

    Credentials, where the registry wants them: BURSTRL_REGISTRY_USER and BURSTRL_REGISTRY_PASSWORD."""
    import os

    from burstrl.sandbox.archive import stderr_progress
    from burstrl.sandbox.images import ImageError
    from burstrl.sandbox.registry import pull

    user, password = os.environ.get("BURSTRL_REGISTRY_USER"), os.environ.get("BURSTRL_REGISTRY_PASSWORD")
    try:
        ref_out = pull(ref, out, insecure=insecure, platform=platform, force=force,
                       auth=(user, password or "") if user else None, progress=stderr_progress())
    except (ImageError, OSError) as exc:
        _fail(str(exc))
    typer.echo(ref_out.manifest_digest)


@image_app.command("import")
def image_import(
    archive: Path = typer.Argument(..., help="A `docker save` tarball or an OCI archive (tar, or tar.gz)."),
    out: Path = typer.Option(..., "--out", help="OCI layout directory to write (must be missing or empty)."),
    tag: str | None = typer.Option(None, "--tag", help="Which image of a multi-image archive (NAME:TAG)."),
    platform: str = typer.Option("linux/amd64", "--platform", help="os/arch[/variant] picked from an index."),
    force: bool = typer.Option(False, "--force", help="Replace a non-empty OUT."),
) -> None:
    """Import an image archive into OUT, layers recompressed to zstd; print the manifest digest."""
    from burstrl.sandbox.archive import import_archive, stderr_progress
    from burstrl.sandbox.images import ImageError

    try:
        ref_out = import_archive(archive, out, tag=tag, platform=platform, force=force,
                                 progress=stderr_progress())
    except (ImageError, OSError) as exc:
        _fail(str(exc))
    typer.echo(ref_out.manifest_digest)


@image_app.command("base")
def image_base(
    out: Path = typer.Option(..., "--out", help="OCI layout directory to write (must be missing or empty)."),
    package: list[str] = typer.Option(["pytest"], "--package",
                                      help="Pure-Python distribution installed here to copy in, with its "
                                           "requirements (repeatable)."),
    force: bool = typer.Option(False, "--force", help="Replace a non-empty OUT."),
) -> None:
    """Build, offline, a base image with Python + pytest + git from this host's files; print its digest."""
    from burstrl.sandbox.baseimage import build_base_image
    from burstrl.sandbox.images import ImageError

    try:
        ref_out = build_base_image(out, tuple(package), force=force)
    except (ImageError, OSError, RuntimeError) as exc:
        _fail(str(exc))
    typer.echo(ref_out.manifest_digest)


@tasks_app.command("make-toy")
def tasks_make_toy(
    out: Path = typer.Argument(..., help="Directory to write: OUT/tasks.jsonl and OUT/repos/ID (missing or empty)."),
    n: int = typer.Option(50, "--n", min=1, help="Number of tasks."),
    seed: int = typer.Option(0, "--seed", help="Seed; with index, difficulty and split it fixes each task."),
    difficulty: int = typer.Option(1, "--difficulty", min=0, max=4,
                                   help="0: one bug, the fix stated; 1: one bug; 2: one bug behind a wrapper; "
                                   "3: two; 4: three, two calls deep."),
    split: str = typer.Option("train", "--split", help="train or test (held out: other templates and names)."),
    force: bool = typer.Option(False, "--force", help="Write into a non-empty OUT."),
) -> None:
    """Generate toy Python repositories with injected bugs, and their task file."""
    from burstrl.envs.swe.toygen import make_toy_tasks

    if split not in ("train", "test"):
        _fail(f"--split must be train or test, not {split!r}")
    if out.exists() and any(out.iterdir()) and not force:
        _fail(f"{out} is not empty (use --force)")
    tasks = make_toy_tasks(out, n, seed=seed, difficulty=difficulty, split=split)
    typer.echo(f"{len(tasks)} tasks -> {out / 'tasks.jsonl'}")


@tasks_app.command("check")
def tasks_check(
    file: Path = typer.Argument(..., help="Task file (JSONL)."),
    workdir: Path | None = typer.Option(None, "--workdir", help="Where exports go (default: a temp dir, removed)."),
    host: bool = typer.Option(False, "--host", help="Run the tests on the host instead of in sandboxes."),
    jobs: int = typer.Option(1, "--jobs", min=1, help="Tasks checked at once."),
    flawed_out: Path | None = typer.Option(None, "--flawed-out", help="Write the flawed task ids here, one a line."),
) -> None:
    """Check that target tests fail at the base and pass with the gold patch, and existing tests pass
    both ways; print a table and exit 1 if any task is flawed."""
    import tempfile

    from burstrl.envs.swe.check import check_tasks, format_results
    from burstrl.envs.swe.task import TaskError, load_tasks

    try:
        tasks = load_tasks(file)
    except (OSError, TaskError) as exc:
        _fail(str(exc))
    with tempfile.TemporaryDirectory(prefix="burstrl-check-") as tmp:
        results = check_tasks(tasks, workdir or Path(tmp), sandbox=not host, jobs=jobs)
    typer.echo(format_results(results))
    if flawed_out is not None:
        flawed_out.write_text("".join(f"{r.instance_id}\n" for r in results if not r.ok))
    if not all(r.ok for r in results):
        raise typer.Exit(1)


@tasks_app.command("import")
def tasks_import(
    src: Path = typer.Argument(..., help="SWE-bench-format task file (JSONL, fields as published)."),
    repos: Path = typer.Option(..., "--repos", help="Mirror dir: clones, bare mirrors or bundles named "
                               "owner__name, owner/name or name (with .git / .bundle)."),
    out: Path = typer.Option(..., "--out", help="Task file to write (JSONL): only tasks that can run."),
    images: Path | None = typer.Option(None, "--images", help="Dir of OCI layouts named after the instance "
                                       "(sweb.eval.x86_64.<id>, or the id)."),
    test_cmd: str | None = typer.Option(None, "--test-cmd", help="Test command for every task (default: pytest)."),
    strict: bool = typer.Option(True, "--strict/--keep-going", help="Exit 1 if any task was refused."),
) -> None:
    """Import SWE-bench tasks: resolve each repo in the mirror, check its base commit, find its image,
    and refuse (with the reason) every task whose tests have nowhere to run."""
    from burstrl.envs.swe.swebench import import_tasks
    from burstrl.envs.swe.task import TaskError

    try:
        report = import_tasks(src, out, repos, images, test_cmd)
    except (OSError, TaskError) as exc:
        _fail(str(exc))
    typer.echo(report.summary())
    typer.echo(f"-> {out}")
    if report.refused and strict:
        raise typer.Exit(1)


@app.command("sft", **_keys_help("SftConfig in burstrl/config/commands.py"))
def sft_command(
    ctx: typer.Context,
    lora: bool = typer.Option(False, "--lora", help="Train a LoRA adapter (= --lora true)."),
    force: bool = typer.Option(False, "--force", help="Replace a non-empty OUT (= --force true)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the resolved config and exit."),
) -> None:
    """Supervised fine-tuning on chat demonstrations (loss on assistant replies only):
    [CONFIG.toml ...] then --model DIR --data FILE --out DIR [--steps N --lr X --batch-size N ...]."""
    from burstrl.config import SftConfig

    flags = {"--lora": lora, "--force": force}
    cfg = _config(SftConfig, ctx, [f"{key}=true" for key, on in flags.items() if on])
    if dry_run:
        return _print_config(cfg)
    if not Path(cfg.model).is_dir():
        _fail(f"{cfg.model}: no such model directory")
    from burstrl.trainer.sft import SFTDataError, sft

    try:
        sft(cfg.model, cfg.data, cfg.out, steps=cfg.steps, epochs=cfg.epochs or None, lr=cfg.lr,
            batch_size=cfg.batch_size, lora=cfg.lora, seed=cfg.seed, log_every=cfg.log_every, device=cfg.device,
            force=cfg.force)
    except (SFTDataError, FileExistsError) as exc:
        _fail(str(exc))


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
    cfg = _config(ServeConfig, ctx, [f"{key}={value}" for key, value in sugar.items() if value is not None])
    if dry_run:
        return _print_config(cfg)
    from burstrl.inference.server import run_replica

    run_replica(cfg)


@app.command(**CONFIG_COMMAND)
def train(
    ctx: typer.Context,
    resume: bool = typer.Option(False, "--resume", help="Continue from the last committed step."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the resolved config and exit."),
) -> None:
    """GRPO on a LoRA adapter from the rollout store: [CONFIG.toml ...] then overrides."""
    import logging

    from burstrl.config import TrainConfig

    cfg = _config(TrainConfig, ctx, [])
    if not cfg.model.path:
        _fail("model.path is required (--model.path DIR)")
    if dry_run:
        return _print_config(cfg)
    from burstrl.store.store import StoreError
    from burstrl.trainer.checkpoint import CheckpointError
    from burstrl.trainer.launch import run_trainer
    from burstrl.trainer.loop import TrainError

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        code = run_trainer(cfg, resume)
    except (TrainError, CheckpointError, StoreError) as exc:
        _fail(str(exc))
    raise typer.Exit(code)


@app.command("run", **CONFIG_COMMAND)
def run_command(
    ctx: typer.Context,
    resume: bool = typer.Option(False, "--resume", help="Continue the run in run_dir from its last committed step."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the resolved config and exit."),
) -> None:
    """Run RL end to end (router, replicas, trainer, orchestrator); no CONFIG = the bundled quickstart."""
    from burstrl.config import RunConfig
    from burstrl.launcher.preflight import (
        QUICKSTART,
        PreflightError,
        check,
        quickstart_model,
        quickstart_model_dir,
        quickstart_swe_model,
    )

    cfg = _config(RunConfig, ctx, [], default_files=[str(QUICKSTART)])
    if not cfg.model.path:
        typer.echo("model.path is empty: using the warm-started tiny model (made and cached on first use)", err=True)
        swe = "swe" in cfg.orchestrator.envs
        cfg.model.path = str(quickstart_model_dir(swe) if dry_run else quickstart_swe_model() if swe else quickstart_model())
    if dry_run:
        return _print_run_config(cfg)
    try:
        check(cfg)
    except PreflightError as exc:
        _fail(str(exc))
    from burstrl.launcher.run import LaunchError, run_launcher

    try:
        code = run_launcher(cfg, resume)
    except LaunchError as exc:
        _fail(str(exc))
    raise typer.Exit(code)


@app.command(**CONFIG_COMMAND)
def orchestrate(
    ctx: typer.Context,
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the resolved config and exit."),
) -> None:
    """Generate groups of rollouts through the router into the store: [CONFIG.toml ...] then overrides."""
    from burstrl.config import OrchestrateConfig

    cfg = _config(OrchestrateConfig, ctx, [])
    if dry_run:
        return _print_config(cfg)
    from burstrl.orchestrator.loop import run_orchestrator

    try:
        run_orchestrator(cfg)
    except ValueError as exc:  # an unknown environment
        _fail(str(exc))


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
        _fail(str(exc))
    if not answer.get("ok"):
        _fail(answer.get("error", "refused"))
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
        _fail(str(exc))
    raise typer.Exit(code)


sandbox_app = typer.Typer(help="Sandbox cluster: placement policies and their simulator.", no_args_is_help=True)
app.add_typer(sandbox_app, name="sandbox")


@sandbox_app.command("sim")
def sandbox_sim(
    policies: str = typer.Option("reference,image_affinity,ours", "--policies", help="Comma-separated policies."),
    nodes: int = typer.Option(8, "--nodes", help="Sandbox nodes (16 vCPU, 64 GiB each)."),
    seeds: str = typer.Option("0,1,2", "--seeds", help="Comma-separated seeds (the same trace per seed)."),
    duration: int = typer.Option(3600, "--duration", help="Simulated seconds."),
    warmup: int = typer.Option(900, "--warmup", help="Seconds before figures count (caches fill)."),
    concurrency: float = typer.Option(26.0, "--concurrency", help="Rollouts wanting to run, per node."),
    sweep: str | None = typer.Option(None, "--sweep", help="LO:HI:STEP loads per node: find each policy's "
                                     "max density at 0 evictions and 0 OOM, then compare at the reference's."),
    codec: str = typer.Option("zstd", "--codec", help="Layer compression: zstd or gzip."),
    pull_mbps: float = typer.Option(300.0, "--pull-mbps", help="Registry pull rate, MB/s."),
    zstd_mbps: float = typer.Option(800.0, "--zstd-mbps", help="zstd unpack rate, MB/s of compressed input."),
    gzip_mbps: float = typer.Option(120.0, "--gzip-mbps", help="gzip unpack rate, MB/s of compressed input."),
    cache_gb: float = typer.Option(70.0, "--cache-gb", help="Layer cache per node, GB."),
) -> None:
    """Simulate sandbox placement on a cluster (1 s ticks, generated rollouts); print a JSON report."""
    import json

    from burstrl.sandbox.placement import POLICY_NAMES
    from burstrl.sandbox.sim import SimConfig, compare, run_seeds

    names = [p.strip() for p in policies.split(",") if p.strip()]
    unknown = [p for p in names if p not in POLICY_NAMES]
    if unknown or not names:
        _fail(f"unknown policy {', '.join(unknown) or '(none given)'}; choose from {', '.join(POLICY_NAMES)}")
    try:
        seed_list = [int(x) for x in seeds.split(",") if x.strip()]
    except ValueError:
        _fail(f"--seeds {seeds!r}: expected comma-separated integers, e.g. 0,1,2")
    try:
        loads = _sweep_loads(sweep) if sweep else None
        cfg = SimConfig(nodes=nodes, duration_s=duration, warmup_s=warmup, concurrency=concurrency, codec=codec,
                        pull_mbps=pull_mbps, zstd_mbps=zstd_mbps, gzip_mbps=gzip_mbps, cache_gb=cache_gb)
        cfg.validate()
    except ValueError as exc:
        _fail(f"{exc}")
    if not seed_list:
        _fail("--seeds: give at least one seed")
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
        _fail(str(exc))
    if cpus is not None and cpus <= 0 or memory_mb is not None and memory_mb <= 0 or sample_s <= 0:
        _fail("--cpus, --memory-mb and --sample-s must be positive")
    cache_root = layer_cache or Path(os.environ.get("BURSTRL_CACHE") or Path.home() / ".cache" / "burstrl") / "sandbox-layers"
    cache = LayerCache(cache_root, max_bytes=int(cache_gb * 1e9))
    alloc = node_allocatable(cpus, memory_mb << 20 if memory_mb else None)
    agent = NodeAgent(name or socket.gethostname(), backend, state_dir or Path("/tmp") / f"burstrl-node-{os.getuid()}",
                      cache, host, alloc, max_sandboxes, sample_s)
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


@app.command("eval", **_keys_help("EvalConfig in burstrl/config/commands.py"))
def eval_command(
    ctx: typer.Context,
    env_option: list[str] = typer.Option([], "--env-option", help="KEY=VALUE of the env's section (= --ENV.KEY "
                                         "VALUE), e.g. reward=f2p for swe (repeatable)."),
    exclude: list[str] = typer.Option([], "--exclude", help="File of flawed task ids to drop (repeatable)."),
    concurrency: int | None = typer.Option(None, "--concurrency", help="= --max-sandboxes."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the resolved config and exit."),
) -> None:
    """Pass@k (and for SWE target-test and strict scores) of a model, adapter or a run's checkpoints:
    [CONFIG.toml ...] then --model DIR [--env swe --tasks FILE | --env toy --n N] [--attempts K ...]."""
    import json

    from burstrl.config import EvalConfig

    sugar = [f"--exclude={json.dumps(exclude)}"] if exclude else []
    sugar += [f"--max_sandboxes={concurrency}"] if concurrency is not None else []
    options = [item.partition("=") for item in env_option]
    for item, (key, eq, _) in zip(env_option, options, strict=False):
        if not eq or not key.strip():
            _fail(f"--env-option {item!r}: expected KEY=VALUE")
    cfg = _config(EvalConfig, ctx, sugar)
    if options:  # the env's section is known once the config names the env (module:Class: `options`)
        section = "options" if ":" in cfg.env else cfg.env
        sections = [f"--{section}.{key.strip()}={value}" for key, _, value in options]
        cfg = _config(EvalConfig, ctx, sugar + sections, prefix="--env-option: ")
    if dry_run:
        return _print_config(cfg)
    _evaluate(cfg)


def _evaluate(cfg) -> None:
    """`burstrl eval` once its config is resolved: argument checks first, then the replica."""
    from burstrl.envs import check_env, env_class, options_key
    from burstrl.eval.passk import read_exclude_file
    from burstrl.eval.run import (
        EvalSpec,
        checkpoint_adapters,
        evaluate,
        load_eval_tasks,
    )

    model, tasks = Path(cfg.model), Path(cfg.tasks) if cfg.tasks else None
    run_dir = Path(cfg.run) if cfg.run else None
    if not (model / "config.json").is_file():
        _fail(f"{model}: not a model directory")
    env_options = cfg.env_options()
    try:
        if cfg.options:  # a plug-in's own options: where a run keeps them, orchestrator.env.NAME
            env_options = env_options.model_copy(update={"env": {options_key(env_class(cfg.env)): cfg.options}})
        check_env(cfg.env, env_options)
    except ValueError as exc:
        _fail(str(exc))
    if cfg.env == "swe" and tasks is None:
        _fail("--env swe needs --tasks FILE (see `burstrl tasks`)")
    if tasks is not None and not tasks.is_file():
        _fail(f"{tasks}: no such task file")
    adapters: dict[str, Path] = {}
    if run_dir is not None and cfg.every:
        try:
            adapters = checkpoint_adapters(run_dir, cfg.every)
        except ValueError as exc:
            _fail(str(exc))
    elif cfg.adapter:
        path = run_dir / "adapters" / cfg.adapter if run_dir is not None else Path(cfg.adapter)
        if not (path / "adapter_config.json").is_file():
            _fail(f"{path}: not a PEFT adapter directory")
        adapters = {"policy-eval": path}
    excluded = set().union(*(read_exclude_file(p) for p in cfg.exclude)) if cfg.exclude else set()
    spec = EvalSpec(model=model, tasks=tasks, attempts=cfg.attempts, adapters=adapters, temperature=cfg.temperature,
                    seed=cfg.seed, env=cfg.env, options=env_options, n=cfg.n, split=cfg.split,
                    difficulty=cfg.difficulty, task_seed=cfg.task_seed, max_tokens=cfg.max_tokens,
                    concurrency=cfg.max_sandboxes, out=Path(cfg.out))
    try:
        load_eval_tasks(spec)  # bad task arguments fail here, before a replica starts
    except ValueError as exc:
        _fail(str(exc))
    _save_config(cfg, spec.out / "eval_config.toml")
    for path in evaluate(spec, excluded, Path(cfg.compare) if cfg.compare else None):
        typer.echo(str(path))


def _config(cls: type, ctx: typer.Context, extra_overrides: list[str], files: list[str] = (),
            default_files: list[str] = (), prefix: str = ""):
    """The command's config: `files`, then the config files and overrides on the command line (no
    file there: `default_files`), then `extra_overrides` (flags that are sugar for keys); errors exit 2."""
    from burstrl.config import ConfigError, load_tree, parse_command_line

    try:
        given, tree = parse_command_line(list(ctx.args) + list(extra_overrides))
        return load_tree(cls, [*files, *(given or default_files)], tree)
    except (ConfigError, OSError) as exc:
        _fail(f"{prefix}{exc}")


def _save_config(cfg, path: Path) -> None:
    """The resolved config beside the results: `burstrl eval CONFIG` reruns exactly this evaluation."""
    from burstrl.config import dump_toml

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(dump_toml(cfg))


def _print_config(cfg) -> None:
    from burstrl.config import dump_toml

    typer.echo(dump_toml(cfg), nl=False)


ROUTER_URL_AT_START = "(the router's URL, known once it listens)"


def _print_run_config(cfg) -> None:
    """The run's resolved config, then each role's: exactly the files the launcher writes."""
    from burstrl.config import dump_toml

    run_dir = cfg.abs_run_dir()
    typer.echo(f"# {run_dir / 'run_config.toml'}: the resolved run config\n")
    typer.echo(dump_toml(cfg), nl=False)
    for name, role in cfg.role_configs(ROUTER_URL_AT_START).items():
        typer.echo(f"# {run_dir / 'roles' / (name + '.toml')}: what the {name} role receives\n")
        typer.echo(dump_toml(role), nl=False)


def _fail(message: str) -> NoReturn:
    """User errors get one line on stderr and exit status 2, never a traceback."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(2)


def main() -> None:
    """Console-script entry point."""
    app()


if __name__ == "__main__":
    sys.exit(main())
