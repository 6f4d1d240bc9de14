"""The three custom resources as pydantic models: the one schema the CRDs, the operator and the docs share.

Group `serving.tokenfleet.dev`, version `v1alpha1`. Field names are camelCase on the wire (aliases) and
snake_case in Python. `crdgen.py` turns these models into structural OpenAPI schemas, so every description
here is what `kubectl explain` shows; rules the schema can express are also emitted as CEL
(`CEL_RULES`), and `validate_*` re-checks them in the operator because a CRD may be installed without
them (or edited by hand).

Fields the runtime pods also have are declared with `runtime_field("section.name")` (runtime_fields.py):
their type, constraints and default come from `RuntimeConfig`, and builders.py copies each one to the same
path, so a runtime default or enum cannot drift from the CRD and no mapping is written by hand.
RoutingPolicy's spec *is* the router's `RoutingSpec` (runtime/router/config.py): the operator copies it
verbatim into the router's config file, so the two can never disagree.
"""

from __future__ import annotations

import ipaddress
import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic.alias_generators import to_camel
from tokenfleet.operator.autoscaling_policy import AutoscalingSpec
from tokenfleet.operator.runtime_fields import runtime_field
from tokenfleet.runtime.errors import ConfigError
from tokenfleet.runtime.router.config import RoutingSpec, SecretKeyRef

GROUP = "serving.tokenfleet.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
DEFAULT_IMAGE = "ghcr.io/tokenfleet/tokenfleet:0.1.0"

# A Hugging Face Hub repository, `hf://ORG/NAME[@REVISION]` (a branch, tag or commit; default main),
# unanchored: the one grammar a model's and an adapter's hf:// sources share.
HF_SOURCE_PATTERN = r"hf://[A-Za-z0-9._-]+/[A-Za-z0-9._-]+(@[A-Za-z0-9._/-]+)?"
# Model sources: a built-in name, `pvc://CLAIM/PATH`, `file:///HOST/PATH` (hostPath, development) or
# `hf://ORG/NAME[@REVISION]` (downloaded by an init container; needs network access from the pod).
SOURCE_PATTERN = (
    rf"^(pvc://[a-z0-9]([-a-z0-9]*[a-z0-9])?/.+|file:///.+|{HF_SOURCE_PATTERN}"
    r"|[A-Za-z0-9][A-Za-z0-9._-]*)$"
)
_SOURCE_RE = re.compile(SOURCE_PATTERN)
# The Hub (or a mirror of it) hf:// sources are downloaded from: the model's and the adapters'.
HF_ENDPOINT_PATTERN = r"^https?://[^\s]+$"
HF_ENDPOINT_MAX_LENGTH = 512
# Bounds of replicas and of the autoscaler's windows (a window longer than an hour is a typo, not a policy).
MAX_REPLICAS = 1000
MAX_WINDOW_SECONDS = 3600.0
MAX_SCALE_TO_ZERO_SECONDS = 86400.0
# Kubernetes object names (RFC 1123 subdomain, shortened: child names add suffixes).
REF_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
# The node's model cache (`model.nodeCache`): a hostPath directory on every node (the operator's
# `--node-cache-dir`, an administrator's choice, never a user's), mounted at this path in the pods. It must
# be writable by uid 1000 (the pods' user): a directory the kubelet creates for a hostPath is root's.
NODE_CACHE_DIR = "/var/cache/tokenfleet"


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, alias_generator=to_camel, populate_by_name=True)


# --------------------------------------------------------------------------------------------- ModelDeployment
class SecretEntry(_Spec):
    """One entry of a Secret in the resource's namespace."""

    name: str = Field(pattern=REF_PATTERN, max_length=253, description="The Secret's name.")
    key: str = Field("token", min_length=1, description="Its entry.")


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
    hf_token_secret: SecretEntry | None = Field(
        None,
        description="hf:// only: a Secret entry holding a Hugging Face token (gated or private models), given "
        "to the download as HF_TOKEN (never to the serving container).",
    )
    cache_claim: str | None = Field(
        None,
        pattern=REF_PATTERN,
        max_length=253,
        description="hf:// only: a PersistentVolumeClaim the download goes into (hf/ORG/NAME/COMMIT on it) "
        "instead of an emptyDir lost with every pod: a pod whose files are already there (ReadWriteMany "
        "storage, or one claim per node) downloads nothing.",
    )
    node_cache: bool = Field(
        False,
        description="hf:// only: download into the node's model cache (a hostPath the operator's "
        f"--node-cache-dir names, default {NODE_CACHE_DIR}, writable by uid 1000), shared by every pod on "
        "the node: the second pod of a model on a node downloads nothing. Entries are verified by digest "
        "before use. Not with cacheClaim.",
    )
    hf_endpoint: str | None = Field(
        None,
        pattern=HF_ENDPOINT_PATTERN,
        max_length=HF_ENDPOINT_MAX_LENGTH,
        description="hf:// only: the Hub (or a mirror of it) to download from, given to the download as "
        "HF_ENDPOINT; default https://huggingface.co.",
    )

    @model_validator(mode="after")
    def _check_hf_fields(self) -> ModelSpec:
        if not self.source.startswith("hf://"):
            fields = (
                ("hfTokenSecret", self.hf_token_secret),
                ("cacheClaim", self.cache_claim),
                ("nodeCache", self.node_cache),
                ("hfEndpoint", self.hf_endpoint),
            )
            given = [f for f, v in fields if v]
            if given:
                raise ValueError(f"model.{given[0]}: only an hf:// source is downloaded")
        if self.node_cache and self.cache_claim:
            raise ValueError("model.nodeCache and model.cacheClaim: the download goes to one cache, not both")
        return self

    dtype: runtime_field("model.dtype", "Compute dtype; auto = float32 on CPU, bfloat16 on GPU.")
    quantization: runtime_field("model.quantization", "Weight quantization applied at load time.")
    max_model_len: runtime_field("model.max_model_len", "Context length; defaults to the model's.")
    context_overflow: runtime_field(
        "model.context_overflow",
        "A prompt past the context: reject (400) or truncate (chat keeps the system message and the most "
        "recent whole turns; completions drop from the left).",
    )
    generation_config: runtime_field(
        "model.generation_config",
        "auto: requests that leave temperature/top-p/top-k unset use the checkpoint's generation defaults.",
    )
    default_max_tokens: runtime_field(
        "model.default_max_tokens",
        "Bounds the output of requests that set no max_tokens (unset: up to the context, as OpenAI).",
    )


# An adapter's files: a folder on a PersistentVolumeClaim, on the node (development only), or a Hub
# repository each pod downloads itself when it first needs it (the model's hf:// grammar).
ADAPTER_SOURCE_PATTERN = rf"^(pvc://[a-z0-9]([-a-z0-9]*[a-z0-9])?/[^\s]+|file:///[^\s]*|{HF_SOURCE_PATTERN})$"


class Adapter(_Spec):
    """A PEFT LoRA adapter (adapter_config.json + adapter_model.safetensors) served on top of the model."""

    name: str = Field(
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._:/-]*$",
        max_length=128,
        description="The `model` clients send to use the adapter.",
    )
    source: str = Field(
        pattern=ADAPTER_SOURCE_PATTERN,
        max_length=1024,
        description="pvc://CLAIM/PATH (a folder on a PersistentVolumeClaim), file:///PATH (hostPath, "
        "development only) or hf://ORG/NAME[@REVISION] (a Hugging Face Hub repository). Adding or removing "
        "an adapter on a claim the pods already mount applies live (no restart); a new claim or path changes "
        "the pods' volumes, which rolls them. An hf:// adapter needs no volume: each pod downloads it when it "
        "first needs it, into its own cache (verified by digest), from lora.hfEndpoint; a branch or tag is "
        "resolved to its commit once per pod, so pin a commit for identical weights on every pod. Adding or "
        "removing one applies live.",
    )
    min_copies: int = Field(
        0,
        ge=0,
        le=MAX_REPLICAS,
        description="Pods that keep it loaded whatever requests come (at most the Ready pods there are): the "
        "operator pins it on that many, those holding it first, and renews the pins every few seconds; a "
        "pinned copy is never evicted for another adapter nor drained by the routers. For an adapter whose "
        "first request must not wait for a load. With more adapters listed than lora.maxCpuLoras, one place "
        "per pod always stays unpinned.",
    )
    max_copies: int | None = Field(
        None,
        ge=1,
        le=MAX_REPLICAS,
        description="The most pods holding it at once: while that many do, the routers send its requests only "
        "to them, however busy (no spill loads another copy). Default: no bound.",
    )

    @model_validator(mode="after")
    def _check_copies(self) -> Adapter:
        if self.max_copies is not None and self.min_copies > self.max_copies:
            raise ValueError(
                f"adapters {self.name!r}: minCopies ({self.min_copies}) is more than maxCopies ({self.max_copies})"
            )
        return self


class LoRASettings(_Spec):
    """How the pods serve `adapters` (vLLM's --max-loras, --max-lora-rank, --max-cpu-loras)."""

    max_loras: runtime_field("lora.max_loras")
    max_lora_rank: runtime_field("lora.max_lora_rank")
    max_cpu_loras: runtime_field(
        "lora.max_cpu_loras",
        "Adapters loaded at once per pod (host memory); default: every listed adapter, at least maxLoras. "
        "Fewer than listed: each pod loads an adapter when a request first needs it there, and the routers "
        "keep an adapter's requests on the pods that hold it.",
    )
    hf_endpoint: str | None = Field(
        None,
        pattern=HF_ENDPOINT_PATTERN,
        max_length=HF_ENDPOINT_MAX_LENGTH,
        description="The Hub (or a mirror of it) hf:// adapters are downloaded from, given to the serving "
        "container as HF_ENDPOINT; default: model.hfEndpoint when set, else https://huggingface.co.",
    )
    hf_token_secret: SecretEntry | None = Field(
        None,
        description="A Secret entry given to the serving container as HF_TOKEN, for private hf:// adapters. "
        "model.hfTokenSecret is never given to the serving container (only to the model's download), so it "
        "is not used for adapters.",
    )


class Resources(_Spec):
    """Per-replica compute. GPUs become `nvidia.com/gpu` limits; memory is both request and limit."""

    gpus: int = Field(
        0, ge=0, le=64, description="GPUs per replica (0 = CPU); a multiple of tensorParallelSize."
    )
    cpu: str = Field(
        "2",
        pattern=r"^[0-9]+(\.[0-9]+)?m?$",
        description="CPU request (Kubernetes quantity). A CPU pod (gpus 0) also runs this many torch threads "
        "(OMP_NUM_THREADS, rounded down, at least 1) instead of one per core of the node.",
    )
    memory: str = Field(
        "4Gi", pattern=r"^[0-9]+(\.[0-9]+)?([KMGTPE]i?)?$", description="Memory request and limit (quantity)."
    )


class Speculative(_Spec):
    """Speculative decoding; `none` turns it off."""

    method: runtime_field("speculative.method", "How draft tokens are proposed.")
    num_speculative_tokens: runtime_field(
        "speculative.num_speculative_tokens", "Draft tokens proposed per step."
    )
    draft_model: runtime_field("speculative.draft_model", "`draft`: the draft model's source.")


class Engine(_Spec):
    """Scheduler limits of each runtime pod, and how its streams are cut into events."""

    max_num_seqs: runtime_field("scheduler.max_num_seqs")
    max_num_batched_tokens: runtime_field("scheduler.max_num_batched_tokens")
    max_waiting: runtime_field("scheduler.max_waiting")
    scheduling_policy: runtime_field("scheduler.policy")
    fair_share: runtime_field("scheduler.fair_share")
    stream_interval: runtime_field("server.stream_interval")
    speculative: Speculative = Speculative()


class Metrics(_Spec):
    """What the runtime pods' /metrics looks like."""

    naming: runtime_field(
        "metrics.naming",
        "tokenfleet: our `tokenfleet:*` names; vllm: vLLM's `vllm:*` names, types and labels, for endpoint "
        "pickers, KEDA/Prometheus rules and dashboards written for vLLM.",
    )


class EndpointPicker(_Spec):
    """The endpoint picker (Gateway API Inference Extension) the InferencePool delegates to."""

    name: str | None = Field(
        None, pattern=REF_PATTERN, max_length=253, description="Referent's name; defaults to `<name>-epp`."
    )
    kind: str = Field("Service", pattern=r"^[a-zA-Z]([-a-zA-Z0-9]*[a-zA-Z0-9])?$", max_length=63)
    group: str = Field(
        "",
        max_length=253,
        pattern=r"^$|^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$",
        description='API group of the referent; "" = core.',
    )
    port: int = Field(9002, ge=1, le=65535, description="The picker's gRPC port (a Service port).")
    failure_mode: Literal["FailOpen", "FailClose"] = Field(
        "FailClose", description="What the gateway does when the picker does not answer."
    )


class InferencePoolSettings(_Spec):
    """An InferencePool (inference.networking.k8s.io/v1) over the pods, when that CRD is installed."""

    enabled: bool = Field(True, description="Create the InferencePool `<name>` (only if the CRD exists).")
    endpoint_picker: EndpointPicker = EndpointPicker()


class LabelSelectorRequirement(_Spec):
    key: str = Field(min_length=1, max_length=317)
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist"]
    values: tuple[str, ...] = Field((), description="For In and NotIn; empty for Exists and DoesNotExist.")

    @model_validator(mode="after")
    def _check(self) -> LabelSelectorRequirement:
        if (self.operator in ("In", "NotIn")) != bool(self.values):
            raise ValueError(
                f"operator {self.operator} {'needs' if self.values == () else 'takes no'} values"
            )
        return self


class LabelSelector(_Spec):
    """A Kubernetes label selector; empty selects everything in its scope."""

    match_labels: dict[str, str] = {}
    match_expressions: tuple[LabelSelectorRequirement, ...] = ()


class IPBlock(_Spec):
    cidr: str = Field(description="A CIDR, e.g. 10.0.0.0/16 or 2001:db8::/48.")
    except_: tuple[str, ...] = Field((), alias="except", description="CIDRs inside `cidr` to leave out.")

    @model_validator(mode="after")
    def _check(self) -> IPBlock:
        network = _cidr(self.cidr, "cidr")
        for i, sub in enumerate(self.except_):
            inner = _cidr(sub, f"except[{i}]")
            if inner.version != network.version or not inner.subnet_of(network):  # type: ignore[arg-type]
                raise ValueError(f"except[{i}] {sub} is not inside cidr {self.cidr}")
        return self


def _cidr(text: str, at: str) -> ipaddress.IPv4Network | ipaddress.IPv6Network:
    try:
        return ipaddress.ip_network(text, strict=False)
    except ValueError:
        raise ValueError(f"{at} {text!r} is not a CIDR (e.g. 10.0.0.0/16)") from None


PEER_RULE = "podSelector and/or namespaceSelector, or ipBlock alone"


class NetworkPolicyPeer(_Spec):
    """Who may connect, as in a NetworkPolicy's `from`: pods (of this namespace, or of the namespaces
    `namespaceSelector` picks), every pod of some namespaces, or an IP range."""

    pod_selector: LabelSelector | None = None
    namespace_selector: LabelSelector | None = None
    ip_block: IPBlock | None = None

    @model_validator(mode="after")
    def _check(self) -> NetworkPolicyPeer:
        selectors = self.pod_selector is not None or self.namespace_selector is not None
        if selectors == (self.ip_block is not None):
            raise ValueError(f"set {PEER_RULE}")
        return self


class NetworkPolicySettings(_Spec):
    """A NetworkPolicy `<name>` admitting to the runtime pods (port 8000) only: the routers of its
    RoutingPolicy, its other role's pods (disaggregated: KV transfer), the operator (it scrapes /metrics),
    the gateway and endpoint picker while `inferencePool.enabled`, the monitoring namespaces, and
    `allowFrom`. Enforced only where the cluster's network plugin implements NetworkPolicies."""

    enabled: bool = Field(True, description="Write the NetworkPolicy; false removes it (pods open to all).")
    allow_from: tuple[NetworkPolicyPeer, ...] = Field(
        (), max_length=32, description="More peers allowed in (NetworkPolicyPeer: selectors or an ipBlock)."
    )
    monitoring_namespaces: tuple[Annotated[str, Field(pattern=REF_PATTERN, max_length=63)], ...] = Field(
        ("monitoring",),
        max_length=16,
        description="Namespaces whose pods may scrape /metrics (Prometheus); [] for none.",
    )
    gateway_from: tuple[NetworkPolicyPeer, ...] | None = Field(
        None,
        max_length=32,
        description="While inferencePool.enabled: the gateway's data-plane pods and the endpoint picker. "
        "Default: pods labelled gateway.networking.k8s.io/gateway-name in any namespace (what Gateway API "
        "implementations label the gateway pods they deploy with) and this namespace's pods labelled "
        "`inferencepool: <endpoint picker name>` (the Inference Extension chart's picker).",
    )


class DisaggregationRole(_Spec):
    """The pods of one role of a disaggregated deployment; unset fields take the deployment's values."""

    replicas: int = Field(
        1,
        ge=0,
        le=MAX_REPLICAS,
        description="Pods of this role (the autoscaler sets it while this role's autoscaling is set).",
    )
    resources: Resources | None = Field(None, description="Per-pod compute; default: the deployment's.")
    engine: Engine | None = Field(None, description="Scheduler limits; default: the deployment's.")
    autoscaling: AutoscalingSpec | None = Field(
        None,
        description="Size this role from what its own pods report, as spec.autoscaling sizes an aggregated "
        "deployment: prefill pods by their queue (waitingRequestsPerReplica) and TTFT, decode pods by KV-cache "
        "usage, queue and tokens/s. While set, the autoscaler owns this role's `replicas`.",
    )


class Disaggregation(_Spec):
    """Prefill/decode disaggregation: prompts run on the prefill pods, generation on the decode pods, and the
    KV moves between them by block hash. Each role is its own Deployment and Service (role label
    `tokenfleet.io/role`); a router in front learns the roles from its backends."""

    prefill: DisaggregationRole = DisaggregationRole()
    decode: DisaggregationRole = DisaggregationRole()


class ModelDeploymentSpec(_Spec):
    model: ModelSpec = ModelSpec()
    replicas: int = Field(
        1,
        ge=0,
        le=MAX_REPLICAS,
        description="Runtime pods; `kubectl scale md/NAME` sets it (the autoscaler does, while autoscaling is set).",
    )
    autoscaling: AutoscalingSpec | None = Field(
        None,
        description="Size the fleet from what the pods report (queue, KV cache, TTFT, tokens/s). While set, the "
        "operator's autoscaler owns `replicas`, as an HPA would: a manual scale is undone at its next decision.",
    )
    resources: Resources = Resources()
    tensor_parallel_size: runtime_field(
        "parallel.tensor_parallel_size",
        "Devices one model instance is sharded over: worker processes per pod, each on its own GPU when "
        "resources.gpus > 0 (which must then be a multiple of it), else on CPU.",
    )
    engine: Engine = Engine()
    adapters: list[Adapter] = Field(
        default_factory=list,
        max_length=256,
        description="LoRA adapters every runtime pod serves beside the model, each under its own name.",
    )
    lora: LoRASettings = LoRASettings()
    disaggregation: Disaggregation | None = Field(
        None, description="Split prefill and decode into two Deployments; `replicas` is then unused."
    )
    metrics: Metrics = Metrics()
    inference_pool: InferencePoolSettings = InferencePoolSettings()
    network_policy: NetworkPolicySettings = NetworkPolicySettings()
    cache_policy_ref: str | None = Field(
        None, pattern=REF_PATTERN, max_length=63, description="CachePolicy (same namespace) for the KV cache."
    )
    routing_policy_ref: str | None = Field(
        None, pattern=REF_PATTERN, max_length=63, description="RoutingPolicy whose router sends traffic here."
    )
    image: str = Field(DEFAULT_IMAGE, min_length=1, description="Image holding the `tokenfleet` command.")
    api_key_secret: SecretKeyRef | None = Field(
        None,
        description="Secret (same namespace) entry listing the API keys the pods require, one per line; "
        "mounted as a file, so a rotation applies without restarting the pods.",
    )

    @model_validator(mode="after")
    def _check(self) -> ModelDeploymentSpec:
        tp, gpus = self.tensor_parallel_size, self.resources.gpus
        if gpus and gpus % tp:
            raise ValueError(f"tensorParallelSize {tp} must divide resources.gpus ({gpus})")
        if self.model.quantization == "fp8" and self.resources.gpus == 0:
            raise ValueError("model.quantization fp8 needs GPUs (resources.gpus > 0)")
        if self.engine.speculative.method == "draft" and not self.engine.speculative.draft_model:
            raise ValueError("engine.speculative.method draft needs engine.speculative.draftModel")
        names = [a.name for a in self.adapters]
        if len(set(names)) != len(names):
            raise ValueError(f"adapters: names must be unique, got {names}")
        limit = self.lora.max_cpu_loras
        if limit is not None and limit < self.lora.max_loras:
            raise ValueError(f"lora.maxCpuLoras ({limit}) must be >= lora.maxLoras ({self.lora.max_loras})")
        if self.autoscaling is not None:
            if self.disaggregation is not None:
                raise ValueError(
                    "autoscaling: a disaggregated deployment scales each role on its own signals: set "
                    "disaggregation.prefill.autoscaling and/or disaggregation.decode.autoscaling instead"
                )
            _check_autoscaling(self.autoscaling, self.routing_policy_ref)
        if self.disaggregation is not None:
            for role in ("prefill", "decode"):
                a = getattr(self.disaggregation, role).autoscaling
                if a is None:
                    continue
                # Nothing would bring a role back from zero: the router never holds requests for a prefill
                # pod (without one the decode pod computes the prompt) and sends every request to the
                # prefill pods first while some are up (so it holds none for a decode pod).
                if a.min_replicas < 1:
                    raise ValueError(f"disaggregation.{role}.autoscaling.minReplicas must be >= 1")
                # The router wakes a sleeping pod for the requests it holds, and it holds none for a role.
                if a.idle == "sleep":
                    raise ValueError(
                        f"disaggregation.{role}.autoscaling.idle: sleep is for aggregated deployments"
                    )
                _check_autoscaling(a, self.routing_policy_ref, f"disaggregation.{role}.autoscaling")
        return self


def _check_autoscaling(a: AutoscalingSpec, routing_policy_ref: str | None, at: str = "autoscaling") -> None:
    """The rules AutoscalingSpec leaves to the resource (the CEL rules below say the same)."""
    if a.max_replicas > MAX_REPLICAS:
        raise ValueError(f"{at}.maxReplicas must be <= {MAX_REPLICAS} (the bound of replicas)")
    if a.targets.ttft is not None and a.targets.ttft.window_seconds > MAX_WINDOW_SECONDS:
        raise ValueError(f"{at}.targets.ttft.windowSeconds must be <= {MAX_WINDOW_SECONDS:.0f}")
    if a.scale_to_zero_after_seconds > MAX_SCALE_TO_ZERO_SECONDS:
        raise ValueError(f"{at}.scaleToZeroAfterSeconds must be <= {MAX_SCALE_TO_ZERO_SECONDS:.0f}")
    # At zero there is no pod to take a request: only a router holds it and tells the operator to scale up.
    if a.min_replicas == 0 and not routing_policy_ref:
        raise ValueError(
            "autoscaling.minReplicas 0 needs routingPolicyRef (the router holds requests at zero)"
        )


# ------------------------------------------------------------------------------------------------- CachePolicy
class PrefixCaching(_Spec):
    enabled: runtime_field("cache.enable_prefix_caching", "Reuse KV blocks of shared prompt prefixes.")
    ttl_seconds: runtime_field("cache.ttl_seconds")
    eviction: runtime_field("cache.eviction", "Eviction order of cached blocks.")


class CpuOffload(_Spec):
    enabled: bool = False
    # Not copied as is: the runtime's size 0 means "off", so builders.py sets it only when enabled.
    size_gib: float = Field(0.0, ge=0, alias="sizeGiB", description="Host-memory tier for evicted KV blocks.")


class CachePolicySpec(_Spec):
    block_size: runtime_field("cache.block_size")
    prefix_caching: PrefixCaching = PrefixCaching()
    kv_cache_dtype: runtime_field("cache.kv_cache_dtype", "fp8_e4m3 halves KV memory (GPU).")
    gpu_memory_utilization: runtime_field("cache.gpu_memory_utilization", "GPU: fraction of device memory.")
    cpu_kv_cache_gib: runtime_field("cache.cpu_kv_cache_gib", alias="cpuKVCacheGiB")
    cpu_offload: CpuOffload = CpuOffload()
    # Texts only: the runtime also takes token-id lists from files, which a structural schema cannot union.
    pinned_prefixes: runtime_field(
        "cache.pinned_prefixes", "Prompt prefixes kept cached (system prompts).", annotation=tuple[str, ...]
    )
    max_pinned_fraction: runtime_field(
        "cache.max_pinned_fraction", "Most of the cache pinned prefixes may hold."
    )
    cache_salt: runtime_field("cache.cache_salt", "Mixed into block hashes: isolates tenants' caches.")

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


class ScaleRecommendation(_Spec):
    time: str = Field(description="When (RFC 3339, microseconds).")
    replicas: int


class AutoscalingHistory(_Spec):
    """What the policy remembers between decisions: kept here so a restarted operator decides the same."""

    recommendations: tuple[ScaleRecommendation, ...] = Field(
        (), max_length=256, description="Recommendations inside the stabilisation windows (runs merged)."
    )
    last_scale_up_time: str | None = None
    last_scale_down_time: str | None = None
    last_traffic_time: str | None = None


class AutoscalingStatus(_Spec):
    """The autoscaler's latest decision and the signals it was made from."""

    desired_replicas: int | None = Field(
        None, description="Replicas the autoscaler set at its latest decision."
    )
    recommendation: int | None = Field(None, description="The latest unstabilised recommendation.")
    reason: str | None = Field(None, description="Why the latest decision is what it is.")
    last_decision_time: str | None = None
    last_scale_time: str | None = Field(
        None, description="When the autoscaler last changed the replica count."
    )
    last_scale_reason: str | None = None
    signals: dict[str, float] = Field(
        {},
        description="Fleet-wide figures of the latest decision (per-replica averages, pod counts, pending).",
    )
    cold_start_seconds: float | None = Field(
        None,
        description="Creation to Ready of the newest Ready pod, as measured: what a request held at zero "
        "replicas waits for (a RoutingPolicy's queueTimeoutSeconds should cover it).",
    )
    scaled_replicas: int | None = Field(
        None,
        description="The count the autoscaler last wrote: desiredReplicas (awake) plus the pods it keeps "
        "asleep (idle: sleep).",
    )
    awake_replicas: int | None = Field(
        None, description="Pods awake at the latest decision (Ready or unknown)."
    )
    sleeping_replicas: int | None = Field(
        None, description="Pods asleep (the warm tier) at the latest decision."
    )
    starting_replicas: int | None = Field(None, description="Pods cold-starting at the latest decision.")
    history: AutoscalingHistory = AutoscalingHistory()


class RoleStatus(_Spec):
    """One role of a disaggregated deployment."""

    replicas: int | None = Field(None, description="Pods its Deployment has.")
    ready_replicas: int | None = None
    autoscaling: AutoscalingStatus | None = Field(
        None, description="The autoscaler's latest decision for this role (its own pods' signals)."
    )


class RolesStatus(_Spec):
    prefill: RoleStatus | None = None
    decode: RoleStatus | None = None


class PodLoading(_Spec):
    """One pod on its way to Ready: how far its model's download or load is (each pod's own /ready says)."""

    pod: str
    stage: str = Field(
        description="resolve, wait (another pod on the node downloads the same model), verify, download, "
        "error (an attempt failed: see message; the next follows a back-off), done (the download), load "
        "(weights into memory), or starting (no answer yet)."
    )
    percent: float | None = Field(None, description="Of the bytes to download, or of the weights to load.")
    bytes: int | None = Field(None, description="Downloaded so far.")
    total_bytes: int | None = None
    file: str | None = Field(None, description="The file being downloaded.")
    cache: str | None = Field(None, description="hit: the node's cache had the model, verified by digest.")
    attempt: int | None = None
    message: str | None = Field(None, description="Why the last download attempt failed.")
    weights_loaded: int | None = None
    weights_total: int | None = None


class AdapterStatus(_Spec):
    """One listed LoRA adapter: on how many of the Ready pods it is loaded (each pod's /load says)."""

    name: str
    loaded_pods: int = Field(description="Ready pods that report it loaded.")
    pinned_pods: int = Field(0, description="Ready pods that keep it pinned there (its minCopies).")
    ready: bool = Field(description="Loaded on every Ready pod (and there is one).")


class ModelDeploymentStatus(_Spec):
    phase: Phase | None = None
    replicas: int | None = Field(None, description="Runtime pods the Deployment has (scale subresource).")
    ready_replicas: int | None = None
    selector: str | None = Field(None, description="Label selector of the pods (scale subresource).")
    endpoint: str | None = Field(None, description="URL of the Service in front of the pods.")
    config_hash: str | None = Field(None, description="Hash of the restart-requiring runtime config.")
    observed_generation: int | None = None
    conditions: tuple[Condition, ...] = ()
    autoscaling: AutoscalingStatus | None = None
    roles: RolesStatus | None = Field(None, description="Disaggregated: per role (prefill, decode).")
    loading: tuple[PodLoading, ...] | None = Field(
        None, description="Pods on their way to Ready (at most 8): the model's download and load, per pod."
    )
    adapters: tuple[AdapterStatus, ...] | None = Field(
        None, description="The listed LoRA adapters and how many Ready pods have each loaded."
    )
    adapters_ready: str | None = Field(
        None, description="READY/LISTED: adapters loaded on every Ready pod, of those listed."
    )


class RouterGeneration(_Spec):
    pod: str
    generation: int | None = Field(None, description="The policy generation it runs; null = not readable.")


class PolicyStatus(_Spec):
    observed_generation: int | None = None
    used_by: tuple[str, ...] = Field((), description="ModelDeployments referencing this policy.")
    endpoint: str | None = Field(None, description="RoutingPolicy: URL of the router Service.")
    routers: tuple[RouterGeneration, ...] = Field(
        (),
        description="RoutingPolicy: each ready router pod and the generation it applied (edits apply live).",
    )
    conditions: tuple[Condition, ...] = ()


# ---------------------------------------------------------------------------------------------------- registry
# Lists whose items are unique by key (`x-kubernetes-list-type: map`): the API server rejects duplicates and
# server-side apply merges them item by item.
LIST_MAP_KEYS: dict[str, dict[str, list[str]]] = {
    "RoutingPolicy": {"priorityClasses": ["name"], "modelRoutes": ["model"]},
}


def _autoscaling_rules(at: str, min_one: bool = False) -> dict[str, list[dict[str, str]]]:
    """CEL rules of an AutoscalingSpec at schema path `at` (the spec's, or a disaggregated role's)."""
    rules = {
        at: [
            {
                "rule": "!has(self.minReplicas) || self.minReplicas <= self.maxReplicas",
                "message": f"{at}.minReplicas must be <= maxReplicas",
            },
            {
                "rule": f"self.maxReplicas <= {MAX_REPLICAS}",
                "message": f"{at}.maxReplicas must be <= {MAX_REPLICAS} (the bound of replicas)",
            },
            {
                "rule": f"!has(self.scaleToZeroAfterSeconds) || self.scaleToZeroAfterSeconds <= {MAX_SCALE_TO_ZERO_SECONDS}",
                "message": f"{at}.scaleToZeroAfterSeconds must be <= {MAX_SCALE_TO_ZERO_SECONDS:.0f}",
            },
        ],
        f"{at}.targets": [
            {
                "rule": "has(self.waitingRequestsPerReplica) || has(self.kvCacheUsage) || has(self.ttft) || "
                "has(self.outputTokensPerSecondPerReplica)",
                "message": f"{at}.targets: set at least one of waitingRequestsPerReplica, kvCacheUsage, ttft, "
                "outputTokensPerSecondPerReplica",
            }
        ],
        f"{at}.targets.ttft": [
            {
                "rule": f"!has(self.windowSeconds) || self.windowSeconds <= {MAX_WINDOW_SECONDS}",
                "message": f"{at}.targets.ttft.windowSeconds must be <= {MAX_WINDOW_SECONDS:.0f}",
            }
        ],
    }
    rules[at].append(
        {
            "rule": "(!has(self.warmPoolSize) && !has(self.sleepLevel)) || "
            "(has(self.idle) && self.idle == 'sleep')",
            "message": f"{at}: warmPoolSize and sleepLevel need idle: sleep",
        }
    )
    if min_one:
        rules[at].append(
            {
                "rule": "!has(self.minReplicas) || self.minReplicas >= 1",
                "message": f"{at}.minReplicas must be >= 1",
            }
        )
        rules[at].append(
            {
                "rule": "!has(self.idle) || self.idle != 'sleep'",
                "message": f"{at}.idle: sleep is for aggregated deployments",
            }
        )
    return rules


# CEL rules per schema path (dotted, camelCase; "" = the spec itself). The operator checks the same rules in
# the validators above, so a cluster without CEL still reports them (as a condition instead of a rejection).
CEL_RULES: dict[str, dict[str, list[dict[str, str]]]] = {
    "ModelDeployment": {
        "model": [
            {
                "rule": "(!has(self.hfTokenSecret) && !has(self.cacheClaim) && !has(self.hfEndpoint) && "
                "(!has(self.nodeCache) || !self.nodeCache)) || "
                "(has(self.source) && self.source.startsWith('hf://'))",
                "message": "model.hfTokenSecret, cacheClaim, nodeCache and hfEndpoint: only an hf:// source is "
                "downloaded",
            },
            {
                "rule": "!has(self.cacheClaim) || !has(self.nodeCache) || !self.nodeCache",
                "message": "model.nodeCache and model.cacheClaim: the download goes to one cache, not both",
            },
        ],
        "": [
            {
                "rule": "!has(self.tensorParallelSize) || !has(self.resources) || !has(self.resources.gpus) || "
                "self.resources.gpus % self.tensorParallelSize == 0",
                "message": "tensorParallelSize must divide resources.gpus (or gpus is 0: CPU workers)",
            },
            {
                "rule": "!has(self.model) || !has(self.model.quantization) || self.model.quantization != 'fp8' || "
                "(has(self.resources) && has(self.resources.gpus) && self.resources.gpus > 0)",
                "message": "model.quantization fp8 needs GPUs (resources.gpus > 0)",
            },
            {
                "rule": "!has(self.autoscaling) || !has(self.autoscaling.minReplicas) || "
                "self.autoscaling.minReplicas > 0 || has(self.routingPolicyRef)",
                "message": "autoscaling.minReplicas 0 needs routingPolicyRef (the router holds requests at zero)",
            },
            {
                "rule": "!has(self.autoscaling) || !has(self.disaggregation)",
                "message": "autoscaling: a disaggregated deployment scales each role on its own signals: set "
                "disaggregation.prefill.autoscaling and/or disaggregation.decode.autoscaling instead",
            },
        ],
        **{
            f"networkPolicy.{field}": [
                {
                    "rule": "self.all(p, has(p.ipBlock) ? !has(p.podSelector) && !has(p.namespaceSelector) "
                    ": has(p.podSelector) || has(p.namespaceSelector))",
                    "message": f"networkPolicy.{field}: each entry sets {PEER_RULE}",
                }
            ]
            for field in ("allowFrom", "gatewayFrom")
        },
        "adapters": [
            {
                "rule": "self.all(a, !has(a.maxCopies) || !has(a.minCopies) || a.minCopies <= a.maxCopies)",
                "message": "adapters: minCopies must be <= maxCopies",
            }
        ],
        **_autoscaling_rules("autoscaling"),
        **{
            path: rules
            for role in ("prefill", "decode")
            for path, rules in _autoscaling_rules(f"disaggregation.{role}.autoscaling", min_one=True).items()
        },
    },
    "CachePolicy": {
        "cpuOffload": [
            {
                "rule": "!has(self.enabled) || !self.enabled || (has(self.sizeGiB) && self.sizeGiB > 0.0)",
                "message": "cpuOffload.enabled needs cpuOffload.sizeGiB > 0",
            }
        ],
    },
    # Fallback cycles and chain depth need a walk over the list, which CEL cannot do: the operator checks
    # them (RoutingSpec) and reports the path of the bad field in the policy's status.
    "RoutingPolicy": {
        "modelRoutes": [
            {
                "rule": "self.all(r, !has(r.split) || size(r.split) == 0 || !has(r.backends) || "
                "size(r.backends) == 0)",
                "message": "modelRoutes: a route gives `backends` or `split`, not both",
            },
            {
                "rule": "self.all(r, !has(r.split) || size(r.split) == 0 || r.split.exists(w, w.weight > 0.0))",
                "message": "modelRoutes: a split's weights must sum to a positive number",
            },
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


# Children are named after their parent, and a Service's name must be a DNS-1035 label (at most 63
# characters, a letter first, no dots) while a custom resource may be named by any DNS-1123 subdomain (253
# characters, dots allowed): the longest name a parent's children take is `<name><suffix>`. A
# ModelDeployment reserves the disaggregated role suffix, so switching modes never needs a rename.
CHILD_NAME_SUFFIX = {"ModelDeployment": "-prefill", "RoutingPolicy": "-router"}
_LABEL_RE = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")


def check_name(kind: str, name: str) -> None:
    """Raise ConfigError naming `metadata.name` when the children of `kind` `name` cannot be named after it."""
    suffix = CHILD_NAME_SUFFIX.get(kind)
    if suffix is None:
        return
    longest = 63 - len(suffix)
    if len(name) > longest or not _LABEL_RE.fullmatch(name):
        raise ConfigError(
            f"invalid {kind} metadata.name {name[:80]!r}: its Services are named after it ({name[:20]}"
            f"...{suffix}), so it must be at most {longest} characters of a-z, 0-9 and '-', starting with a "
            "letter"
        )


def source_kind(source: str) -> Literal["builtin", "pvc", "hostpath", "hf"]:
    """Which of the four source forms `source` is (it already matched SOURCE_PATTERN)."""
    if not _SOURCE_RE.match(source):
        raise ConfigError(f"model.source {source!r} is not a built-in name, pvc://, file:/// or hf:// URL")
    for prefix, kind in (("pvc://", "pvc"), ("file://", "hostpath"), ("hf://", "hf")):
        if source.startswith(prefix):
            return kind  # type: ignore[return-value]
    return "builtin"
