"""Pure builders: ModelDeployment (+ its CachePolicy) -> RuntimeConfig, ConfigMap, Deployment, Service.

No Kubernetes client here and no I/O: every function maps specs to plain manifest dicts, so the handlers
stay a few lines long and the tests can assert exact manifests. ownerReferences are added by the handler
(`kopf.adopt`) because they need the live parent's uid.

Live vs restart: the ConfigMap always carries the whole RuntimeConfig (pods reload the file and apply
`LIVE_FIELDS`); the pod template carries a hash of everything else, so changing a field a pod cannot apply
live changes the template and rolls the pods.
"""

from __future__ import annotations

import hashlib
import json
import math
import posixpath
from dataclasses import dataclass
from typing import Any

from kubernetes.utils import parse_quantity
from tokenfleet.operator.api import GROUP, NODE_CACHE_DIR, CachePolicySpec, ModelDeploymentSpec, source_kind
from tokenfleet.operator.internal_key import pod_key_path, pod_key_volume
from tokenfleet.operator.runtime_fields import runtime_values
from tokenfleet.runtime.config import LIVE_FIELDS, RuntimeConfig
from tokenfleet.runtime.errors import ConfigError
from tokenfleet.runtime.router.config import SecretKeyRef

RUNTIME_PORT = 8000
CONFIG_DIR = "/etc/tokenfleet"
KEYS_DIR = "/etc/tokenfleet-keys"
RUNTIME_CONFIG_FILE = "runtime.yaml"
MODELS_DIR = "/models"
CONFIG_HASH_ANNOTATION = f"{GROUP}/config-hash"
MANAGED_BY = "tokenfleet-operator"
# Seconds the kubelet waits beyond the server's own drain before SIGKILL.
DRAIN_MARGIN_SECONDS = 5
# A pod being removed (scale-down, rollout) keeps serving this long before it gets SIGTERM: its endpoint is
# marked terminating at once, and routers and kube-proxy stop sending it new requests within this time.
PRE_STOP_SECONDS = 10
# How long a pod stays bound to a node that stopped reporting (NotReady or unreachable) before it is evicted
# and its Deployment replaces it elsewhere. Kubernetes' default is 300 s: five minutes of a lost node's
# replicas missing from the fleet. A runtime or router pod holds nothing a replacement cannot rebuild (its
# streams resume on other pods), so it is given up sooner.
NODE_LOST_TOLERATION_SECONDS = 30


def spread_over_nodes(selector: dict[str, str]) -> list[dict[str, Any]]:
    """Replicas of one Deployment revision on different nodes where the scheduler can: a lost node then
    takes one replica, not all of them (a preference, never a reason to leave a pod Pending)."""
    return [
        {
            "maxSkew": 1,
            "topologyKey": "kubernetes.io/hostname",
            "whenUnsatisfiable": "ScheduleAnyway",
            "labelSelector": {"matchLabels": dict(selector)},
            "matchLabelKeys": ["pod-template-hash"],
        }
    ]


def apart_from(labels: dict[str, str]) -> dict[str, Any]:
    """An affinity preferring nodes without pods matching `labels` (a disaggregated model's other role):
    prefill and decode pods on different nodes, so a lost node does not take the whole model. Server-side
    apply keys spread constraints by (topologyKey, whenUnsatisfiable), so this cannot be a second one."""
    term = {"labelSelector": {"matchLabels": dict(labels)}, "topologyKey": "kubernetes.io/hostname"}
    return {
        "podAntiAffinity": {
            "preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 50, "podAffinityTerm": term}]
        }
    }


def node_lost_tolerations() -> list[dict[str, Any]]:
    return [
        {
            "key": key,
            "operator": "Exists",
            "effect": "NoExecute",
            "tolerationSeconds": NODE_LOST_TOLERATION_SECONDS,
        }
        for key in ("node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable")
    ]


@dataclass(frozen=True, slots=True)
class ChildNames:
    deployment: str
    service: str
    config_map: str


def child_names(md_name: str) -> ChildNames:
    """Children are named after the parent so a restarted operator finds them again (level-based)."""
    return ChildNames(deployment=md_name, service=md_name, config_map=f"{md_name}-runtime")


def selector_labels(md_name: str) -> dict[str, str]:
    return {"app.kubernetes.io/instance": md_name, "app.kubernetes.io/component": "runtime"}


def common_labels(md_name: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "tokenfleet",
        **selector_labels(md_name),
        "app.kubernetes.io/managed-by": MANAGED_BY,
        f"{GROUP}/model-deployment": md_name,
    }


def selector_string(md_name: str) -> str:
    """The pods' selector in the string form the scale subresource (`status.selector`) wants."""
    return ",".join(f"{k}={v}" for k, v in selector_labels(md_name).items())


def service_url(name: str, namespace: str, port: int = RUNTIME_PORT) -> str:
    return f"http://{name}.{namespace}.svc:{port}"


# ------------------------------------------------------------------------------------------------ model source
@dataclass(frozen=True, slots=True)
class ModelMount:
    """Where the pod finds the model, and what it takes to put it there."""

    model_path: str  # what RuntimeConfig.model.model says
    served_name: str
    # The serving container's own writable part of the cache volume: converted weights (RuntimeConfig
    # model.weight_cache_dir) and compile caches, for the next pod (or restart) of the deployment.
    cache_dir: str | None = None
    volumes: tuple[dict[str, Any], ...] = ()
    mounts: tuple[dict[str, Any], ...] = ()
    init_containers: tuple[dict[str, Any], ...] = ()
    env: tuple[dict[str, Any], ...] = ()  # the serving container's, for what the mounts name


# The serving container's part of an hf:// model's cache volume, mounted alone: the directory of its own
# ModelDeployment. The volume may be a node's directory shared by every deployment on the node, of every
# namespace: what one server writes there (weights it will map, kernels it will run) no other deployment's
# pods ever read, so a compromised server cannot reach another tenant's pods through the cache.
WORK_MOUNT = "/var/cache/tokenfleet-work"
# What every huggingface_hub client in a pod runs with (the model's download, and the serving container's
# hf:// adapter downloads).
HUB_CLIENT_ENV: tuple[dict[str, str], ...] = (
    {"name": "HF_HOME", "value": "/tmp/hf"},  # the hub client's own state, on the writable /tmp
    # The Hub (or its mirror) is asked for the files and nothing else: no telemetry, and no colour codes in a
    # log machines read (deciding on colour makes huggingface_hub fetch a registry of AI agents).
    {"name": "HF_HUB_DISABLE_TELEMETRY", "value": "1"},
    {"name": "NO_COLOR", "value": "1"},
)
_NAMESPACE_ENV = {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}}


def work_subpath(md_name: str) -> str:
    """The deployment's directory in the cache volume (`$(POD_NAMESPACE)` is expanded by the kubelet)."""
    return f"deployments/$(POD_NAMESPACE)/{md_name}"


def model_mount(
    spec: ModelDeploymentSpec,
    security_context: dict[str, Any],
    node_cache_dir: str = NODE_CACHE_DIR,
    md_name: str = "",
) -> ModelMount:
    """`node_cache_dir`: the node's directory behind `model.nodeCache` (the operator's --node-cache-dir);
    `md_name`: the ModelDeployment whose own part of the cache the pods get (volumes and mounts only)."""
    source = spec.model.source
    kind = source_kind(source)
    if kind == "builtin":
        return ModelMount(model_path=source, served_name=spec.model.served_name or source)
    if kind == "pvc":
        claim, _, sub = source.removeprefix("pvc://").partition("/")
        root = f"{MODELS_DIR}/{claim}"
        path = posixpath.join(root, sub)
        return ModelMount(
            model_path=path,
            served_name=spec.model.served_name or _stem(path),
            volumes=({"name": "model", "persistentVolumeClaim": {"claimName": claim, "readOnly": True}},),
            mounts=({"name": "model", "mountPath": root, "readOnly": True},),
        )
    if kind == "hostpath":
        path = source.removeprefix("file://")
        # Mounted at the same path so error messages name the file the operator's user knows.
        return ModelMount(
            model_path=path,
            served_name=spec.model.served_name or _stem(path),
            volumes=({"name": "model", "hostPath": {"path": path}},),
            mounts=({"name": "model", "mountPath": path, "readOnly": True},),
        )
    repo = source.removeprefix("hf://").partition("@")[0]
    # `tokenfleet fetch` downloads into a cache entry per commit (hf/ORG/NAME/COMMIT), verifies it by digest
    # (an entry already there is checked, not trusted: a corrupt or partial one is fetched again), and points
    # a link at /models/ORG/NAME to it: the serving container's path does not depend on the commit a
    # revision named when the pod started. Progress lines and a one-line reason on failure (the termination
    # message, so the ModelDeployment's status names it) come from the fetch; the kubelet retries it.
    link = f"{MODELS_DIR}/{repo}"
    env: list[dict[str, Any]] = [dict(e) for e in HUB_CLIENT_ENV]
    if spec.model.hf_endpoint:
        env.append({"name": "HF_ENDPOINT", "value": spec.model.hf_endpoint})
    token = spec.model.hf_token_secret
    if token is not None:
        ref = {"name": token.name, "key": token.key}
        env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": ref}})
    fetch = {
        "name": "fetch-model",
        "image": spec.image,
        # --status-port: the pod's HTTP port answers /ready with the download's progress until the server
        # takes it over (the operator reads it into status.loading).
        "command": [
            *("tokenfleet", "fetch", source, "--cache-dir", NODE_CACHE_DIR, "--link", link),
            *("--status-port", str(RUNTIME_PORT), "--work-dir", work_subpath(md_name)),
        ],
        "env": [*env, _NAMESPACE_ENV],
        "volumeMounts": [
            {"name": "model", "mountPath": MODELS_DIR},
            {"name": "model-cache", "mountPath": NODE_CACHE_DIR},
            {"name": "tmp", "mountPath": "/tmp"},
        ],
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "securityContext": security_context,
        "resources": {"requests": {"cpu": "500m", "memory": "512Mi"}},
    }
    if spec.model.cache_claim:
        cache: dict[str, Any] = {"persistentVolumeClaim": {"claimName": spec.model.cache_claim}}
    elif spec.model.node_cache:
        # Shared by every pod on the node; the fetch takes a lock per entry, so a second pod waits for the
        # first one's download instead of fetching the same files.
        cache = {"hostPath": {"path": node_cache_dir, "type": "DirectoryOrCreate"}}
    else:
        cache = {"emptyDir": {}}
    return ModelMount(
        model_path=link,
        served_name=spec.model.served_name or repo,
        volumes=({"name": "model", "emptyDir": {}}, {"name": "model-cache", **cache}),
        mounts=(
            {"name": "model", "mountPath": MODELS_DIR, "readOnly": True},
            {"name": "model-cache", "mountPath": NODE_CACHE_DIR, "readOnly": True},
            # Created by the fetch (as the pods' user: a subPath the kubelet creates belongs to root).
            {"name": "model-cache", "mountPath": WORK_MOUNT, "subPathExpr": work_subpath(md_name)},
        ),
        init_containers=(fetch,),
        cache_dir=WORK_MOUNT,
        env=(_NAMESPACE_ENV,),
    )


def compile_cache_env(cache_dir: str | None) -> list[dict[str, str]]:
    """Where Triton's JIT and torch.compile (inductor) keep what they built: the deployment's part of the
    cache volume, for its next pods (both key their entries by compiler version and source), else /tmp."""
    if cache_dir is None:
        return [{"name": "TRITON_CACHE_DIR", "value": "/tmp/triton"}]
    return [
        {"name": "TRITON_CACHE_DIR", "value": f"{cache_dir}/triton"},
        {"name": "TORCHINDUCTOR_CACHE_DIR", "value": f"{cache_dir}/inductor"},
    ]


def _stem(path: str) -> str:
    base = posixpath.basename(path.rstrip("/"))
    return base.removesuffix(".gguf") or base


# ---------------------------------------------------------------------------------------------- runtime config
# RuntimeConfig fields the operator derives from the pod's shape instead of copying a spec field.
OPERATOR_SET_FIELDS = frozenset(
    {
        "model.model",
        "model.served_name",
        "model.weight_cache_dir",  # the model cache volume, where there is one (hf://)
        "model.device",
        "cache.cpu_offload_gib",
        "server.host",
        "server.port",
        "server.api_key_file",  # the mounted `apiKeySecret`, when one is named
        "server.internal_api_key_file",  # the deployment's generated internal-key Secret
        "lora.enable",  # on exactly when `adapters` lists some
        "lora.modules",  # `adapters`, at their mounted paths (an hf:// source as it is)
    }
)
# RuntimeConfig fields no custom resource exposes: every pod runs with the runtime's own default.
POD_DEFAULT_FIELDS = frozenset(
    {
        "model.attention_backend",  # follows the device
        "model.compile",  # auto: compiled decode (CUDA graphs) on GPU pods, eager on CPU pods
        "model.compile_batch_sizes",  # the powers of two up to the engine's max_num_seqs
        "cache.num_blocks",  # pods size the cache from their memory budget
        "scheduler.enable_chunked_prefill",
        "speculative.draft_layers",
        "speculative.ngram_min",
        "speculative.ngram_max",
        "server.api_keys",  # keys belong in a Secret, not in a custom resource
        "server.max_body_bytes",
        "server.drain_seconds",
        "server.health_stall_seconds",
        # Sleep mode is on exactly when the autoscaler keeps a warm tier (`autoscaling.idle: sleep`).
        "server.enable_sleep_mode",
        "lora.download_dir",  # hf:// adapters: the pod's temp directory (the writable /tmp emptyDir)
    }
)


ADAPTERS_DIR = "/adapters"


def adapter_path(source: str) -> str:
    """Where a pod finds an adapter: pvc://CLAIM/PATH under its claim's mount, file:///PATH as it is, and
    hf://ORG/NAME[@REVISION] unchanged (the runtime downloads it when a request first needs it)."""
    if source.startswith("hf://"):
        return source
    if source.startswith("file://"):
        return source.removeprefix("file://")
    claim, _, sub = source.removeprefix("pvc://").partition("/")
    return posixpath.join(ADAPTERS_DIR, claim, sub)


def adapter_volumes(spec: ModelDeploymentSpec) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(volumes, volumeMounts) for the adapters' sources: each claim mounted once, read-only, whatever
    adapters it holds — so listing another adapter on a mounted claim changes only the config (live).
    hf:// adapters need none: the pod downloads them into its own /tmp."""
    volumes: dict[str, dict[str, Any]] = {}
    mounts: dict[str, dict[str, Any]] = {}
    for adapter in spec.adapters:
        source = adapter.source
        if source.startswith("hf://"):
            continue
        if source.startswith("file://"):
            key, path = source, source.removeprefix("file://")
            volume = {"hostPath": {"path": path}}
        else:
            key = source.removeprefix("pvc://").partition("/")[0]
            path = posixpath.join(ADAPTERS_DIR, key)
            volume = {"persistentVolumeClaim": {"claimName": key, "readOnly": True}}
        if key in volumes:
            continue
        name = "adapters-" + hashlib.sha256(key.encode()).hexdigest()[:10]  # a claim name may be 253 long
        volumes[key] = {"name": name, **volume}
        mounts[key] = {"name": name, "mountPath": path, "readOnly": True}
    return list(volumes.values()), list(mounts.values())


def adapter_env(spec: ModelDeploymentSpec) -> list[dict[str, Any]]:
    """The serving container's env for hf:// adapters, which the runtime downloads itself (huggingface_hub)
    when a request first needs one: the hub client set up as for the model's download (HUB_CLIENT_ENV), the
    Hub or mirror (lora.hfEndpoint, else model.hfEndpoint) as HF_ENDPOINT, and lora.hfTokenSecret as
    HF_TOKEN. Never model.hfTokenSecret: the model's token goes to its download alone, not to the server.

    Given whenever `adapters` lists some, hf:// or not: the pod template changes only with these lora
    settings or when adapters go from none to some (which turns LoRA on and rolls the pods anyway), so
    listing an hf:// adapter beside others changes only the config (live), and a deployment without
    adapters keeps its pod template as it was.
    """
    if not spec.adapters:
        return []
    env: list[dict[str, Any]] = [dict(e) for e in HUB_CLIENT_ENV]
    endpoint = spec.lora.hf_endpoint or spec.model.hf_endpoint
    if endpoint:
        env.append({"name": "HF_ENDPOINT", "value": endpoint})
    token = spec.lora.hf_token_secret
    if token is not None:
        env.append(
            {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": token.name, "key": token.key}}}
        )
    return env


def host_places(spec: ModelDeploymentSpec) -> int:
    """Adapters a pod holds at once (its max_cpu_loras): lora.maxCpuLoras, else every listed one (at least
    maxLoras)."""
    return spec.lora.max_cpu_loras or max(len(spec.adapters), spec.lora.max_loras)


def _lora_values(spec: ModelDeploymentSpec, served_name: str) -> dict[str, Any]:
    """The RuntimeConfig lora fields of `spec.adapters` (LoRA is on only when some are listed)."""
    if not spec.adapters:
        return {}
    for adapter in spec.adapters:
        if adapter.name == served_name:
            raise ConfigError(f"adapters: {adapter.name!r} is the model's own served name")
    host = host_places(spec)
    return {
        "lora.enable": True,
        "lora.max_cpu_loras": host,
        "lora.modules": [{"name": a.name, "path": adapter_path(a.source)} for a in spec.adapters],
    }


def _nest(values: dict[str, Any]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for dotted, value in values.items():
        section, name = dotted.split(".")
        tree.setdefault(section, {})[name] = value
    return tree


def build_runtime_config(spec: ModelDeploymentSpec, cache: CachePolicySpec | None) -> RuntimeConfig:
    """The pod's whole configuration; a missing CachePolicy means the runtime's own cache defaults.

    Every spec field declared with `runtime_field` is copied to its RuntimeConfig path; the rest is derived
    from the pod's shape (where the model is mounted, CPU or GPU, the port the Service targets).
    """
    mount = model_mount(spec, {})
    values = runtime_values(spec)
    if cache is not None:
        values.update(runtime_values(cache))
        values["cache.cpu_offload_gib"] = cache.cpu_offload.size_gib if cache.cpu_offload.enabled else 0.0
    values.update(
        {
            "model.model": mount.model_path,
            "model.served_name": mount.served_name,
            "model.weight_cache_dir": mount.cache_dir,
            "model.device": "cuda" if spec.resources.gpus > 0 else "cpu",
            # In a pod the server listens on every interface: the Service and the kubelet's probes reach it.
            "server.host": "0.0.0.0",
            "server.port": RUNTIME_PORT,
            "server.api_key_file": api_key_path(spec.api_key_secret),
            "server.internal_api_key_file": pod_key_path(),
            "server.enable_sleep_mode": spec.autoscaling is not None and spec.autoscaling.idle == "sleep",
        }
    )
    values.update(_lora_values(spec, mount.served_name))
    return RuntimeConfig.model_validate(_nest(values))


def api_key_path(secret: SecretKeyRef | None) -> str | None:
    """Where a pod reads the keys of `secret` (mounted whole, so the kubelet's updates reach the file)."""
    return f"{KEYS_DIR}/{secret.key}" if secret is not None else None


def api_key_volume(secret: SecretKeyRef | None) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(volumes, volumeMounts) for an API-key Secret; no subPath, which would freeze the file."""
    if secret is None:
        return [], []
    volume = {"name": "api-keys", "secret": {"secretName": secret.name, "defaultMode": 0o440}}
    return [volume], [{"name": "api-keys", "mountPath": KEYS_DIR, "readOnly": True}]


def _drop_path(tree: dict[str, Any], dotted: str) -> None:
    *parents, leaf = dotted.split(".")
    for key in parents:
        tree = tree.get(key, {})
    tree.pop(leaf, None)


def config_hash(config: RuntimeConfig) -> str:
    """Hash of the fields a pod cannot apply live: equal hashes mean no rollout is needed."""
    tree = config.model_dump(mode="json")
    for dotted in LIVE_FIELDS:
        _drop_path(tree, dotted)
    return hashlib.sha256(json.dumps(tree, sort_keys=True).encode()).hexdigest()[:16]


# ----------------------------------------------------------------------------------------------- the children
def build_config_map(name: str, config: RuntimeConfig) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": child_names(name).config_map, "labels": common_labels(name)},
        "data": {RUNTIME_CONFIG_FILE: config.dump_yaml()},
    }


def build_service(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": child_names(name).service, "labels": common_labels(name)},
        "spec": {
            "type": "ClusterIP",
            "selector": selector_labels(name),
            "ports": [{"name": "http", "port": RUNTIME_PORT, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def build_pod_disruption_budget(name: str) -> dict[str, Any]:
    """At most one of Deployment `name`'s pods evicted at a time (node drains, cluster autoscaler).

    `maxUnavailable` rather than `minAvailable`: a single-replica deployment can still be drained (its pod
    drains its streams and the router resumes the rest elsewhere), while a many-replica one never loses
    more than one pod's capacity, and its model cache, to voluntary disruptions at once.
    """
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {"name": child_names(name).deployment, "labels": common_labels(name)},
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector_labels(name)}},
    }


def pod_security_context() -> dict[str, Any]:
    return {"runAsNonRoot": True, "runAsUser": 1000, "runAsGroup": 1000, "fsGroup": 1000}


def container_security_context() -> dict[str, Any]:
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def _probes(gpu: bool) -> dict[str, Any]:
    # Startup covers model loading (weights off a PVC, CUDA init, Triton JIT): 10 min on GPU, 5 on CPU.
    # Liveness only starts after it, so a slow load is never killed as a hang. Probed every second: the pod
    # is Ready (and the Service sends to it) within a second of the engine serving, where a 10 s period
    # added up to 10 s to every cold start — a scale from zero waits on exactly that. A GET /health is cheap.
    startup_seconds = 600 if gpu else 300
    return {
        "startupProbe": {
            "httpGet": {"path": "/health", "port": "http"},
            "periodSeconds": 1,
            # A pod loading its model under CPU contention can answer slowly: a slow answer is not a
            # failure to start (the next probe waits for it).
            "timeoutSeconds": 5,
            "failureThreshold": startup_seconds,
        },
        "livenessProbe": {
            "httpGet": {"path": "/health", "port": "http"},
            "periodSeconds": 10,
            "timeoutSeconds": 5,
            "failureThreshold": 3,
        },
        "readinessProbe": {
            # Its first run after the startup probe passes comes one period later: short, so readiness
            # adds about a second; the same ~10 s of failures before a busy pod is taken out.
            "httpGet": {"path": "/ready", "port": "http"},
            "periodSeconds": 2,
            "timeoutSeconds": 3,
            "failureThreshold": 5,
        },
    }


def cpu_threads(cpu_request: str) -> int:
    """Torch threads for a CPU pod: its CPU request (the cores Kubernetes guarantees it), rounded down, at
    least one. Left alone, torch sizes its pool by the node's cores: several pods on one node then run more
    OpenMP threads than there are cores, and a thread that is off-core stalls every op's barrier (up to 8x
    slower steps, measured with runtime processes side by side on a 2-core machine)."""
    return max(1, math.floor(parse_quantity(cpu_request)))


def _resources(spec: ModelDeploymentSpec) -> dict[str, Any]:
    requests = {"cpu": spec.resources.cpu, "memory": spec.resources.memory}
    # No CPU limit: throttling a decode loop costs latency and buys nothing on a dedicated node.
    limits: dict[str, Any] = {"memory": spec.resources.memory}
    if spec.resources.gpus:
        limits["nvidia.com/gpu"] = str(spec.resources.gpus)
        requests["nvidia.com/gpu"] = str(spec.resources.gpus)
    return {"requests": requests, "limits": limits}


def build_deployment(
    name: str,
    spec: ModelDeploymentSpec,
    config: RuntimeConfig,
    md_name: str | None = None,
    node_cache_dir: str = NODE_CACHE_DIR,
) -> dict[str, Any]:
    """The runtime pods' Deployment `name`; `md_name` is the ModelDeployment whose internal key they mount
    (default `name`; a disaggregated role's Deployment is `<md>-<role>` and shares its deployment's key)."""
    gpu = spec.resources.gpus > 0
    csc = container_security_context()
    mount = model_mount(spec, csc, node_cache_dir, md_name or name)
    names = child_names(name)
    volumes: list[dict[str, Any]] = [
        {"name": "config", "configMap": {"name": names.config_map}},
        {"name": "tmp", "emptyDir": {}},
        *mount.volumes,
    ]
    mounts: list[dict[str, Any]] = [
        {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
        {"name": "tmp", "mountPath": "/tmp"},
        *mount.mounts,
    ]
    key_volumes, key_mounts = api_key_volume(spec.api_key_secret)
    volumes += key_volumes
    mounts += key_mounts
    lora_volumes, lora_mounts = adapter_volumes(spec)
    volumes += lora_volumes
    mounts += lora_mounts
    internal_volume, internal_mount = pod_key_volume(md_name or name)
    volumes.append(internal_volume)
    mounts.append(internal_mount)
    if gpu or spec.tensor_parallel_size > 1:
        # NCCL, CUDA IPC and torch.multiprocessing's shared tensors between tensor-parallel workers need
        # more shared memory than a container's default 64 MiB /dev/shm.
        volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory"}})
        mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
    container = {
        "name": "runtime",
        "image": spec.image,
        "command": ["tokenfleet", "serve", "--config", f"{CONFIG_DIR}/{RUNTIME_CONFIG_FILE}"],
        "ports": [{"name": "http", "containerPort": RUNTIME_PORT, "protocol": "TCP"}],
        # The root filesystem is read-only: caches (Triton JIT, HF, torch) go to the writable /tmp, or
        # the compile caches to the model cache volume where there is one (the next pod skips compiling).
        "env": [
            {"name": "HOME", "value": "/tmp"},
            *compile_cache_env(mount.cache_dir),
            *mount.env,
            *adapter_env(spec),
            # On a GPU the model's work is the device's; the host's threads stay torch's default.
            *([] if gpu else [{"name": "OMP_NUM_THREADS", "value": str(cpu_threads(spec.resources.cpu))}]),
        ],
        "resources": _resources(spec),
        "volumeMounts": mounts,
        # A crash's last log lines become lastState.terminated.message (and so the ModelDeployment's status).
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "securityContext": csc,
        **_probes(gpu),
        # The kubelet's own sleep (no binary needed in the image): new requests stop before SIGTERM, then
        # the server drains what is in flight.
        "lifecycle": {"preStop": {"sleep": {"seconds": PRE_STOP_SECONDS}}},
    }
    pod_spec: dict[str, Any] = {
        "containers": [container],
        "volumes": volumes,
        "securityContext": pod_security_context(),
        # The grace period counts from deletion, so it spans the preStop sleep and the drain.
        "terminationGracePeriodSeconds": PRE_STOP_SECONDS
        + math.ceil(config.server.drain_seconds)
        + DRAIN_MARGIN_SECONDS,
        "enableServiceLinks": False,
        "tolerations": node_lost_tolerations(),
        "topologySpreadConstraints": spread_over_nodes(selector_labels(name)),
    }
    if md_name is not None:  # a disaggregated role: away from the model's other pods where it can be
        pod_spec["affinity"] = apart_from({f"{GROUP}/model-deployment": md_name})
    if mount.init_containers:
        pod_spec["initContainers"] = list(mount.init_containers)
    if gpu:
        pod_spec["tolerations"].append(
            {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
        )
    labels = common_labels(name)
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": names.deployment, "labels": labels},
        "spec": {
            "replicas": spec.replicas,
            "selector": {"matchLabels": selector_labels(name)},
            # GPU nodes rarely have a spare device for a surge pod: replace in place instead.
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}
                if gpu
                else {"maxSurge": 1, "maxUnavailable": 0},
            },
            "template": {
                "metadata": {
                    "labels": labels,
                    "annotations": {
                        CONFIG_HASH_ANNOTATION: config_hash(config),
                        "prometheus.io/scrape": "true",
                        "prometheus.io/port": str(RUNTIME_PORT),
                        "prometheus.io/path": "/metrics",
                    },
                },
                "spec": pod_spec,
            },
        },
    }
