"""Configs of the one-shot commands: `burstrl sft` and `burstrl eval`.

Why pydantic here too: every command then takes the same grammar (CONFIG.toml files, then
`--key value` overrides, `--dry-run`), rejects unknown keys by name, and can be replayed from its
printed config. Paths are strings, as in the role configs: TOML has no path type.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from burstrl.config.loading import Section
from burstrl.config.roles import EngineConfig, OrchestratorSection, SweEnvConfig

Dtype = Literal["auto", "float32", "bfloat16", "float16"]  # as ModelConfig.dtype of `burstrl serve`


class SftConfig(Section):
    """`burstrl sft`: supervised fine-tuning on chat demonstrations (loss on assistant replies only)."""

    model: str = Field(description="Base model directory (HF format).")
    data: str = Field(description='JSONL demonstrations, one {"messages": [...]} per line.')
    out: str = Field(description="Directory to write (must be missing or empty).")
    steps: int = Field(200, ge=1, description="Optimizer steps.")
    epochs: int = Field(0, ge=0, description="Passes over the data (overrides steps); 0 = use steps.")
    lr: float = Field(1e-4, ge=0, description="AdamW learning rate.")
    batch_size: int = Field(8, ge=1, description="Conversations per step.")
    lora: bool = Field(False, description="Train a LoRA adapter; OUT is a PEFT adapter dir.")
    seed: int = Field(0, description="Seed of data order and initialisation.")
    log_every: int = Field(10, ge=0, description="Print the loss every N steps (0 = never).")
    device: str = Field("auto", description="torch device; auto = cuda if available else cpu.")
    force: bool = Field(False, description="Replace a non-empty OUT.")


class EvalConfig(Section):
    """`burstrl eval`: pass@k (and for SWE target-test and strict scores) of a model, an adapter or a
    run's checkpoints."""

    model: str = Field(description="Base model directory (HF format).")
    env: str = Field("swe", description="Environment: swe, toy, toy_multi, functions (any registered one).")
    tasks: str = Field("", description="SWE tasks (JSONL); required for env swe.")
    n: int = Field(16, ge=1, description="Other envs: tasks the environment makes.")
    split: str = Field("test", description="Other envs: task split (held-out test by default).")
    difficulty: int = Field(1, ge=0, description="Other envs: difficulty of the tasks.")
    task_seed: int = Field(0, description="Other envs: seed of the tasks.")
    attempts: int = Field(4, ge=1, description="Attempts per task (K).")
    adapter: str = Field("", description="A PEFT adapter dir, or a version name of `run`.")
    run: str = Field("", description="A run directory: evaluate its checkpoints.")
    every: int = Field(0, ge=0, description="With run: every N-th checkpoint, as a curve.")
    exclude: list[str] = Field(default_factory=list, description="Files of flawed task ids to drop.")
    compare: str = Field("", description="Results of another evaluation of the same tasks.")
    out: str = Field("eval", description="Output directory (results.json, report.md, report.png).")
    temperature: float = Field(1.0, ge=0, description="Sampling temperature.")
    max_tokens: int = Field(0, ge=0, description="max_tokens of a call; 0 = the env's default.")
    max_sandboxes: int = Field(4, ge=1, description="Attempts running at once (swe: its max_sandboxes too).")
    max_turns: int = Field(6, ge=1, description="SWE: agent turns per attempt (its max_turns).")
    seed: int = Field(0, description="Seed of the sampling seeds.")
    swe: SweEnvConfig = Field(default_factory=lambda: SweEnvConfig(suspicious="flag"),
                              description="The swe environment's options, as orchestrator.swe of a run (e.g. "
                              "reward = \"f2p\"); suspicious defaults to \"flag\" here: an evaluation records "
                              "the static scan's findings and scores as usual.")
    engine: EngineConfig = Field(
        default_factory=EngineConfig,
        description="The eval replica's engine, as engine of `burstrl serve`/`run`: --engine.backend vllm "
        "(--engine.vllm.kv_cache_gib 2 ...) evaluates on vLLM, as a run on vLLM samples. num_threads defaults "
        "to 1 here (the own engine's torch threads; a vLLM replica is not given it).")
    model_dtype: Dtype = Field("auto", description="The replica's model.dtype: auto = float32 on CPU, bfloat16 on "
                               "GPU; bfloat16 evaluates a run trained with --model.dtype bfloat16 as it sampled.")
    options: dict[str, Any] = Field(default_factory=dict, description="Options of an environment named "
                                    "package.module:Class, validated by its own model as orchestrator.env.NAME of "
                                    "a run is (--env-option KEY=VALUE sets them).")

    def model_post_init(self, _: Any) -> None:
        """max_sandboxes and max_turns are the eval's own knobs: they set the swe section's, once. The
        engine's num_threads is 1 unless set (a partial --engine.* section must not bring back serve's 0)."""
        if "num_threads" not in self.engine.model_fields_set:
            self.engine = self.engine.model_copy(update={"num_threads": 1})
        mine = {"max_sandboxes": self.max_sandboxes, "max_turns": self.max_turns}
        for key, value in mine.items():
            if key in self.swe.model_fields_set and getattr(self.swe, key) != value:
                raise ValueError(f"set {key} (--{key.replace('_', '-')}), not swe.{key}: it is the eval's own")
        self.swe = self.swe.model_copy(update=mine)

    def env_options(self) -> OrchestratorSection:
        """What the environment reads its section from (as in a run's orchestrator config)."""
        return OrchestratorSection(swe=self.swe)
