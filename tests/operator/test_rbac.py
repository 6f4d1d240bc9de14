"""manifests/rbac.yaml grants every request the reconcile makes: a run over the in-memory cluster of
test_reconcile.py that creates, switches and turns off every kind of child records each call, and each
call must be allowed by the operator's ClusterRole (the e2e suite runs the operator under that role and
fails on any 403; this finds a missing rule without a cluster)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import kopf
import pytest
import yaml
from tokenfleet.operator.kube import KINDS

RBAC = Path(__file__).resolve().parents[2] / "manifests" / "rbac.yaml"
# A Kube call -> the verbs the API server checks for it (server-side apply creates or patches).
VERBS = {
    "get": ["get"],
    "list": ["list"],
    "apply": ["create", "patch"],
    "create": ["create"],
    "delete": ["delete"],
}


def _cluster():
    spec = importlib.util.spec_from_file_location(
        "reconcile_cluster", Path(__file__).with_name("test_reconcile.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _rules() -> list[dict]:
    docs = yaml.safe_load_all(RBAC.read_text())
    (role,) = [
        d for d in docs if d["kind"] == "ClusterRole" and d["metadata"]["name"] == "tokenfleet-operator"
    ]
    return role["rules"]


def allowed(rules: list[dict], group: str, resource: str, verb: str) -> bool:
    return any(
        group in r["apiGroups"]
        and resource in r["resources"]
        and verb in r["verbs"]
        and not r.get("resourceNames")
        for r in rules
    )


def _resource(kind: str) -> tuple[str, str]:
    k = KINDS[kind]
    group = "" if k.api_version == "v1" else k.api_version.rsplit("/", 1)[0]
    return group, k.plural


def test_every_call_of_the_reconcile_is_granted():
    c = _cluster()
    from tokenfleet.operator.reconcile import reconcile_model_deployment, reconcile_routers

    kube = c.FakeKube(served=set(KINDS))
    ctx = c._ctx(kube, [], c.Clock())
    kube.create("RoutingPolicy", "front", {})
    kube.create("CachePolicy", "shared", {})
    kube.create("ModelDeployment", "chat", {"routingPolicyRef": "front", "cachePolicyRef": "shared"})
    kube.create("ModelDeployment", "split", {"disaggregation": {"prefill": {}, "decode": {}}})
    for name in ("chat", "split"):
        reconcile_model_deployment(ctx, kube.watched(), c.NS, name, c.LOG)
    reconcile_routers(ctx, kube.watched(), c.NS, c.LOG)
    # A switch to aggregated (the roles' children are listed and deleted) and every optional child off.
    kube.edit(
        "ModelDeployment", "split", {"networkPolicy": {"enabled": False}, "inferencePool": {"enabled": False}}
    )
    with pytest.raises(kopf.TemporaryError):
        reconcile_model_deployment(ctx, kube.watched(), c.NS, "split", c.LOG)
    c._ready(kube, "split", 1)
    reconcile_model_deployment(ctx, kube.watched(), c.NS, "split", c.LOG)
    assert kube.names("PodDisruptionBudget") == ["chat", "split"]  # the roles' budgets were pruned

    rules = _rules()
    seen, missing = set(), []
    for call, kind, _ in kube.calls:
        group, plural = _resource(kind)
        if call == "patch_status":
            checks = [(f"{plural}/status", "patch")]
        else:
            checks = [(plural, verb) for verb in VERBS[call]]
        for resource, verb in checks:
            seen.add((group, resource, verb))
            if not allowed(rules, group, resource, verb):
                missing.append(f"{verb} {resource}.{group or 'core'}")
    assert missing == []
    # The run did exercise what this change added (so the test cannot pass by not calling them).
    assert {("", "secrets", "create"), ("policy", "poddisruptionbudgets", "delete")} <= seen
    assert ("networking.k8s.io", "networkpolicies", "delete") in seen


def test_the_role_reads_secrets_only_by_name_and_namespaces_only_for_kopf():
    rules = _rules()
    # `get` by name: the warm tier reads a deployment's internal key to put its pods to sleep. Never list or
    # watch (no enumerating the namespace's Secrets), never rewrite one.
    assert allowed(rules, "", "secrets", "get")
    assert not any(allowed(rules, "", "secrets", verb) for verb in ("list", "watch", "patch", "update"))
    assert allowed(rules, "", "namespaces", "list") and allowed(rules, "", "namespaces", "watch")
    assert not allowed(rules, "", "namespaces", "create") and not allowed(rules, "", "namespaces", "delete")
    # The autoscaler's writes to pods: the deletion-cost annotation (a patch) and deleting a warm-tier pod
    # that failed to wake; never create one.
    assert allowed(rules, "", "pods", "patch") and allowed(rules, "", "pods", "delete")
    assert not allowed(rules, "", "pods", "create")
