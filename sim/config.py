"""What a simulation runs: the model, the fleet, the engine and router settings, autoscaling, SLO and traffic.

One pydantic model, loadable from YAML/JSON (`tokenfleet simulate run --config`) or built from CLI flags.
Engine, cache and router sections *are* the runtime's own `SchedulerConfig`, `CacheConfig` and `RoutingSpec`,
so a simulated setting means what it means in a pod; the autoscaling section is the operator's
`AutoscalingSpec`. A cache field the simulator does not model is refused, naming it, rather than ignored.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from tokenfleet.operator.autoscaling_policy import AutoscalingSpec
from tokenfleet.runtime.config import CacheConfig, SchedulerConfig
from tokenfleet.runtime.router.config import RoutingSpec
from tokenfleet.sim.errors import SimInputError
from tokenfleet.sim.hardware import GPUS, gpu_profile
from tokenfleet.sim.workload import WorkloadSpec

GPU_SCHEDULER = SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=8192, max_waiting=100_000)
# The cache fields a simulated replica honours (its KVCacheManager is built from the section); the pool's
# size comes from the GPU profile and the model (`cost.num_kv_blocks`), as the engine sizes it.
MODELLED_CACHE_FIELDS = frozenset(
    {"block_size", "enable_prefix_caching", "eviction", "ttl_seconds", "max_pinned_fraction"}
)


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SLO(_Model):
    """A request is good when both hold; a fleet meets the SLO when the p99s do."""

    ttft_s: float = Field(2.0, gt=0, description="TTFT p99 bound (seconds).")
    tpot_s: float = Field(
        0.05, gt=0, description="TPOT p99 bound (seconds per output token after the first)."
    )


class FleetSpec(_Model):
    gpu: str = Field("h100-sxm", description="A GPU profile name, or `cpu` (the calibrated profile).")
    tp: int = Field(1, ge=1, le=8, description="Tensor-parallel GPUs per replica.")
    replicas: int = Field(1, ge=0, description="Replicas at t=0 (ready, no cold start).")
    weights: Literal["bfloat16", "fp8"] = "bfloat16"
    kv_cache: Literal["bfloat16", "fp8"] = "bfloat16"
    cpu_profile: Path | None = Field(None, description="`cpu`: the file `simulate calibrate` wrote.")
    cpu_kv_cache_gib: float = Field(1.0, gt=0, description="`cpu`: KV cache budget per replica.")
    cpu_shared_host: bool = Field(
        False,
        description="`cpu`: every replica runs on this one machine (as pods of a single-node test do). "
        "The profile times one engine alone; engines computing at once share the cores, so a step that "
        "starts while others run stretches by their measured core demand over the host's cores.",
    )
    price_per_gpu_hour: float | None = Field(None, ge=0, description="USD; default: the GPU's table price.")

    @model_validator(mode="after")
    def _check(self) -> FleetSpec:
        if self.gpu != "cpu":
            gpu = gpu_profile(self.gpu, "fleet.gpu")
            if self.tp > gpu.max_tp:
                raise SimInputError("fleet.tp", f"{gpu.name} allows tp <= {gpu.max_tp}, got {self.tp}")
        elif self.tp != 1:
            raise SimInputError("fleet.tp", "the cpu profile has no tensor parallelism", "1")
        if self.cpu_shared_host and self.gpu != "cpu":
            raise SimInputError(
                "fleet.cpu_shared_host", "only the cpu profile runs on a shared host", "false"
            )
        return self


class Disaggregation(_Model):
    """Prefill/decode disaggregation: the first `prefill_replicas` of `fleet.replicas` run prompts (and the
    first token), the rest generate; a prompt's KV moves between them by block hash over a link."""

    prefill_replicas: int = Field(ge=1, description="How many of fleet.replicas are prefill pods.")
    link_gb_per_s: float = Field(
        50.0, gt=0, description="KV transfer bandwidth per pod, GB/s (50: a 400 Gb/s RDMA NIC)."
    )
    transfer_latency_s: float = Field(
        0.002, ge=0, description="Fixed cost of one transfer (the fetch round trip, its setup)."
    )
    hold_seconds: float = Field(30.0, gt=0, description="How long a prefill pod holds unfetched KV.")


class LoRASpec(_Model):
    """The pods' LoRA settings, used when the workload names adapters (`workload.adapters`): how many
    adapters a pod holds, what loading one costs, the step cost of adapters in a batch, and how the router
    places an adapter's requests."""

    max_adapters: int = Field(
        8, ge=1, description="Adapters a pod holds at once (the engine's lora.max_cpu_loras, host memory)."
    )
    max_loras: int = Field(
        8,
        ge=1,
        description="Distinct adapters in one step (lora.max_loras, device slots; the scheduler's rule).",
    )
    load_s: float = Field(
        0.05,
        ge=0,
        description="Loading an adapter the pod does not hold, before its requests can be scheduled.",
    )
    step_overhead: float = Field(
        0.03,
        ge=0,
        description="A step with any adapter lasts this fraction longer (the LoRA kernels' launches) ...",
    )
    step_overhead_per_adapter: float = Field(
        0.01, ge=0, description="... plus this fraction per distinct adapter in the batch."
    )
    max_copies: int | None = Field(
        None,
        ge=1,
        description="Every adapter's maxCopies (the most pods holding it at once; the router's rule, "
        "`within_max_copies`, with `placement`); none: no bound.",
    )
    min_copies: dict[str, Annotated[int, Field(ge=0)]] = Field(
        default_factory=dict,
        description="Adapter name -> its minCopies: the operator pins it on that many Ready pods every "
        "`pin_interval_s` (operator/adapter_copies.py, a lease of a few intervals), and the router's drains "
        "never take a copy below it.",
    )
    pin_interval_s: float = Field(
        5.0, gt=0, description="The operator's adapter report period, which renews the pins."
    )
    placement: Literal["placement", "affinity", "none"] = Field(
        "placement",
        description="placement: the router's rule (the adapter's holders, spilling when they are clearly "
        "busier); affinity: the holders whenever any is below the in-flight limit (never spill); none: "
        "adapters ignored, the routing strategy alone.",
    )

    @model_validator(mode="after")
    def _check(self) -> LoRASpec:
        if self.max_loras > self.max_adapters:
            raise SimInputError(
                "lora.max_loras",
                f"{self.max_loras} slots but a pod holds {self.max_adapters} adapters (lora.max_adapters)",
                f"1..{self.max_adapters}",
            )
        return self


class SimConfig(_Model):
    model: str = Field(
        "llama-3-8b", description="A preset, a HF config.json / checkpoint directory, or a .gguf."
    )
    fleet: FleetSpec = FleetSpec()
    scheduler: SchedulerConfig = GPU_SCHEDULER
    routing: RoutingSpec = RoutingSpec(max_in_flight_per_endpoint=1024)
    cache: CacheConfig = Field(CacheConfig(), description="The pods' cache section (the fields it models).")
    autoscaling: AutoscalingSpec | None = None
    disaggregation: Disaggregation | None = None
    lora: LoRASpec = Field(LoRASpec(), description="The pods' LoRA adapters (with workload.adapters).")
    autoscale_interval_s: float = Field(15.0, gt=0)
    demand_interval_s: float | None = Field(
        1.0,
        gt=0,
        description="How often the operator reads the routers' demand (held requests, the pods' queues) "
        "between its periodic decisions, deciding at once when it calls for more (null: periodic only).",
    )
    cold_start_s: float = Field(60.0, ge=0, description="From a new replica's creation to Ready.")
    wake_s: float = Field(
        1.0,
        ge=0,
        description="A sleeping replica's wake to Ready (autoscaling.idle: sleep; level 1: a weight copy).",
    )
    start_asleep: int = Field(
        0,
        ge=0,
        description="Replicas that start asleep besides fleet.replicas (a warm pool left by earlier load).",
    )
    probe_interval_s: float = Field(0.5, gt=0, description="How often the router polls each pod's load.")
    slo: SLO = SLO()
    workload: WorkloadSpec = WorkloadSpec()
    trace: Path | None = Field(None, description="JSONL trace to replay instead of the generator.")
    timeline_points: int = Field(240, ge=2)
    breakdown: tuple[Literal["tenant", "priority"], ...] = Field(
        (),
        description="Also report the per-request figures per tenant and/or per priority "
        "(results `by_tenant`, `by_priority`).",
    )
    run_until_s: float | None = Field(None, gt=0, description="Keep the clock running (idle) until then.")
    drain_limit_s: float = Field(1800.0, gt=0, description="Stop this long after the last arrival.")

    @model_validator(mode="after")
    def _check(self) -> SimConfig:
        default = CacheConfig()
        unmodelled = [
            name
            for name in CacheConfig.model_fields
            if name not in MODELLED_CACHE_FIELDS and getattr(self.cache, name) != getattr(default, name)
        ]
        if unmodelled:
            raise SimInputError(
                f"cache.{unmodelled[0]}", "not modelled by the simulator", MODELLED_CACHE_FIELDS
            )
        if self.start_asleep and (self.autoscaling is None or self.autoscaling.idle != "sleep"):
            raise SimInputError("start_asleep", "sleeping replicas need autoscaling.idle: sleep", "0")
        if self.fleet.replicas == 0 and self.autoscaling is None:
            raise SimInputError("fleet.replicas", "0 replicas need autoscaling to ever serve anything")
        if self.workload.adapters is not None:
            if self.disaggregation is not None:
                raise SimInputError(
                    "workload.adapters", "LoRA adapters are not simulated with disaggregation"
                )
            if self.trace is not None:
                raise SimInputError("workload.adapters", "a replayed trace names no adapters")
        if self.disaggregation is not None:
            if self.autoscaling is not None:
                raise SimInputError(
                    "disaggregation", "not simulated together with autoscaling (each role scales separately)"
                )
            if self.disaggregation.prefill_replicas >= self.fleet.replicas:
                raise SimInputError(
                    "disaggregation.prefill_replicas",
                    f"{self.disaggregation.prefill_replicas} of {self.fleet.replicas} replicas leaves no decode pod",
                    f"1..{self.fleet.replicas - 1}",
                )
        return self

    @property
    def uses_adapters(self) -> bool:
        """Requests name LoRA adapters: the pods keep adapter state and the router places them."""
        return self.workload.adapters is not None

    @classmethod
    def load(cls, path: Path) -> SimConfig:
        try:
            data = yaml.safe_load(Path(path).read_text()) or {}
        except (OSError, yaml.YAMLError) as e:
            raise SimInputError("config", f"cannot read {path}: {e}") from e
        return parse_config(data)


def parse_config(data: dict) -> SimConfig:
    """Validate, turning pydantic's report into one error that names the first bad field."""
    try:
        return SimConfig.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        field = ".".join(str(p) for p in err["loc"]) or "config"
        raise SimInputError(field, err["msg"]) from None


GPU_NAMES = (*GPUS, "cpu")
