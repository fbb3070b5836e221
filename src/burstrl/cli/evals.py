"""`burstrl sft` and `burstrl eval`."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from burstrl.cli.app import (
    app,
    command_config,
    fail,
    keys_help,
    print_config,
    save_config,
)


@app.command("sft", **keys_help("SftConfig in burstrl/config/commands.py"))
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
    cfg = command_config(SftConfig, ctx, [f"{key}=true" for key, on in flags.items() if on])
    if dry_run:
        return print_config(cfg)
    if not Path(cfg.model).is_dir():
        fail(f"{cfg.model}: no such model directory")
    from burstrl.trainer.sft import SFTDataError, sft

    try:
        sft(cfg.model, cfg.data, cfg.out, steps=cfg.steps, epochs=cfg.epochs or None, lr=cfg.lr,
            batch_size=cfg.batch_size, lora=cfg.lora, seed=cfg.seed, log_every=cfg.log_every, device=cfg.device,
            force=cfg.force)
    except (SFTDataError, FileExistsError) as exc:
        fail(str(exc))



@app.command("eval", **keys_help("EvalConfig in burstrl/config/commands.py"))
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

    from burstrl.config import EvalConfig

    sugar = [f"--exclude={json.dumps(exclude)}"] if exclude else []
    sugar += [f"--max_sandboxes={concurrency}"] if concurrency is not None else []
    options = [item.partition("=") for item in env_option]
    for item, (key, eq, _) in zip(env_option, options, strict=False):
        if not eq or not key.strip():
            fail(f"--env-option {item!r}: expected KEY=VALUE")
    cfg = command_config(EvalConfig, ctx, sugar)
    if options:  # the env's section is known once the config names the env (module:Class: `options`)
        section = cfg.env if cfg.env in ("swe",) else "options"  # a typed section, else the env's own model
        sections = [f"--{section}.{key.strip()}={value}" for key, _, value in options]
        cfg = command_config(EvalConfig, ctx, sugar + sections, prefix="--env-option: ")
    if dry_run:
        return print_config(cfg)
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
        fail(f"{model}: not a model directory")
    env_options = cfg.env_options()
    try:
        if cfg.options:  # a plug-in's own options: where a run keeps them, orchestrator.env.NAME
            env_options = env_options.model_copy(update={"env": {options_key(env_class(cfg.env)): cfg.options}})
        check_env(cfg.env, env_options)
    except ValueError as exc:
        fail(str(exc))
    if cfg.env == "swe" and tasks is None:
        fail("--env swe needs --tasks FILE (see `burstrl tasks`)")
    if tasks is not None and not tasks.is_file():
        fail(f"{tasks}: no such task file")
    adapters: dict[str, Path] = {}
    if run_dir is not None and cfg.every:
        try:
            adapters = checkpoint_adapters(run_dir, cfg.every)
        except ValueError as exc:
            fail(str(exc))
    elif cfg.adapter:
        path = run_dir / "adapters" / cfg.adapter if run_dir is not None else Path(cfg.adapter)
        if not (path / "adapter_config.json").is_file():
            fail(f"{path}: not a PEFT adapter directory")
        adapters = {"policy-eval": path}
    excluded = set().union(*(read_exclude_file(p) for p in cfg.exclude)) if cfg.exclude else set()
    spec = EvalSpec(model=model, tasks=tasks, attempts=cfg.attempts, adapters=adapters, temperature=cfg.temperature,
                    seed=cfg.seed, env=cfg.env, options=env_options, n=cfg.n, split=cfg.split,
                    difficulty=cfg.difficulty, task_seed=cfg.task_seed, max_tokens=cfg.max_tokens,
                    concurrency=cfg.max_sandboxes, out=Path(cfg.out), engine=cfg.engine, dtype=cfg.model_dtype)
    try:
        load_eval_tasks(spec)  # bad task arguments fail here, before a replica starts
    except ValueError as exc:
        fail(str(exc))
    save_config(cfg, spec.out / "eval_config.toml")
    for path in evaluate(spec, excluded, Path(cfg.compare) if cfg.compare else None):
        typer.echo(str(path))


