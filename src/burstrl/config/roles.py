"""The config of each role process: what `burstrl serve`, `route serve`, `train` and `orchestrate` read.

Why pydantic models with a docstring per field: the same model validates a TOML file, the
`--a.b value` overrides and what `RunConfig` (config/run.py) derives for each role of a run, and
it rejects unknown keys by name. No torch import: the CLI loads these to answer `--dry-run` fast.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from burstrl.config.loading import Section
from burstrl.config.vllm import VllmSection
from burstrl.protocol.tenants import TENANT_NAME


class ModelConfig(Section):
    path: str = Field("", description="Hugging Face model directory (config.json, weights, tokenizer).")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Weights dtype; auto = float32 on CPU, bfloat16 on GPU."
    )
    device: str = Field("auto", description="torch device; auto = cuda if available else cpu.")
    warm_start: Literal["plain", "forgetful"] = Field(
        "plain", description="With an empty path and the swe env, which cached SWE warm start: forgetful = "
        "also taught to leave out the commit half the time, a sampled flaw RL can fix from reward alone."
    )


class EngineConfig(Section):
    backend: Literal["burstrl", "vllm"] = Field(
        "burstrl", description="The engine behind the replica: burstrl's own continuous-batching engine, or "
        "vLLM as a child process (engine.vllm); the API, sessions, capture and versions are the same on both."
    )
    vllm: VllmSection = Field(default_factory=VllmSection)
    max_total_num_tokens: int = Field(
        65536, ge=16, description="KV budget in tokens: cached sessions plus running requests."
    )
    kv_block_size: int = Field(
        16, ge=1, le=1024, description="Tokens per KV block (paged KV: the pool is the budget in blocks)."
    )
    kv_window_only: bool = Field(
        True, description="Sliding-window layers (Gemma 3: 5 of 6) keep only their window's KV blocks "
        "(+128 tokens), so a long sequence costs about its length in the global layers only; off = every "
        "layer keeps every block (a cache then resumes from any point, at the full-attention memory)."
    )
    path: Literal["auto", "fast", "generic"] = Field(
        "auto", description="Engine path: auto = the fast runner if the start probe proves it, else the "
        "generic one (the model's own forward); naming one refuses to start unless that path is proven."
    )
    max_running_requests: int = Field(64, ge=1, description="Most requests in one decode batch.")
    max_model_len: int = Field(
        0, ge=0, description="Longest prompt+completion; 0 = the model's max_position_embeddings."
    )
    max_prefill_tokens: int = Field(
        4096, ge=1, description="Prefill tokens per scheduler iteration, so decoding is not starved."
    )
    num_threads: int = Field(
        0, ge=0, description="torch intra-op threads; 0 = the cores this process may use."
    )
    session_cache: bool = Field(
        True, description="Keep a session's KV cache between its calls (off = re-prefill each call)."
    )
    prefix_sharing: bool = Field(
        True, description="A call without its own cache copies the longest cached prefix of another session."
    )
    capture: bool = Field(True, description="Record every call of a session (token ids, logprobs).")
    session_ttl_s: float = Field(
        1800.0, gt=0, description="A session idle this long is released (cache and trace)."
    )
    session_max_life_s: float = Field(
        14400.0, gt=0, description="A session this old is released when idle, however often it calls "
        "(the idle TTL alone restarts on every call)."
    )
    capture_max_session_tokens: int = Field(
        0, ge=0, description="Most token ids one session's capture holds (records are deltas, so an "
        "honest session holds about its context); past it the session's later calls are served but not "
        "recorded and the trace reports them dropped; 0 = 4 x max_model_len."
    )
    capture_max_total_tokens: int = Field(
        1 << 24, ge=1, description="Most token ids all sessions' captures hold together (~8 bytes each); "
        "past it new records are dropped and reported as dropped by the replica's cap."
    )
    diverged_calls: Literal["segment", "refuse"] = Field(
        "segment", description="A call whose prompt does not extend its session's previous call (an "
        "edited history, or another client on the session id): recorded marked `diverged` (segment), "
        "or refused with a 409 naming the session (refuse)."
    )
    thrash_window_s: float = Field(
        60.0, gt=0, description="A session evicted again within this window of its re-fill is thrashing."
    )
    seed: int = Field(0, description="Seed of the engine's generator for requests without a seed.")
    logprobs_mode: Literal["processed", "raw"] = Field(
        "processed", description="Logprobs shown to clients: of the distribution sampled from (after "
        "temperature, penalties, top-k/p) or the model's raw log-softmax (vLLM's default). Capture "
        "always records the processed ones, which the trainer needs."
    )

    @model_validator(mode="after")
    def _budget_holds_a_block(self) -> EngineConfig:
        if self.max_total_num_tokens < self.kv_block_size:
            raise ValueError(f"max_total_num_tokens ({self.max_total_num_tokens}) must hold at least one KV "
                             f"block (kv_block_size {self.kv_block_size})")
        return self


def tenant_key_field(needs: str, owned: str) -> Any:
    """`tenant_key` of a replica's `server` and of the router: one fleet's key, so one definition."""
    return Field("", description="Secret of a fleet shared by several runs (the router's and its replicas' are the "
                 f"same): set, {needs} a tenant token (`<tenant>.<hex HMAC-SHA256(key, tenant)>`, from `burstrl "
                 f"fleet token`), and each tenant's {owned} are its own; empty = no tenants (one run owns it).")


class HttpServerSection(Section):
    host: str = Field("127.0.0.1", description="Bind address.")
    port: int = Field(8000, ge=0, le=65535, description="Bind port; 0 = any free port.")
    admin_token: str = Field(
        "", description="Bearer token for admin endpoints; empty = BURSTRL_ADMIN_TOKEN or generated."
    )
    cluster_token: str = Field(
        "", description="Also accepted for reads of traces and per-session loads (the router's scrapes); "
        "empty = $BURSTRL_CLUSTER_TOKEN."
    )
    tenant_key: str = tenant_key_field("every generation call needs the admin token or",
                                       "sessions, traces, adapter versions and prefix cache (protocol/tenants.py)")
    ssl_certfile: str = Field("", description="TLS certificate (PEM); with ssl_keyfile enables HTTPS.")
    ssl_keyfile: str = Field("", description="TLS private key (PEM).")
    max_body_bytes: int = Field(8 << 20, ge=1024, description="Largest JSON request body.")
    request_workers: int = Field(
        0, ge=0, description="Threads that parse, check, render and tokenize generation requests, so the "
        "event loop (health, loads, every other client) never waits on one request's parsing; 0 = the cores "
        "this process may use."
    )
    max_shard_bytes: int = Field(2 << 30, ge=1024, description="Largest adapter shard upload.")
    bulk_port: int = Field(
        0, ge=-1, le=65535, description="Port of the bulk listener for adapter shards (same host and "
        "token; `GET /v1/adapters/bulk` tells senders); 0 = any free port, -1 = off (shards over HTTP only)."
    )
    dead_engine_exit_s: float = Field(
        5.0, ge=0, description="After its engine dies the replica answers 503 this long (so routers "
        "drop it on their next scrape, not after timeouts), then exits for the fleet to replace it."
    )
    upload_ttl_s: float = Field(
        600.0, gt=0, description="An adapter upload not committed and idle this long is deleted."
    )
    state_dir: str = Field(
        "", description="Where the generated admin token lives (uploads are staged in memory); empty = a temp dir."
    )


class RequestLimitsConfig(Section):
    """Sizes a generation request may have, checked on the raw body before any tokenizing or template
    rendering (inference/limits.py), so an oversized request costs milliseconds before its 400."""

    max_prompt_chars: int = Field(
        0, ge=0, description="Most characters of a prompt's text (a completions prompt, or all message "
        "contents of a chat together) and of the stop strings; 0 = 16 per token of max_model_len."
    )
    max_messages: int = Field(
        0, ge=0, description="Most messages (and most text content parts) of a chat request; 0 = max_model_len "
        "(every message renders to at least one token)."
    )
    max_json_items: int = Field(
        0, ge=0, description="Most JSON values in a request body, counted on the raw bytes before it is parsed "
        "(parsing holds the interpreter lock ~0.1 us per value); 0 = 8 per token of max_model_len + 4096."
    )
    max_json_depth: int = Field(64, ge=8, le=512, description="Deepest nesting of a request body's JSON.")


class ServeConfig(Section):
    """`burstrl serve`: one inference replica."""

    model: ModelConfig = Field(default_factory=ModelConfig)
    engine: EngineConfig = Field(default_factory=EngineConfig)
    server: HttpServerSection = Field(default_factory=HttpServerSection)
    limits: RequestLimitsConfig = Field(default_factory=RequestLimitsConfig)
    served_model_name: str = Field("base", description="Name the base model is served under.")
    content_special_tokens: Literal["text", "parse"] = Field(
        "text", description="Special-token strings typed inside chat message content: tokenized as text "
        "(the template's structure tokens come from the template alone, so tool output cannot forge a "
        "turn), or parsed into the special tokens (vLLM's default)."
    )
    adapters: dict[str, str] = Field(
        default_factory=dict, description="Adapters loaded at start: name -> PEFT directory."
    )
    adapter_volume: str = Field(
        "", description="Versions directory (policy-vN); at start the replica loads the newest "
        "version from it before it reports ready (late joiners); empty = none."
    )


class LoraConfigSection(Section):
    rank: int = Field(8, ge=1, description="LoRA rank r.")
    alpha: int = Field(16, ge=1, description="LoRA alpha; the update is scaled by alpha / r.")
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        description="Linear layers that get an adapter.",
    )


class TrainerSection(Section):
    world_size: int = Field(1, ge=1, description="Data-parallel ranks (processes) started by `burstrl train`.")
    backend: Literal["auto", "gloo", "nccl"] = Field("auto", description="torch.distributed backend; auto = nccl on GPU.")
    steps: int = Field(100, ge=1, description="Train steps to run (the last one is step `steps`).")
    batch_groups: int = Field(8, ge=1, description="Groups (tasks x G attempts) per step.")
    micro_batch_tokens: int = Field(4096, ge=16, description="Token budget of one forward/backward.")
    activation_checkpointing: Literal["none", "full", "attention"] = Field(
        "none", description="What the backward recomputes: none (keep every activation), full (rerun each "
        "layer), attention (keep only the attention op's output and log-sum-exp per layer, rerun the rest: "
        "memory near full, time near none at long context; see trainer/recompute.py)."
    )
    attention: Literal["sdpa", "burstrl"] = Field(
        "sdpa", description="Attention of the trained model: sdpa (PyTorch's kernels) or burstrl (one custom "
        "op returning out and log-sum-exp, for kernels the recompute policy cannot see; model/attention.py)."
    )
    lr: float = Field(1e-4, gt=0, description="AdamW learning rate.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    warmup_steps: int = Field(0, ge=0, description="Linear learning-rate warm-up steps.")
    grad_clip: float = Field(1.0, ge=0, description="Max global gradient norm; 0 = off.")
    clip_low: float = Field(0.2, ge=0, description="PPO ratio clip: lower bound 1 - clip_low.")
    clip_high: float = Field(0.28, ge=0, description="PPO ratio clip: upper bound 1 + clip_high.")
    tis_cap: float = Field(2.0, ge=0, description="Truncated importance sampling cap on the ratio; 0 = off.")
    kl_coef: float = Field(0.0, ge=0, description="Coefficient of the KL penalty to the base model; 0 = off.")
    loss_agg: Literal["token-mean", "sequence-mean"] = Field("token-mean", description="Loss aggregation.")
    std_norm: bool = Field(True, description="Divide group advantages by the group's reward std.")
    max_staleness: int = Field(4, ge=0, description="Drop groups sampled more than this many versions ago.")
    seed: int = Field(0, description="Seed of every rank's RNGs.")
    num_threads: int = Field(0, ge=0, description="torch intra-op threads per rank; 0 = cores / world_size.")
    wait_timeout_s: float = Field(0.0, ge=0, description="Fail if no batch arrives in this time; 0 = wait forever.")
    poll_s: float = Field(0.2, gt=0, description="How often to look for new groups while waiting.")


class WeightsConfig(Section):
    volume: str = Field("", description="Where versions are written; empty = RUN_DIR/adapters.")
    replicas: list[str] = Field(default_factory=list, description="Replica URLs to push each version to.")
    replicas_file: str = Field("", description="File with one replica URL per line, re-read before each push.")
    admin_token: str = Field("", description="Replicas' bearer token; empty = $BURSTRL_ADMIN_TOKEN.")
    verify_tls: bool = Field(True, description="Verify replicas' TLS certificates.")
    ca_file: str = Field("", description="CA bundle for replicas' certificates.")
    push_retries: int = Field(3, ge=0, description="Retries per shard/commit, with exponential backoff.")
    keep_versions: int = Field(5, ge=1, description="Versions kept on the volume (older ones are deleted).")
    async_push: bool = Field(
        True, description="With one trainer rank, push each version to the replicas in the background while "
        "the next step runs (the volume is always written first)."
    )
    serving_dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Dtype of the adapter tensors pushed to replicas, cast once on the trainer (half the "
        "bytes at 16 bits; the volume keeps float32); auto = model.dtype when that is a 16-bit dtype, else float32."
    )


class TrainConfig(Section):
    """`burstrl train`: GRPO on a LoRA adapter from the rollout store."""

    run_dir: str = Field("runs/default", description="Run directory: store, checkpoints, adapters, metrics.")
    store: str = Field("", description="Rollout store path; empty = RUN_DIR/store.sqlite.")
    temperature: float = Field(
        1.0, gt=0, description="Sampling temperature of the rollouts: the trainer scores tokens with logits / T, "
        "the distribution the replica sampled from and reported logprobs for (`burstrl run`: "
        "orchestrator.temperature)."
    )
    model: ModelConfig = Field(default_factory=ModelConfig)
    lora: LoraConfigSection = Field(default_factory=LoraConfigSection)
    trainer: TrainerSection = Field(default_factory=TrainerSection)
    weights: WeightsConfig = Field(default_factory=WeightsConfig)


class TenantLimits(Section):
    """One tenant's share of a shared router (`router.tenants`): admission of its new sessions (router/shares.py)."""

    weight: float = Field(1.0, gt=0, description="Its share of the session places under contention, in "
                          "proportion to the other waiting tenants' weights.")
    max_sessions: int = Field(0, ge=0, description="Its live plus waiting sessions at most; a new session "
                              "beyond gets a 429. 0 = no cap.")
    max_kv_tokens: int = Field(0, ge=0, description="KV tokens its live plus waiting sessions are projected to "
                               "hold at their final sizes (the size model placement uses), at most; a new "
                               "session that would take it past gets a 429. 0 (or null) = no cap.")

    @field_validator("max_kv_tokens", mode="before")
    @classmethod
    def _no_kv_cap(cls, value: Any) -> Any:
        return 0 if value is None else value


class RouteConfig(Section):
    """`burstrl route serve`: the session router in front of the replicas."""

    host: str = Field("127.0.0.1", description="Bind address.")
    port: int = Field(8080, ge=0, le=65535, description="Bind port; 0 = any free port.")
    cluster_token: str = Field(
        "", description="Bearer token replicas register with; empty = $BURSTRL_CLUSTER_TOKEN, else "
        "generated and printed to stderr."
    )
    tenant_key: str = tenant_key_field("generation calls, /v1/assign, traces and /v1/models (the last two: or the "
                                       "cluster token) need", "sessions and versions (router/tenancy.py)")
    sandbox_nodes: list[dict[str, str]] = Field(
        [], description="The shared fleet's sandbox node agents ({name, url}), as GET /v1/fleet/sandbox-nodes lists "
        "them to tenants; `burstrl fleet up` sets it.")
    policy: Literal["kv", "headroom", "random", "round_robin", "weighted_random", "smooth_wrr", "least_sessions",
                    "least_requests", "cache_aware"] = Field(
        "kv", description="Placement policy for new sessions (router/catalog.py; benchmarks in docs/benchmarks.md)."
    )
    k: int = Field(2, ge=1, description="Replicas sampled per new session (headroom).")
    text_prefix_keys: bool = Field(
        True, description="Key text and chat prompts by chunks of their canonical JSON (router/text_keys.py), so "
        "a GRPO group's sessions with one first prompt follow each other to one replica's prefix cache; off: "
        "such prompts are placed by load alone (the router holds no tokenizer)."
    )
    scrape_s: float = Field(1.0, gt=0, description="Seconds between load scrapes of every replica.")
    health_failures: int = Field(
        2, ge=1, description="Consecutive failed scrapes after which a replica is dropped."
    )
    request_timeout_s: float = Field(
        600.0, gt=0, description="Overall deadline of every call forwarded to a replica, however slowly it "
        "answers: its headers, and a non-streaming answer's whole body (connect: 5 s)."
    )
    stream_gap_s: float = Field(
        120.0, gt=0, description="Longest wait between two chunks of a relayed stream; a stream stalled longer "
        "ends with an error event (504). Covers queueing before the first token, so generous."
    )
    max_body_bytes: int = Field(8 << 20, ge=1024, description="Largest JSON request body.")
    scrape_timeout_s: float = Field(
        0.0, ge=0, description="Total deadline of one scrape of a replica (both requests and both answers, "
        "however slowly they arrive); 0 = max(2, 2 x scrape_s), at most request_timeout_s."
    )
    max_scrape_bytes: int = Field(
        16 << 20, ge=1024, description="Largest scrape answer (`/v1/loads`, `/v1/models`) read from a replica; "
        "a longer one marks the replica bad (out of rotation until it answers sanely)."
    )
    max_answer_bytes: int = Field(
        64 << 20, ge=1024, description="Largest non-streaming answer relayed from a replica; a longer one is "
        "refused with a 502 that names this cap (the router never holds more of it)."
    )
    max_event_bytes: int = Field(
        8 << 20, ge=1024, description="Largest single event of a relayed stream (SSE: up to its blank line); "
        "a longer one ends the stream with an error event that names this cap."
    )
    max_sessions: int = Field(
        1_000_000, ge=1, description="Sessions the router remembers (home, pinned version, kind); beyond "
        "it the longest-unseen are forgotten first (finished ones are forgotten anyway)."
    )
    version_pools: list[Literal["reserved", "on_demand"]] = Field(
        default_factory=list, description="Pools that must each serve a version before new sessions "
        "('latest') use it; empty = every pool that has a healthy replica."
    )
    replicas: list[str] = Field(
        default_factory=list, description="Replica URLs registered at start (pool reserved, weight 1)."
    )
    tenants: dict[str, TenantLimits] = Field(
        default_factory=dict, description="Weights and quotas of new sessions by tenant name (the fleet's "
        "own sessions, without tenancy, are tenant ''); a tenant not listed has weight 1 and no cap."
    )
    max_sessions_per_replica: int = Field(
        0, ge=0, description="Session places per healthy replica: at fleet-wide places in use, a new session "
        "waits for one, given by weighted fair share among tenants (router/shares.py); 0 = no admission control."
    )
    admission_timeout_s: float = Field(
        300.0, gt=0, description="Longest wait of a new session for a place; past it a 503."
    )

    @field_validator("tenants")
    @classmethod
    def _tenant_names(cls, tenants: dict[str, TenantLimits]) -> dict[str, TenantLimits]:
        """A key that no token can name would silently never apply: refused, named, at load."""
        for name in tenants:
            if name and not TENANT_NAME.fullmatch(name):
                raise ValueError(f"key {name!r} of router.tenants is not a tenant name: 1-32 characters of "
                                 "[a-z0-9-], starting with a letter or digit ('' is the fleet's own sessions)")
        return tenants


class CurriculumConfig(Section):
    start_difficulty: int = Field(1, ge=0, description="Difficulty sampled first.")
    max_difficulty: int = Field(0, ge=0, description="Hardest difficulty; 0 = the environment's maximum.")
    advance_pass_rate: float = Field(
        0.5, ge=0, le=1, description="Move one difficulty up once this share of the last `window` groups' "
        "attempts pass at the current difficulty."
    )
    window: int = Field(8, ge=1, description="Groups the pass rate is measured over.")
    task_retries: int = Field(2, ge=0, description="Times a task with no passing attempt is re-queued.")
    retry_after: int = Field(4, ge=0, description="New groups started before a re-queued task comes back.")


class SweEnvConfig(Section):
    tasks: str = Field("", description="SWE tasks (JSONL); empty = generate toy tasks into RUN_DIR/swe-tasks.")
    toy_tasks: int = Field(64, ge=1, description="Toy tasks generated per difficulty when `tasks` is empty.")
    toy_seed: int = Field(0, description="Seed of the generated toy tasks.")
    toy_difficulties: list[int] = Field(
        default_factory=lambda: [1, 2], description="Difficulties of the generated toy tasks (0: the statement "
        "says what to replace; 1: a symptom only; 2: the bug one call away; 3, 4: more bugs, deeper)."
    )
    split: str = Field("train", description="Task split trained on (tasks whose extra.split differs are skipped).")
    reward: Literal["binary", "f2p", "strict"] = Field(
        "binary", description="Training reward: resolved (0/1), share of target tests passed, or that share "
        "if no existing test broke."
    )
    format_reward: float = Field(
        0.0, ge=0, le=1, description="Shaping: added to the reward of an attempt that submitted with no format "
        "error (every reply exactly one bash block), tampered or not graded ones excluded. Helps a tiny model "
        "learn the agent's format; keep 0 (off) for real tasks, where it rewards submitting anything."
    )
    backend: Literal["auto", "namespace", "oci", "runsc"] = Field(
        "auto", description="Sandbox backend: auto = the safest that works here (runsc as root where gVisor "
        "runs, else namespace); namespace = bubblewrap; oci = runc; runsc = gVisor."
    )
    workdir_mb: int = Field(0, ge=0, description="Size limit of each sandbox's /work in MB (a filesystem of "
                            "its own as root; ENOSPC past it); 0 = each task's `disk` (default 4096).")
    max_sandboxes: int = Field(8, ge=1, description="Sandboxes alive at once (attempts plus grading).")
    nodes_file: str = Field("", description="Node agents to place sandboxes on (JSON list of {url, token, name}; "
                            "`--provider ray` writes one when the cluster has `sandbox_node` nodes); empty = "
                            "sandboxes on this machine.")
    placement: Literal["ours", "image_affinity", "reference"] = Field(
        "ours", description="Placement policy across node agents (burstrl.sandbox.placement).")
    node_dead_after_s: float = Field(10.0, gt=0, description="A node agent silent this long is dead: its "
                                     "attempts end as infra errors and are re-run elsewhere.")
    max_turns: int = Field(6, ge=1, description="Agent turns (model calls) per attempt.")
    max_tokens_per_call: int = Field(128, ge=1, description="max_tokens of each agent call.")
    command_timeout_s: float = Field(30.0, gt=0, description="Timeout of one agent command in the sandbox.")
    grade_timeout_s: float = Field(300.0, gt=0, description="Timeout of grading one attempt.")
    suspicious: Literal["zero", "flag"] = Field(
        "zero", description="What the static scan's suspicious-level findings in the changed code (envs/swe/scan.py: "
        "pytest imports, atexit, os._exit, /proc/self, writes into builtins, marshal) do: zero = the attempt scores "
        "0 untested (training), flag = recorded only (burstrl eval's default). What no bug fix adds (frames, gc, "
        "ctypes, closure cells, __subclasses__, writes into sys.modules or the runner, values equal to everything: "
        "envs/swe/primitives.py) the diff policy refuses in every mode."
    )
    seal: bool = Field(
        True, description="Run the graded tests sealed (envs/swe/seal.py: results signed by an audit hook and "
        "collected out of the code's reach; a forgery's primitives end the attempt as tampered) wherever the "
        "test command is a plain `python -m pytest|unittest`; false runs them unsealed (log, report and end "
        "marker checks only)."
    )
    diff_allow: list[str] = Field(
        default_factory=list, description="Globs of paths an attempt's patch may change beyond the diff policy's "
        "default (new files outside the source directories, runner config); binaries, bytecode, packaging "
        "metadata and symlinks stay refused (envs/swe/diffpolicy.py). A task's extra.diff_policy adds to it."
    )
    diff_deny: list[str] = Field(
        default_factory=list, description="Globs of paths an attempt's patch may never change (refused as tampered)."
    )


class OrchestratorSection(Section):
    envs: dict[str, float] = Field(
        default_factory=lambda: {"toy": 1.0}, description="Environments and their sampling weights."
    )
    group_size: int = Field(8, ge=2, description="Attempts per task (G); GRPO normalises within a group.")
    max_in_flight_groups: int = Field(
        8, ge=1, description="Groups being generated at once (`burstrl run`: trainer.batch_groups unless set)."
    )
    max_buffered_groups: int = Field(
        8, ge=1, description="Stop starting groups while this many wait in the store (bounds staleness; "
        "`burstrl run`: trainer.batch_groups unless set, one batch ready while the next is generated)."
    )
    temperature: float = Field(1.0, gt=0, description="Sampling temperature of every call.")
    max_tokens: int = Field(16, ge=1, description="max_tokens of a call unless the environment sets it.")
    attempt_retries: int = Field(
        3, ge=0, description="Times an attempt is re-run (fresh session, new rollout id) after a replica failure."
    )
    request_timeout_s: float = Field(120.0, gt=0, description="Timeout of one call to the router.")
    seed: int = Field(0, description="Seed of task sampling and sampling seeds.")
    stats_interval_s: float = Field(1.0, gt=0, description="Seconds between lines of orchestrator.jsonl.")
    curriculum: CurriculumConfig = Field(default_factory=CurriculumConfig)
    swe: SweEnvConfig = Field(default_factory=SweEnvConfig)
    env: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description="Options of environments that bring their own options model, by the "
        "environment's name (`[orchestrator.env.NAME]`); each is validated by that environment (envs/registry.py)."
    )


class OrchestrateConfig(Section):
    """`burstrl orchestrate`: generate groups of rollouts through the router into the store."""

    run_dir: str = Field("runs/default", description="Run directory (store, orchestrator.jsonl).")
    store: str = Field("", description="Rollout store path; empty = RUN_DIR/store.sqlite.")
    router: str = Field("http://127.0.0.1:8080", description="Router URL (OpenAI API).")
    steps: int = Field(0, ge=0, description="Stop once the store has this many committed steps; 0 = never.")
    orchestrator: OrchestratorSection = Field(default_factory=OrchestratorSection)


