"""Pure builders for a RoutingPolicy's router fleet: config, ConfigMap, ServiceAccount + RoleBinding,
Deployment and Service.

The router's config file is `RouterConfig` (runtime/router/config.py): the RoutingPolicy spec verbatim under
`routing:`, plus one `backends:` entry per ModelDeployment that names this policy in `routingPolicyRef`.
Discovery is `kubernetes`: the router follows each backend Service's EndpointSlices so it can score pods
one by one (prefix affinity needs per-pod state), which is why it gets a ServiceAccount bound to the
`tokenfleet-router` ClusterRole (read EndpointSlices) in its own namespace only.

The router applies most of its config live when the ConfigMap changes (`LIVE_FIELDS` of the router's
config: the whole policy, the backends, the keys): the pod template carries a hash of the restart-only
part only, so a RoutingPolicy edit updates the ConfigMap and the running routers, and rolls nothing. The
file also names the policy's generation, which each router reports at `/v1/config` once applied.
API keys come from the Secret entry `apiKeySecret` names, mounted whole so rotations reach the file.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import yaml
from tokenfleet.operator.api import GROUP, Adapter
from tokenfleet.operator.builders import (
    CONFIG_DIR,
    CONFIG_HASH_ANNOTATION,
    MANAGED_BY,
    api_key_path,
    api_key_volume,
    container_security_context,
    node_lost_tolerations,
    pod_security_context,
    service_url,
    spread_over_nodes,
)
from tokenfleet.operator.internal_key import router_key_path, router_key_volume
from tokenfleet.runtime.config import RuntimeConfig
from tokenfleet.runtime.router.config import (
    AdapterCopies,
    Backend,
    Discovery,
    Peers,
    RouterConfig,
    RoutingSpec,
    restart_only,
)

ROUTER_PORT = 8080
ROUTER_CONFIG_FILE = "router.yaml"
ROUTER_CLUSTER_ROLE = "tokenfleet-router"


@dataclass(frozen=True, slots=True)
class RouterNames:
    deployment: str
    service: str
    config_map: str
    service_account: str
    role_binding: str


def router_names(rp_name: str) -> RouterNames:
    base = f"{rp_name}-router"
    return RouterNames(base, base, base, base, base)


def router_selector(rp_name: str) -> dict[str, str]:
    return {"app.kubernetes.io/instance": rp_name, "app.kubernetes.io/component": "router"}


def router_labels(rp_name: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "tokenfleet",
        **router_selector(rp_name),
        "app.kubernetes.io/managed-by": MANAGED_BY,
        f"{GROUP}/routing-policy": rp_name,
    }


def build_backend(
    md_name: str,
    namespace: str,
    config: RuntimeConfig,
    builtin_model: bool,
    key_owner: str | None = None,
    adapters: Sequence[Adapter] = (),
) -> Backend:
    """One router backend per ModelDeployment (`md_name` = its Service): its URL, what the router needs to
    hash prompts, and the internal key file of `key_owner` (default `md_name`; a disaggregated role's
    backend uses its deployment's key)."""
    return Backend(
        name=md_name,
        model=config.model.name,
        url=service_url(md_name, namespace),
        # The router pod has no model volume: only a built-in model's tokenizer can be loaded there;
        # for others the router falls back to its default (documented in docs/operations.md).
        tokenizer=config.model.model if builtin_model else None,
        block_size=config.cache.block_size,
        internal_key_file=router_key_path(key_owner or md_name),
        adapters=tuple(m.name for m in config.lora.modules),
        # What the routers enforce of `adapters[]` min/maxCopies (the operator pins the minimum itself).
        adapter_copies={
            a.name: AdapterCopies(min_copies=a.min_copies, max_copies=a.max_copies)
            for a in adapters
            if a.min_copies or a.max_copies is not None
        },
    )


def build_router_config(
    namespace: str,
    spec: RoutingSpec,
    backends: list[Backend],
    generation: int | None = None,
    rp_name: str | None = None,
) -> RouterConfig:
    # Sorted: the file (and so the ConfigMap) must not change when the API lists objects in another order.
    ordered = tuple(sorted(backends, key=lambda b: b.name))
    return RouterConfig(
        host="0.0.0.0",
        port=ROUTER_PORT,
        routing=spec,
        backends=ordered,
        discovery=Discovery(mode="kubernetes", namespace=namespace),
        # The replicas find each other through their own Service's endpoints, to hold one quota.
        peers=Peers(service=router_names(rp_name).service, port=ROUTER_PORT) if rp_name else Peers(),
        api_key_file=api_key_path(spec.api_key_secret),
        generation=generation,
    )


def router_config_yaml(config: RouterConfig) -> str:
    return yaml.safe_dump(config.model_dump(mode="json", by_alias=True), sort_keys=True)


def build_router_config_map(rp_name: str, config: RouterConfig) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": router_names(rp_name).config_map, "labels": router_labels(rp_name)},
        "data": {ROUTER_CONFIG_FILE: router_config_yaml(config)},
    }


def build_router_service_account(rp_name: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": {"name": router_names(rp_name).service_account, "labels": router_labels(rp_name)},
        "automountServiceAccountToken": True,
    }


def build_router_role_binding(rp_name: str) -> dict[str, Any]:
    names = router_names(rp_name)
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": {"name": names.role_binding, "labels": router_labels(rp_name)},
        # A RoleBinding to a ClusterRole grants it in this namespace only.
        "roleRef": {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "ClusterRole",
            "name": ROUTER_CLUSTER_ROLE,
        },
        "subjects": [{"kind": "ServiceAccount", "name": names.service_account}],
    }


def build_router_service(rp_name: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": router_names(rp_name).service, "labels": router_labels(rp_name)},
        "spec": {
            "type": "ClusterIP",
            "selector": router_selector(rp_name),
            "ports": [{"name": "http", "port": ROUTER_PORT, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def build_router_deployment(
    rp_name: str, config: RouterConfig, image: str, key_owners: Iterable[str] = ()
) -> dict[str, Any]:
    """The router pods; the template hashes only the restart-only config, so policy edits roll nothing.

    `key_owners`: the ModelDeployments it routes to, whose internal keys it mounts. Volumes are part of the
    pod template, so a deployment joining or leaving the policy rolls the routers (one at a time, surge
    first); everything else about a backend applies live.
    """
    spec = config.routing
    names = router_names(rp_name)
    key_volumes, key_mounts = api_key_volume(spec.api_key_secret)
    internal_volumes, internal_mounts = router_key_volume(key_owners)
    probe = {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 5, "timeoutSeconds": 3}
    container = {
        "name": "router",
        "image": image,
        "command": ["tokenfleet", "route", "--config", f"{CONFIG_DIR}/{ROUTER_CONFIG_FILE}"],
        "ports": [{"name": "http", "containerPort": ROUTER_PORT, "protocol": "TCP"}],
        "env": [{"name": "HOME", "value": "/tmp"}],
        "resources": {"requests": {"cpu": "500m", "memory": "512Mi"}, "limits": {"memory": "1Gi"}},
        "volumeMounts": [
            {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
            {"name": "tmp", "mountPath": "/tmp"},
            *key_mounts,
            *internal_mounts,
        ],
        "securityContext": container_security_context(),
        "startupProbe": {**probe, "failureThreshold": 24},
        "livenessProbe": {**probe, "failureThreshold": 3},
        "readinessProbe": {**probe, "failureThreshold": 2},
    }
    labels = router_labels(rp_name)
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": names.deployment, "labels": labels},
        "spec": {
            "replicas": spec.router.replicas,
            "selector": {"matchLabels": router_selector(rp_name)},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "template": {
                "metadata": {"labels": labels, "annotations": {CONFIG_HASH_ANNOTATION: _hash(config)}},
                "spec": {
                    "serviceAccountName": names.service_account,
                    "containers": [container],
                    "volumes": [
                        {"name": "config", "configMap": {"name": names.config_map}},
                        {"name": "tmp", "emptyDir": {}},
                        *key_volumes,
                        *internal_volumes,
                    ],
                    "securityContext": pod_security_context(),
                    "terminationGracePeriodSeconds": 30,
                    "enableServiceLinks": False,
                    "tolerations": node_lost_tolerations(),
                    "topologySpreadConstraints": spread_over_nodes(router_selector(rp_name)),
                },
            },
        },
    }


def _hash(config: RouterConfig) -> str:
    """Of the restart-only part: a change there needs new router processes; the rest they apply live."""
    text = yaml.safe_dump(restart_only(config), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]
