"""The NetworkPolicy of a ModelDeployment: who may open connections to its runtime pods.

The pods' port 8000 serves clients and the internal endpoints (KV events, KV transfer, holds) alike, and
clients are meant to come through a router or a gateway, never straight to a pod (a pod trusts what its
router forwards). So ingress to the pods, on that port only, is allowed from:

- the router pods of the RoutingPolicy the deployment names (the only router that routes to it);
- disaggregated: the deployment's own runtime pods (decode pods fetch KV from prefill pods);
- the operator's pods (the autoscaler scrapes /metrics), in the operator's namespace;
- while `spec.inferencePool.enabled`: the gateway's data plane and the endpoint picker (`gatewayFrom`);
- pods of the monitoring namespaces (Prometheus);
- whatever `spec.networkPolicy.allowFrom` adds.

Only Ingress is restricted; the pods' egress (a decode pod reaching a prefill pod, an init container
downloading a model) stays open. Pure: the spec in, the manifest dict out.
"""

from __future__ import annotations

from typing import Any

from tokenfleet.operator.api import GROUP, ModelDeploymentSpec, NetworkPolicyPeer
from tokenfleet.operator.builders import RUNTIME_PORT, common_labels
from tokenfleet.operator.inference_pool import endpoint_picker_name
from tokenfleet.operator.router_builders import router_selector

NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"  # set by the API server on every namespace
OPERATOR_LABELS = {"app.kubernetes.io/name": "tokenfleet", "app.kubernetes.io/component": "operator"}
# The label Gateway API implementations (Istio, kgateway, ...) give the gateway pods they deploy.
GATEWAY_NAME_LABEL = "gateway.networking.k8s.io/gateway-name"
# The label the Inference Extension's chart gives its endpoint-picker pods (value: the picker's name).
PICKER_LABEL = "inferencepool"


def runtime_pods(md_name: str) -> dict[str, Any]:
    """Every runtime pod of the deployment, both roles of a disaggregated one (their shared labels)."""
    return {"matchLabels": {f"{GROUP}/model-deployment": md_name, "app.kubernetes.io/component": "runtime"}}


def _peer(peer: NetworkPolicyPeer) -> dict[str, Any]:
    return peer.model_dump(mode="json", by_alias=True, exclude_none=True)


def _in_namespace(namespace: str) -> dict[str, Any]:
    return {"matchLabels": {NAMESPACE_NAME_LABEL: namespace}}


def gateway_peers(md_name: str, spec: ModelDeploymentSpec) -> list[dict[str, Any]]:
    """The gateway's data plane and the endpoint picker (`gatewayFrom`, or the defaults it describes)."""
    if spec.network_policy.gateway_from is not None:
        return [_peer(p) for p in spec.network_policy.gateway_from]
    return [
        {
            "podSelector": {"matchExpressions": [{"key": GATEWAY_NAME_LABEL, "operator": "Exists"}]},
            "namespaceSelector": {},
        },
        {"podSelector": {"matchLabels": {PICKER_LABEL: endpoint_picker_name(md_name, spec)}}},
    ]


def ingress_peers(md_name: str, spec: ModelDeploymentSpec, operator_namespace: str) -> list[dict[str, Any]]:
    """Who may connect, in the order the module docstring gives."""
    peers: list[dict[str, Any]] = []
    if spec.routing_policy_ref:
        peers.append({"podSelector": {"matchLabels": router_selector(spec.routing_policy_ref)}})
    if spec.disaggregation is not None:
        peers.append({"podSelector": runtime_pods(md_name)})
    peers.append(
        {
            "podSelector": {"matchLabels": dict(OPERATOR_LABELS)},
            "namespaceSelector": _in_namespace(operator_namespace),
        }
    )
    if spec.inference_pool.enabled:
        peers += gateway_peers(md_name, spec)
    peers += [{"namespaceSelector": _in_namespace(ns)} for ns in spec.network_policy.monitoring_namespaces]
    peers += [_peer(p) for p in spec.network_policy.allow_from]
    return peers


def build_network_policy(md_name: str, spec: ModelDeploymentSpec, operator_namespace: str) -> dict[str, Any]:
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": md_name, "labels": common_labels(md_name)},
        "spec": {
            "podSelector": runtime_pods(md_name),
            "policyTypes": ["Ingress"],
            "ingress": [
                {
                    "from": ingress_peers(md_name, spec, operator_namespace),
                    "ports": [{"protocol": "TCP", "port": RUNTIME_PORT}],
                }
            ],
        },
    }
