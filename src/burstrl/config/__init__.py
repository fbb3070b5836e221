"""Configuration for every burstrl command and role: pydantic models, TOML files, dotted CLI overrides.

Why one package: every process reads its slice of the same tree, so a run's resolved config is one
file that can be saved in the run directory and replayed, and `RunConfig` derives what each role
receives. It must not import torch: the CLI loads it to answer `--help` and `--dry-run` fast.

Layering: defaults < config files (in order) < `--a.b value` overrides. Unknown keys anywhere are
errors that name the key (`unknown config key 'engine.max_tokens_total'`).

- loading.py: the grammar (files + overrides, one parser), validation, TOML output
- roles.py: each role process's config (serve, route serve, train, orchestrate) and their sections
- run.py: `burstrl run`'s config and the role configs it derives
- commands.py: `burstrl sft` and `burstrl eval`
"""

from burstrl.config.commands import EvalConfig, SftConfig
from burstrl.config.loading import (
    ConfigError,
    Section,
    dump_toml,
    load_config,
    load_tree,
    merge,
    parse_command_line,
    parse_overrides,
    read_config_file,
    validate,
)
from burstrl.config.roles import (
    CurriculumConfig,
    EngineConfig,
    HttpServerSection,
    LoraConfigSection,
    ModelConfig,
    OrchestrateConfig,
    OrchestratorSection,
    RequestLimitsConfig,
    RouteConfig,
    ServeConfig,
    SweEnvConfig,
    TrainConfig,
    TrainerSection,
    WeightsConfig,
)
from burstrl.config.run import AutoscaleConfig, ChaosConfig, FleetConfig, RayConfig, RunConfig

__all__ = [
    "AutoscaleConfig", "ChaosConfig", "ConfigError", "CurriculumConfig", "EngineConfig", "EvalConfig",
    "FleetConfig", "HttpServerSection", "LoraConfigSection", "ModelConfig", "OrchestrateConfig", "OrchestratorSection",
    "RayConfig", "RequestLimitsConfig", "RouteConfig", "RunConfig", "Section", "ServeConfig", "SftConfig", "SweEnvConfig",
    "TrainConfig", "TrainerSection", "WeightsConfig", "dump_toml", "load_config", "load_tree",
    "merge", "parse_command_line", "parse_overrides", "read_config_file", "validate",
]
