"""`burstrl run`'s config: every role of one RL run, and what each role receives.

Why the roles' configs are derived here and not in the launcher: the shared settings (the model,
the run directory, the sampling temperature, the batch size) then have one home, `burstrl run
--dry-run` prints exactly what each role will read, and the launcher only writes these files
(as prime-rl's `RLConfig` derives its trainer, orchestrator and inference configs).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from burstrl.config.loading import Section
from burstrl.config.roles import (
    EngineConfig,
    HttpServerSection,
    LoraConfigSection,
    ModelConfig,
    OrchestrateConfig,
    OrchestratorSection,
    RouteConfig,
    ServeConfig,
    TrainConfig,
    TrainerSection,
    WeightsConfig,
)
from burstrl.protocol.tenants import TENANT_NAME

VLLM_REPLICA_EXTRA_S = 120.0  # a vLLM replica's start beyond vLLM's own: imports, tokenizer, the newest version


class FleetConfig(Section):
    reserved: int = Field(1, ge=0, description="Replicas in the reserved pool (never scaled down).")
    on_demand: int = Field(1, ge=0, description="Replicas in the on-demand pool at start (elastic).")
    reserved_weight: float = Field(1.0, gt=0, description="Router weight of a reserved replica.")
    on_demand_weight: float = Field(1.0, gt=0, description="Router weight of an on-demand replica.")
    replace_dead: bool = Field(True, description="Start a replacement when a replica dies.")
    start_timeout_s: float = Field(
        0.0, ge=0, description="A replica not ready in this time has failed; 0 = by engine: 180 s on burstrl's "
        "engine, engine.vllm.start_timeout_s + 120 s on vLLM (its start alone takes minutes on a busy CPU).")
    max_replicas: int = Field(
        0, ge=0, description="Most replicas the run plans to hold at once, `burstrl scale` included: vLLM replicas "
        "on CPU get the host's cores split by it, and memory is checked for it; 0 = reserved + on_demand (or + "
        "autoscale.max_on_demand when autoscaling).")
    zygote: bool = Field(True, description="Fork replicas from a process that has torch and the model code "
                         "imported (a replacement then only loads weights): one per run (local), one per node (ray).")
    tenant_idle_s: float = Field(
        60.0, ge=0, description="`burstrl fleet up`: unload the versions of a tenant whose run's launcher has not "
        "asked the fleet for its replicas (every 2 s while it runs) for this long: a run killed with -9 cannot "
        "release them itself; 0 = never.")
    sandbox_nodes: int = Field(
        0, ge=0, description="`burstrl fleet up`: sandbox node agents the fleet runs with its tenant key (local "
        "provider: this many, on the fleet's host; ray: any value > 0 runs one on each node carrying the resource "
        "`sandbox_node`, following nodes that join or leave); a tenant run with the swe env places its sandboxes "
        "there with its tenant token, each tenant seeing only its own (sandbox/node_tenants.py); 0 = runs keep "
        "their own sandboxes.")
    sandbox_tenant_max: int = Field(
        0, ge=0, description="Live sandboxes one tenant may hold on each of the fleet's sandbox nodes (beyond: a "
        "429 at once); 0 = no cap.")
    sandbox_node_slots: int = Field(
        0, ge=0, description="Sandboxes each of the fleet's sandbox nodes runs at once (its --max-sandboxes): the "
        "slots its active tenants share by weight (router.tenants.<name>.weight, sandbox/node_shares.py); 0 = no "
        "bound, and then no shares (only sandbox_tenant_max).")
    url: str = Field("", description="A shared fleet's router (`burstrl fleet up` prints it): set, the run starts "
                     "no router and no replicas (the pool counts are ignored), only its trainer and orchestrator, "
                     "as the tenant that fleet.token names; empty = the run brings its own fleet.")
    token: str = Field("", description="The run's tenant token on the fleet at fleet.url (`burstrl fleet token "
                       "NAME --key-file FLEET_DIR/tenant.key`); its NAME is the run's namespace there. Not saved "
                       "in the run's run_config.toml.")


class AutoscaleConfig(Section):
    enabled: bool = Field(False, description="Scale the on-demand pool from the trainer's wait and the buffer.")
    min_on_demand: int = Field(0, ge=0, description="Fewest on-demand replicas.")
    max_on_demand: int = Field(4, ge=0, description="Most on-demand replicas.")
    interval_s: float = Field(10.0, gt=0, description="Seconds between decisions (and the cool-down after one).")
    wait_fraction: float = Field(
        0.3, ge=0, le=1, description="Add a replica when the trainer spent more than this share of its recent "
        "steps waiting for data."
    )
    overflow_batches: float = Field(
        2.0, gt=0, description="Remove a replica when more than this many batches wait in the store."
    )


class ChaosConfig(Section):
    kill_fraction: float = Field(0.0, ge=0, le=1, description="Share of replicas SIGKILLed once; 0 = off.")
    at_step: int = Field(0, ge=0, description="Kill while this step is being generated/trained (1-based).")


class RayConfig(Section):
    """`provider = "ray"`: where each role runs on a Ray cluster (providers/ray_provider.py)."""

    address: str = Field("", description="Ray cluster address (ray://host:10001 or host:6379); empty = "
                         "$RAY_ADDRESS, else a Ray instance started for this run on this machine.")
    auth_token_file: str = Field("", description="File holding the cluster's auth token; empty = $RAY_AUTH_TOKEN "
                                 "or Ray's default token file. (Never the token itself: configs are saved.)")
    replica_gpus: float = Field(0.0, ge=0, description="GPUs per replica (0 on CPU).")
    replica_cpus: float = Field(0.0, ge=0, description="Logical CPUs a replica holds (its actor is async).")
    reserved_resources: dict[str, float] = Field(
        default_factory=dict, description="Custom resources a reserved replica needs, e.g. {reserved = 1}.")
    on_demand_resources: dict[str, float] = Field(
        default_factory=dict, description="Custom resources an on-demand replica needs, e.g. {spot = 1}.")
    trainer_gpus: float = Field(0.0, ge=0, description="GPUs per trainer rank (0 on CPU).")
    trainer_cpus: float = Field(1.0, ge=0, description="Logical CPUs per trainer rank.")
    trainer_restarts: int = Field(3, ge=0, description="Relaunches of the trainer group (from its last "
                                  "checkpoint) after a rank dies, before the run fails.")
    router_restarts: int = Field(5, ge=0, description="Restarts of the router actor before the run fails.")
    placement_timeout_s: float = Field(
        120.0, gt=0, description="An actor or placement group not placed in this time fails with the resources "
        "it asked for (Ray would leave it pending forever).")
    request_resources: bool = Field(True, description="Ask Ray's cluster autoscaler for the replicas' resources "
                                    "when the fleet grows (a no-op on a fixed cluster).")


class RunConfig(Section):
    """`burstrl run`: every role of one RL run, started and supervised by the launcher."""

    run_dir: str = Field("runs/quickstart", description="Run directory: config, store, adapters, logs, metrics.")
    provider: Literal["local", "ray"] = Field(
        "local", description="Where roles run: local subprocesses, or actors on a Ray cluster (see [ray]).")
    ray: RayConfig = Field(default_factory=RayConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    engine: EngineConfig = Field(default_factory=EngineConfig)
    router: RouteConfig = Field(default_factory=lambda: RouteConfig(port=0))
    lora: LoraConfigSection = Field(default_factory=LoraConfigSection)
    trainer: TrainerSection = Field(default_factory=TrainerSection)
    weights: WeightsConfig = Field(default_factory=WeightsConfig)
    orchestrator: OrchestratorSection = Field(default_factory=OrchestratorSection)
    fleet: FleetConfig = Field(default_factory=FleetConfig)
    autoscale: AutoscaleConfig = Field(default_factory=AutoscaleConfig)
    chaos: ChaosConfig = Field(default_factory=ChaosConfig)

    def model_post_init(self, _: Any) -> None:
        """Checks across sections, and the orchestrator's group bounds sized by the trainer's batch."""
        if self.fleet.url or self.fleet.token:
            check_shared_fleet(self)
        elif self.fleet.reserved + self.fleet.on_demand < 1:
            raise ValueError("fleet: at least one replica is needed (fleet.reserved + fleet.on_demand >= 1)")
        a = self.autoscale
        if a.min_on_demand > a.max_on_demand:
            raise ValueError(f"autoscale.min_on_demand ({a.min_on_demand}) > autoscale.max_on_demand ({a.max_on_demand})")
        unset = {"max_in_flight_groups", "max_buffered_groups"} - self.orchestrator.model_fields_set
        if unset:  # one batch in flight and one ready while the next is generated
            self.orchestrator = self.orchestrator.model_copy(update=dict.fromkeys(unset, self.trainer.batch_groups))

    # ---- what each role receives: the launcher writes these, `burstrl run --dry-run` prints them ----
    def abs_run_dir(self) -> Path:
        return Path(self.run_dir).absolute()

    def tenant(self) -> str:
        """The run's tenant name on a shared fleet (its token's `<tenant>.` part); empty without one."""
        return self.fleet.token.partition(".")[0] if self.fleet.url else ""

    def volume(self) -> str:
        """Where versions are published and late-joining replicas load the newest from."""
        return self.weights.volume or str(self.abs_run_dir() / "adapters")

    def replica_start_timeout_s(self) -> float:
        """How long a replica may take to report ready (`fleet.start_timeout_s`, or the engine's default)."""
        if self.fleet.start_timeout_s:
            return self.fleet.start_timeout_s
        if self.engine.backend == "vllm":
            return self.engine.vllm.start_timeout_s + VLLM_REPLICA_EXTRA_S
        return 180.0

    def most_replicas(self) -> int:
        """The most replicas the run holds at once (reserved + the on-demand pool at its largest)."""
        grown = self.autoscale.max_on_demand if self.autoscale.enabled else 0
        return max(self.fleet.max_replicas, self.fleet.reserved + max(self.fleet.on_demand, grown))

    def replica_cores(self, host_cores: int, cpu: bool) -> int:
        """Cores of its own each replica's engine binds, given out by the provider; 0 = none.

        Why: vLLM on CPU pins an OpenMP thread to every core of `engine.vllm.cpu_cores` (empty = all
        the replica may use), and replicas on one host with the same list slow each other down many
        times over (protocol/cores.py). So unless the user set the list (then every replica shares it)
        each vLLM replica on CPU gets a disjoint slice: locally all replicas share this host, so the
        slice is its cores split by the most replicas the run holds at once (ValueError if there are
        fewer cores than that); on Ray, `ray.replica_cpus` cores of the node it is placed on (Ray
        then places at most CPUs / replica_cpus replicas on a node).
        """
        if self.engine.backend != "vllm" or self.engine.vllm.cpu_cores or not cpu:
            return 0
        if self.provider == "ray":
            if self.ray.replica_cpus < 1:
                raise ValueError("engine.backend \"vllm\" on CPU with provider \"ray\": set ray.replica_cpus >= 1 "
                                 "(the cores each replica's vLLM binds; Ray then places at most CPUs / replica_cpus "
                                 "replicas on a node) or engine.vllm.cpu_cores (every replica binds that list)")
            return int(self.ray.replica_cpus)
        most = self.most_replicas()
        if most > host_cores:
            raise ValueError(f"engine.backend \"vllm\" on CPU: the run holds up to {most} replicas at once on this "
                             f"host's {host_cores} cores, and each replica's vLLM needs cores of its own (its threads "
                             "are bound to them): lower fleet.reserved + fleet.on_demand (fleet.max_replicas, "
                             "autoscale.max_on_demand), or set engine.vllm.cpu_cores (every replica then binds that "
                             "list)")
        return host_cores // most

    def router_config(self) -> RouteConfig:
        """Any free port (the launcher reads it from the ready line); replicas register as they start."""
        return self.router.model_copy(update={"port": 0, "replicas": []})

    def serve_config(self) -> ServeConfig:
        """Every replica's config: the run's model and engine, any free port, the run's volume."""
        return ServeConfig(model=self.model, engine=self.engine,
                           server=HttpServerSection(host=self.router.host, port=0), adapter_volume=self.volume())

    def train_config(self) -> TrainConfig:
        """The trainer scores tokens at the temperature the orchestrator samples at, and pushes each
        version to the replicas the launcher lists in RUN_DIR/replicas.txt."""
        weights = self.weights.model_copy(update={"volume": self.volume(), "replicas": [],
                                                  "replicas_file": str(self.abs_run_dir() / "replicas.txt")})
        return TrainConfig(run_dir=str(self.abs_run_dir()), temperature=self.orchestrator.temperature,
                           model=self.model, lora=self.lora, trainer=self.trainer, weights=weights)

    def orchestrate_config(self, router_url: str) -> OrchestrateConfig:
        """The orchestrator stops once the trainer's last step is committed."""
        return OrchestrateConfig(run_dir=str(self.abs_run_dir()), router=router_url, steps=self.trainer.steps,
                                 orchestrator=self.orchestrator)

    def role_configs(self, router_url: str) -> dict[str, Section]:
        """Each role's config by the name of its file in RUN_DIR/roles (`router_url`: the router's,
        known once it listens)."""
        return {"router": self.router_config(), "serve": self.serve_config(), "train": self.train_config(),
                "orchestrate": self.orchestrate_config(router_url)}


def check_shared_fleet(cfg: RunConfig) -> None:
    """`fleet.url` and `fleet.token` come together, the token names a tenant, and what only a run's
    own fleet can do (chaos, the autoscaler: they act on replicas the run owns) is off."""
    f = cfg.fleet
    if f.url and not f.token:
        raise ValueError("fleet.url is set but fleet.token is empty: a run on a shared fleet needs its tenant "
                         "token (burstrl fleet token NAME --key-file FLEET_DIR/tenant.key)")
    if f.token and not f.url:
        raise ValueError("fleet.token is set but fleet.url is empty: name the shared fleet's router (FLEET_DIR/"
                         "fleet.json), or drop the token to run with a fleet of the run's own")
    if not f.url.startswith(("http://", "https://")):
        raise ValueError(f"fleet.url must start with http:// or https://, got {f.url!r}")
    name, dot, mac = f.token.partition(".")
    if not dot or not mac or not TENANT_NAME.fullmatch(name):
        raise ValueError("fleet.token is not a tenant token (<tenant>.<hex>, as burstrl fleet token prints it)")
    if cfg.chaos.kill_fraction > 0:
        raise ValueError("chaos.kill_fraction: a run on a shared fleet (fleet.url) kills no replicas: they are "
                         "the fleet's")
    if cfg.autoscale.enabled:
        raise ValueError("autoscale.enabled: a run on a shared fleet (fleet.url) does not size it; the fleet "
                         "(burstrl fleet up) does")
