"""The three custom resources as pydantic models: the one schema the CRDs, the operator and the docs share.

Group `serving.tokenfleet.dev`, version `v1alpha1`. Field names are camelCase on the wire (aliases) and
snake_case in Python. `crdgen.py` turns these models into structural OpenAPI schemas, so every description
here is what `kubectl explain` shows; rules the schema can express are also emitted as CEL
(`CEL_RULES`), and `validate_*` re-checks them in the operator because a CRD may be installed without
them (or edited by hand).

RoutingPolicy's spec *is* the router's `RoutingSpec` (runtime/router/config.py): the operator copies it
verbatim into the router's config file, so the two can never disagree.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic.alias_generators import to_camel
from tokenfleet.runtime.errors import ConfigError
from tokenfleet.runtime.router.config import RoutingSpec

GROUP = "serving.tokenfleet.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
DEFAULT_IMAGE = "ghcr.io/tokenfleet/tokenfleet:0.1.0"

# Model sources: a built-in name, `pvc://CLAIM/PATH`, `file:///HOST/PATH` (hostPath, development) or
# `hf://ORG/NAME[@REVISION]` (downloaded by an init container; needs network access from the pod).
SOURCE_PATTERN = (
    r"^(pvc://[a-z0-9]([-a-z0-9]*[a-z0-9])?/.+|file:///.+|hf://[A-Za-z0-9._-]+/[A-Za-z0-9._-]+(@[A-Za-z0-9._/-]+)?"
    r"|[A-Za-z0-9][A-Za-z0-9._-]*)$"
)
_SOURCE_RE = re.compile(SOURCE_PATTERN)
# Kubernetes object names (RFC 1123 subdomain, shortened: child names add suffixes).
REF_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, alias_generator=to_camel, populate_by_name=True)


# --------------------------------------------------------------------------------------------- ModelDeployment
class ModelSpec(_Spec):
    """Which model the runtime pods serve and how it is loaded."""

    source: str = Field(
        "smollm2-135m-instruct",
        pattern=SOURCE_PATTERN,
        description="Built-in model name, pvc://CLAIM/PATH (a .gguf file or HF directory on a PVC), "
        "file:///PATH (hostPath, development only) or hf://ORG/NAME[@REVISION] (init-container download).",
    )
    served_name: str | None = Field(
        None, description="Name clients send as `model`; defaults to the source name."
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Compute dtype; auto = float32 on CPU, bfloat16 on GPU."
    )
    quantization: Literal["none", "fp8"] = Field(
        "none", description="Weight quantization applied at load time."
    )
    max_model_len: int | None = Field(None, gt=0, description="Context length; defaults to the model's.")


class Resources(_Spec):
    """Per-replica compute. GPUs become `nvidia.com/gpu` limits; memory is both request and limit."""

    gpus: int = Field(0, ge=0, le=64, description="GPUs per replica; a multiple of tensorParallelSize.")
    cpu: str = Field("2", pattern=r"^[0-9]+(\.[0-9]+)?m?$", description="CPU request (Kubernetes quantity).")
    memory: str = Field(
        "4Gi", pattern=r"^[0-9]+(\.[0-9]+)?([KMGTPE]i?)?$", description="Memory request and limit (quantity)."
    )


class Speculative(_Spec):
    """Speculative decoding; `none` turns it off."""

    method: Literal["none", "ngram", "draft", "self"] = "none"
    num_speculative_tokens: int = Field(3, ge=1, le=16, description="Draft tokens proposed per step.")
    draft_model: str | None = Field(None, description="`draft`: the draft model's source.")


class Engine(_Spec):
    """Scheduler limits of each runtime pod."""

    max_num_seqs: int = Field(64, gt=0, description="Most requests running in one step.")
    max_num_batched_tokens: int = Field(1024, gt=0, description="Token budget of one step (chunked prefill).")
    max_waiting: int = Field(256, ge=0, description="Bounded waiting queue; beyond it requests get 429.")
    speculative: Speculative = Speculative()


class ModelDeploymentSpec(_Spec):
    model: ModelSpec = ModelSpec()
    replicas: int = Field(1, ge=0, le=1000, description="Runtime pods; `kubectl scale md/NAME` sets it.")
    resources: Resources = Resources()
    tensor_parallel_size: int = Field(1, ge=1, le=64, description="GPUs one model instance is sharded over.")
    engine: Engine = Engine()
    cache_policy_ref: str | None = Field(
        None, pattern=REF_PATTERN, max_length=63, description="CachePolicy (same namespace) for the KV cache."
    )
    routing_policy_ref: str | None = Field(
        None, pattern=REF_PATTERN, max_length=63, description="RoutingPolicy whose router sends traffic here."
    )
    image: str = Field(DEFAULT_IMAGE, min_length=1, description="Image holding the `tokenfleet` command.")

    @model_validator(mode="after")
    def _check(self) -> ModelDeploymentSpec:
        tp, gpus = self.tensor_parallel_size, self.resources.gpus
        if tp > 1 and (gpus < tp or gpus % tp):
            raise ValueError(
                f"tensorParallelSize {self.tensor_parallel_size} must divide resources.gpus "
                f"({self.resources.gpus}) and needs at least that many GPUs"
            )
        if self.model.quantization == "fp8" and self.resources.gpus == 0:
            raise ValueError("model.quantization fp8 needs GPUs (resources.gpus > 0)")
        if self.engine.speculative.method == "draft" and not self.engine.speculative.draft_model:
            raise ValueError("engine.speculative.method draft needs engine.speculative.draftModel")
        return self


# ------------------------------------------------------------------------------------------------- CachePolicy
class PrefixCaching(_Spec):
    enabled: bool = Field(True, description="Reuse KV blocks of shared prompt prefixes.")
    ttl_seconds: float | None = Field(
        None, gt=0, description="Unreferenced cached blocks older than this go first."
    )
    eviction: Literal["lru", "lfu", "s3fifo"] = Field("lru", description="Eviction order of cached blocks.")


class CpuOffload(_Spec):
    enabled: bool = False
    size_gib: float = Field(0.0, ge=0, alias="sizeGiB", description="Host-memory tier for evicted KV blocks.")


class CachePolicySpec(_Spec):
    block_size: Literal[8, 16, 32, 64, 128] = Field(16, description="Tokens per KV block.")
    prefix_caching: PrefixCaching = PrefixCaching()
    kv_cache_dtype: Literal["auto", "fp8_e4m3"] = Field(
        "auto", description="fp8_e4m3 halves KV memory (GPU)."
    )
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1, description="GPU: fraction of device memory used.")
    cpu_kv_cache_gib: float = Field(
        1.0, gt=0, alias="cpuKVCacheGiB", description="CPU: KV cache budget in GiB."
    )
    cpu_offload: CpuOffload = CpuOffload()
    pinned_prefixes: tuple[str, ...] = Field((), description="Prompt prefixes kept cached (system prompts).")
    max_pinned_fraction: float = Field(
        0.25, ge=0, le=1, description="Most of the cache pinned prefixes may hold."
    )
    cache_salt: str | None = Field(None, description="Mixed into block hashes: isolates tenants' caches.")

    @model_validator(mode="after")
    def _check(self) -> CachePolicySpec:
        if self.cpu_offload.enabled and self.cpu_offload.size_gib <= 0:
            raise ValueError("cpuOffload.enabled needs cpuOffload.sizeGiB > 0")
        return self


# ------------------------------------------------------------------------------------------------ status shapes
class Condition(_Spec):
    type: str
    status: Literal["True", "False", "Unknown"]
    reason: str = ""
    message: str = ""
    last_transition_time: str | None = None
    observed_generation: int | None = None


Phase = Literal["Pending", "Progressing", "Ready", "Degraded", "Failed"]


class ModelDeploymentStatus(_Spec):
    phase: Phase | None = None
    replicas: int | None = Field(None, description="Runtime pods the Deployment has (scale subresource).")
    ready_replicas: int | None = None
    selector: str | None = Field(None, description="Label selector of the pods (scale subresource).")
    endpoint: str | None = Field(None, description="URL of the Service in front of the pods.")
    config_hash: str | None = Field(None, description="Hash of the restart-requiring runtime config.")
    observed_generation: int | None = None
    conditions: tuple[Condition, ...] = ()


class PolicyStatus(_Spec):
    observed_generation: int | None = None
    used_by: tuple[str, ...] = Field((), description="ModelDeployments referencing this policy.")
    endpoint: str | None = Field(None, description="RoutingPolicy: URL of the router Service.")
    conditions: tuple[Condition, ...] = ()


# ---------------------------------------------------------------------------------------------------- registry
# Lists whose items are unique by key (`x-kubernetes-list-type: map`): the API server rejects duplicates and
# server-side apply merges them item by item.
LIST_MAP_KEYS: dict[str, dict[str, list[str]]] = {
    "RoutingPolicy": {"priorityClasses": ["name"], "modelRoutes": ["model"]},
}

# CEL rules per schema path (dotted, camelCase; "" = the spec itself). The operator checks the same rules in
# the validators above, so a cluster without CEL still reports them (as a condition instead of a rejection).
CEL_RULES: dict[str, dict[str, list[dict[str, str]]]] = {
    "ModelDeployment": {
        "": [
            {
                "rule": "!has(self.tensorParallelSize) || self.tensorParallelSize == 1 || "
                "(has(self.resources) && has(self.resources.gpus) && self.resources.gpus >= self.tensorParallelSize "
                "&& self.resources.gpus % self.tensorParallelSize == 0)",
                "message": "tensorParallelSize must divide resources.gpus (and needs at least that many GPUs)",
            },
            {
                "rule": "!has(self.model) || !has(self.model.quantization) || self.model.quantization != 'fp8' || "
                "(has(self.resources) && has(self.resources.gpus) && self.resources.gpus > 0)",
                "message": "model.quantization fp8 needs GPUs (resources.gpus > 0)",
            },
        ],
    },
    "CachePolicy": {
        "cpuOffload": [
            {
                "rule": "!has(self.enabled) || !self.enabled || (has(self.sizeGiB) && self.sizeGiB > 0.0)",
                "message": "cpuOffload.enabled needs cpuOffload.sizeGiB > 0",
            }
        ],
    },
}

KINDS: dict[str, dict[str, Any]] = {
    "ModelDeployment": {
        "plural": "modeldeployments",
        "short": ["md"],
        "spec": ModelDeploymentSpec,
        "status": ModelDeploymentStatus,
    },
    "CachePolicy": {
        "plural": "cachepolicies",
        "short": ["cp"],
        "spec": CachePolicySpec,
        "status": PolicyStatus,
    },
    "RoutingPolicy": {
        "plural": "routingpolicies",
        "short": ["rp"],
        "spec": RoutingSpec,
        "status": PolicyStatus,
    },
}


def _parse(model: type[BaseModel], kind: str, spec: dict[str, Any] | None) -> Any:
    try:
        return model.model_validate(dict(spec or {}))
    except ValidationError as e:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or 'spec'}: {err['msg'].removeprefix('Value error, ')}"
            for err in e.errors()
        )
        raise ConfigError(f"invalid {kind} spec: {problems}") from e


def parse_model_deployment(spec: dict[str, Any] | None) -> ModelDeploymentSpec:
    return _parse(ModelDeploymentSpec, "ModelDeployment", spec)


def parse_cache_policy(spec: dict[str, Any] | None) -> CachePolicySpec:
    return _parse(CachePolicySpec, "CachePolicy", spec)


def parse_routing_policy(spec: dict[str, Any] | None) -> RoutingSpec:
    return _parse(RoutingSpec, "RoutingPolicy", spec)


def source_kind(source: str) -> Literal["builtin", "pvc", "hostpath", "hf"]:
    """Which of the four source forms `source` is (it already matched SOURCE_PATTERN)."""
    if not _SOURCE_RE.match(source):
        raise ConfigError(f"model.source {source!r} is not a built-in name, pvc://, file:/// or hf:// URL")
    for prefix, kind in (("pvc://", "pvc"), ("file://", "hostpath"), ("hf://", "hf")):
        if source.startswith(prefix):
            return kind  # type: ignore[return-value]
    return "builtin"
