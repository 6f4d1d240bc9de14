"""The runtime pods' NetworkPolicy, evaluated the way a network plugin reads it: which pods (by their real
labels, as the operator's own builders make them) may connect to which pods.

The e2e cluster has no network plugin that enforces NetworkPolicies, so this is where their meaning is
checked; the e2e suite only shows the object is accepted by a real API server.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import yaml
from tokenfleet.operator.api import parse_model_deployment, parse_routing_policy
from tokenfleet.operator.builders import build_deployment, build_runtime_config
from tokenfleet.operator.crdgen import build_crd
from tokenfleet.operator.disaggregation import build_disaggregated_children
from tokenfleet.operator.network_policy import build_network_policy
from tokenfleet.operator.router_builders import build_router_config, build_router_deployment
from tokenfleet.runtime.errors import ConfigError

NS = "team"
OPERATOR_NS = "tokenfleet-system"
MANIFESTS = Path(__file__).resolve().parents[2] / "manifests"


# ------------------------------------------------------------------------------------ NetworkPolicy semantics
def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    for req in selector.get("matchExpressions", []):
        key, op, values = req["key"], req["operator"], req.get("values", [])
        ok = {
            "In": key in labels and labels[key] in values,
            "NotIn": key not in labels or labels[key] not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[op]
        if not ok:
            return False
    return True


def _namespace_labels(namespace: str) -> dict[str, str]:
    return {"kubernetes.io/metadata.name": namespace}  # what the API server sets on every namespace


def admits(
    policy: dict[str, Any], to: dict[str, str], src: dict[str, str], src_ns: str, port: int = 8000
) -> bool:
    """Whether a TCP connection from a pod (`src` labels, namespace `src_ns`) to a pod labelled `to` in the
    policy's namespace on `port` is allowed, with this policy the only one selecting `to`."""
    spec = policy["spec"]
    if not _selects(spec["podSelector"], to):
        return True  # not isolated by this policy
    for rule in spec["ingress"]:
        if not any(p["port"] == port and p["protocol"] == "TCP" for p in rule["ports"]):
            continue
        for peer in rule["from"]:
            if "ipBlock" in peer:
                continue  # pods here are matched by labels, not addresses
            ns_sel, pod_sel = peer.get("namespaceSelector"), peer.get("podSelector")
            in_ns = src_ns == NS if ns_sel is None else _selects(ns_sel, _namespace_labels(src_ns))
            if in_ns and (pod_sel is None or _selects(pod_sel, src)):
                return True
    return False


def _pod_labels(deployment: dict[str, Any]) -> dict[str, str]:
    return deployment["spec"]["template"]["metadata"]["labels"]


def _runtime(name: str, spec: dict[str, Any]) -> dict[str, str]:
    md = parse_model_deployment(spec)
    return _pod_labels(build_deployment(name, md, build_runtime_config(md, None)))


def _router(rp: str) -> dict[str, str]:
    config = build_router_config(NS, parse_routing_policy({}), [])
    return _pod_labels(build_router_deployment(rp, config, "img"))


def _operator() -> dict[str, str]:
    (dep,) = [
        d for d in yaml.safe_load_all((MANIFESTS / "operator.yaml").read_text()) if d["kind"] == "Deployment"
    ]
    return _pod_labels(dep)


def _policy(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    return build_network_policy(name, parse_model_deployment(spec), OPERATOR_NS)


# ------------------------------------------------------------------------------------------------------ tests
def test_only_its_router_the_operator_and_monitoring_reach_an_aggregated_deployment():
    policy = _policy("chat", {"routingPolicyRef": "front", "inferencePool": {"enabled": False}})
    pod = _runtime("chat", {})
    assert admits(policy, pod, _router("front"), NS)
    assert admits(policy, pod, _operator(), OPERATOR_NS)
    assert admits(policy, pod, {"app": "prometheus"}, "monitoring")
    # Not: another policy's router, a client pod next to it, another deployment's pods, the operator's
    # labels in a tenant namespace, any other port.
    assert not admits(policy, pod, _router("other"), NS)
    assert not admits(policy, pod, {"app": "curl"}, NS)
    assert not admits(policy, pod, _runtime("code", {}), NS)
    assert not admits(policy, pod, _operator(), NS)
    assert not admits(policy, pod, _router("front"), NS, port=9000)
    # The policy covers this deployment's pods only.
    assert admits(policy, _runtime("code", {}), {"app": "curl"}, NS)
    assert policy["spec"]["policyTypes"] == ["Ingress"]  # egress (KV fetches, model downloads) stays open


def test_without_a_routing_policy_no_router_gets_in():
    policy = _policy("chat", {"inferencePool": {"enabled": False}})
    assert not admits(policy, _runtime("chat", {}), _router("front"), NS)


def test_the_roles_of_a_disaggregated_deployment_reach_each_other():
    spec = {"routingPolicyRef": "front", "disaggregation": {"prefill": {}, "decode": {}}}
    md = parse_model_deployment(spec)
    pods = {
        c["metadata"]["name"]: _pod_labels(c)
        for c in build_disaggregated_children("chat", md, None)
        if c["kind"] == "Deployment"
    }
    policy = _policy("chat", spec)
    prefill, decode = pods["chat-prefill"], pods["chat-decode"]
    assert admits(policy, prefill, decode, NS)  # the decode pod fetches the prompt's KV
    assert admits(policy, decode, _router("front"), NS) and admits(policy, prefill, _router("front"), NS)
    assert not admits(policy, prefill, {"app": "curl"}, NS)
    # Aggregated, a pod has no business calling its siblings.
    aggregated = _policy("chat", {"routingPolicyRef": "front"})
    assert not admits(aggregated, _runtime("chat", {}), _runtime("chat", {}), NS)


def test_the_gateway_and_its_picker_get_in_while_the_inference_pool_is_on():
    gateway = {"gateway.networking.k8s.io/gateway-name": "inference-gateway", "app": "envoy"}
    picker = {"inferencepool": "chat-epp"}
    on, off = _policy("chat", {}), _policy("chat", {"inferencePool": {"enabled": False}})
    pod = _runtime("chat", {})
    assert admits(on, pod, gateway, "gateway-system") and admits(on, pod, picker, NS)
    assert not admits(off, pod, gateway, "gateway-system") and not admits(off, pod, picker, NS)
    assert not admits(on, pod, {"inferencepool": "other-epp"}, NS)
    # A named picker; and `gatewayFrom` replaces the defaults.
    named = _policy("chat", {"inferencePool": {"endpointPicker": {"name": "shared"}}})
    assert admits(named, pod, {"inferencepool": "shared"}, NS)
    own = _policy(
        "chat",
        {
            "networkPolicy": {
                "gatewayFrom": [
                    {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "edge"}}}
                ]
            }
        },
    )
    assert admits(own, pod, {"any": "pod"}, "edge") and not admits(own, pod, gateway, "gateway-system")


def test_allow_from_and_monitoring_namespaces_are_the_users():
    spec = {
        "inferencePool": {"enabled": False},
        "networkPolicy": {
            "monitoringNamespaces": ["observability"],
            "allowFrom": [
                {"podSelector": {"matchLabels": {"app": "batch"}}},
                {"namespaceSelector": {"matchLabels": {"team": "ml"}}, "podSelector": {}},
                {"ipBlock": {"cidr": "10.8.0.0/16", "except": ["10.8.1.0/24"]}},
            ],
        },
    }
    policy = _policy("chat", spec)
    pod = _runtime("chat", {})
    assert admits(policy, pod, {"app": "batch"}, NS)
    assert not admits(policy, pod, {"app": "prometheus"}, "monitoring")
    assert admits(policy, pod, {"app": "prometheus"}, "observability")
    peers = policy["spec"]["ingress"][0]["from"]
    assert {"ipBlock": {"cidr": "10.8.0.0/16", "except": ["10.8.1.0/24"]}} in peers
    assert not any(
        "namespaceSelector" in p
        and p["namespaceSelector"].get("matchLabels", {}).get("kubernetes.io/metadata.name") == "monitoring"
        for p in peers
    )


@pytest.mark.parametrize(
    ("network_policy", "message"),
    [
        (
            {"allowFrom": [{}]},
            "networkPolicy.allowFrom.0: set podSelector and/or namespaceSelector, or ipBlock",
        ),
        (
            {"allowFrom": [{"ipBlock": {"cidr": "10.0.0.0/8"}, "podSelector": {}}]},
            "networkPolicy.allowFrom.0: set podSelector and/or namespaceSelector, or ipBlock alone",
        ),
        (
            {"gatewayFrom": [{"ipBlock": {"cidr": "10.0.0/8"}}]},
            "networkPolicy.gatewayFrom.0.ipBlock: cidr '10.0.0/8'",
        ),
        (
            {"allowFrom": [{"ipBlock": {"cidr": "10.0.0.0/8", "except": ["11.0.0.0/16"]}}]},
            "networkPolicy.allowFrom.0.ipBlock: except[0] 11.0.0.0/16 is not inside cidr",
        ),
        (
            {"allowFrom": [{"podSelector": {"matchExpressions": [{"key": "a", "operator": "In"}]}}]},
            "networkPolicy.allowFrom.0.podSelector.matchExpressions.0: operator In needs values",
        ),
        ({"monitoringNamespaces": ["Not_A_Namespace"]}, "networkPolicy.monitoringNamespaces.0"),
        ({"allowFrom": [{"podSelector": {}, "ports": [80]}]}, "networkPolicy.allowFrom.0.ports"),
    ],
)
def test_an_invalid_network_policy_is_refused_naming_the_field(network_policy, message):
    with pytest.raises(
        ConfigError, match=message.replace(".", r"\.").replace("[", r"\[").replace("(", r"\(")
    ):
        parse_model_deployment({"networkPolicy": network_policy})


def test_the_crd_checks_peers_with_the_same_rule():
    spec = build_crd("ModelDeployment")["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"][
        "spec"
    ]
    np = spec["properties"]["networkPolicy"]["properties"]
    for field in ("allowFrom", "gatewayFrom"):
        (rule,) = np[field]["x-kubernetes-validations"]
        assert "has(p.ipBlock)" in rule["rule"] and rule["message"].startswith(f"networkPolicy.{field}:")
    assert np["monitoringNamespaces"]["items"]["pattern"]
    assert np["enabled"]["default"] is True


def _cluster():
    spec = importlib.util.spec_from_file_location(
        "reconcile_cluster", Path(__file__).with_name("test_reconcile.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_reconcile_writes_it_owned_and_removes_it_when_turned_off():
    c = _cluster()
    kube = c.FakeKube()
    ctx = c._ctx(kube, [], c.Clock())
    kube.create("ModelDeployment", "chat", {})
    c._reconcile(ctx, kube, "chat")
    policy = kube.obj("NetworkPolicy", "chat")
    assert (
        policy["metadata"]["ownerReferences"][0]["uid"]
        == kube.obj("ModelDeployment", "chat")["metadata"]["uid"]
    )
    # The operator's namespace is the context's (the `--operator-namespace` flag, or the pod's own).
    assert admits(policy, _runtime("chat", {}), _operator(), ctx.operator_namespace)
    kube.edit("ModelDeployment", "chat", {"networkPolicy": {"enabled": False}})
    c._reconcile(ctx, kube, "chat")
    assert kube.names("NetworkPolicy") == []
    kube.edit("ModelDeployment", "chat", {})
    c._reconcile(ctx, kube, "chat")
    assert kube.names("NetworkPolicy") == ["chat"]
