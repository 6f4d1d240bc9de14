"""The children of a disaggregated ModelDeployment: per role (prefill, decode) a ConfigMap, a Deployment and a
Service, each built by the ordinary builders from the deployment's spec with the role's overrides.

Each role's children are named `<name>-<role>` and their pods carry `<group>/role: <role>` (the label the
router reads, `ROLE_LABEL` of the router's config); the role's Service carries it too and selects only that
role's pods. The operator's router gets one backend per role's Service with its `role` set
(`router_backends`); a router configured by hand with one Service over both roles learns each endpoint's
role from the pods' (or the EndpointSlices') labels instead.

Autoscaling is per role (`disaggregation.<role>.autoscaling`, autoscaler.py); switching a deployment between
aggregated and disaggregated serving removes the other mode's children (reconcile.prune_children).
Both roles serve the same model with the same KV layout (dtype, block size): blocks move between them by
hash and a decode pod refuses blocks of any other layout.
"""

from __future__ import annotations

from typing import Any

from tokenfleet.operator.api import GROUP, NODE_CACHE_DIR, CachePolicySpec, ModelDeploymentSpec
from tokenfleet.operator.builders import (
    build_config_map,
    build_deployment,
    build_pod_disruption_budget,
    build_runtime_config,
    build_service,
)
from tokenfleet.operator.router_builders import build_backend
from tokenfleet.runtime.router.config import Backend

ROLES = ("prefill", "decode")
ROLE_LABEL = f"{GROUP}/role"


def role_name(md_name: str, role: str) -> str:
    return f"{md_name}-{role}"


def role_spec(spec: ModelDeploymentSpec, role: str) -> ModelDeploymentSpec:
    """The deployment's spec as one role's pods run it (its replicas, resources and engine overrides)."""
    assert spec.disaggregation is not None
    r = getattr(spec.disaggregation, role)
    return spec.model_copy(
        update={
            "replicas": r.replicas,
            "resources": r.resources or spec.resources,
            "engine": r.engine or spec.engine,
            "disaggregation": None,
        }
    )


def _label(obj: dict[str, Any], md_name: str, role: str) -> None:
    for labels in (
        obj["metadata"]["labels"],
        obj["spec"].get("template", {}).get("metadata", {}).get("labels"),
    ):
        if labels is not None:
            labels[f"{GROUP}/model-deployment"] = md_name
            labels[ROLE_LABEL] = role
    selector = obj["spec"].get("selector")
    if obj["kind"] in ("Deployment", "PodDisruptionBudget"):
        selector["matchLabels"][ROLE_LABEL] = role
    elif obj["kind"] == "Service":
        selector[ROLE_LABEL] = role


def build_disaggregated_children(
    md_name: str,
    spec: ModelDeploymentSpec,
    cache: CachePolicySpec | None,
    node_cache_dir: str = NODE_CACHE_DIR,
) -> list[dict[str, Any]]:
    """ConfigMap, Deployment, Service, PodDisruptionBudget for the prefill role, then the same for decode."""
    children: list[dict[str, Any]] = []
    for role in ROLES:
        rspec = role_spec(spec, role)
        config = build_runtime_config(rspec, cache)
        name = role_name(md_name, role)
        cm, deployment, service, budget = (
            build_config_map(name, config),
            build_deployment(name, rspec, config, md_name=md_name, node_cache_dir=node_cache_dir),
            build_service(name),
            build_pod_disruption_budget(name),
        )
        for obj in (cm, deployment, service, budget):
            if obj["kind"] == "ConfigMap":
                obj["metadata"].setdefault("labels", {})
                obj["metadata"]["labels"][f"{GROUP}/model-deployment"] = md_name
                obj["metadata"]["labels"][ROLE_LABEL] = role
            else:
                _label(obj, md_name, role)
        children += [cm, deployment, service, budget]
    return children


def router_backends(
    md_name: str, namespace: str, spec: ModelDeploymentSpec, cache, builtin_model: bool
) -> list[Backend]:
    """The router backends of a disaggregated deployment: one per role's Service, carrying its role."""
    out = []
    for role in ROLES:
        name = role_name(md_name, role)
        base = build_backend(
            name,
            namespace,
            build_runtime_config(role_spec(spec, role), cache),
            builtin_model,
            key_owner=md_name,  # both roles' pods hold their deployment's one key
            adapters=spec.adapters,
        )
        out.append(base.model_copy(update={"role": role}))
    return out
