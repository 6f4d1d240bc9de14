"""Scenarios 5 and 6: the operator is killed and restarted with objects present -> no duplicates and no
writes (no churn); a deleted child comes back. The whole session runs the operator under the
ServiceAccount identity bound only to manifests/rbac.yaml (the `operator` fixture fails on any 403)."""

from __future__ import annotations

import json
import time
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parent.parent / "manifests" / "examples"
KINDS = "md,cp,rp,deployment,service,configmap,serviceaccount,rolebinding"


def _versions(cluster, ns: str) -> dict[str, str]:
    items = json.loads(cluster.kubectl("get", KINDS, "-n", ns, "-o", "json"))["items"]
    return {f"{i['kind']}/{i['metadata']['name']}": i["metadata"]["resourceVersion"] for i in items}


def test_restart_causes_no_churn_and_deleted_children_return(cluster, namespace, operator, wait):
    cluster.kubectl("apply", "-n", namespace, "-k", str(EXAMPLES))
    expected = {
        "ModelDeployment/smollm2", "ModelDeployment/llama-8b", "CachePolicy/chat-cache",
        "RoutingPolicy/chat-routing", "Deployment/smollm2", "Deployment/llama-8b",
        "Deployment/chat-routing-router", "Service/smollm2", "Service/llama-8b", "Service/chat-routing-router",
        "ConfigMap/smollm2-runtime", "ConfigMap/llama-8b-runtime", "ConfigMap/chat-routing-router",
        "ServiceAccount/chat-routing-router", "RoleBinding/chat-routing-router",
    }  # fmt: skip
    wait(lambda: set(_versions(cluster, namespace)) == expected, what="every child")

    # Settled: two consecutive snapshots a resync apart are identical (status written once, not per resync).
    def settled():
        before = _versions(cluster, namespace)
        time.sleep(operator.resync_seconds + 1)
        return before == _versions(cluster, namespace) and before

    before = wait(settled, timeout=60, interval=0, what="a settled namespace")

    operator.kill()
    operator.start()
    # Resume handlers and at least one timer tick run on every object after the restart.
    time.sleep(operator.resync_seconds * 2 + 3)
    assert operator.alive(), operator.log()[-3000:]
    after = _versions(cluster, namespace)
    assert after == before, {
        k: (before.get(k), after.get(k)) for k in set(before) | set(after) if before.get(k) != after.get(k)
    }

    # Delete children by hand: the watch (Deployment) or the resync timer (ConfigMap, Service) restores them.
    for kind, name in (("deployment", "smollm2"), ("configmap", "smollm2-runtime"), ("service", "smollm2")):
        cluster.kubectl("delete", kind, name, "-n", namespace)
    for kind, name in (("deployment", "smollm2"), ("configmap", "smollm2-runtime"), ("service", "smollm2")):
        obj = wait(
            lambda k=kind, n=name: cluster.get(k, n, namespace), timeout=30, what=f"{kind}/{name} back"
        )
        assert obj["metadata"]["ownerReferences"][0]["name"] == "smollm2"
    assert set(_versions(cluster, namespace)) == expected


def test_operator_identity_is_least_privilege(cluster):
    """Scenario 6's other half: the identity the operator runs as cannot do what it does not need."""

    def can(*args: str) -> bool:
        out = cluster.kubectl("auth", "can-i", *args, who="operator", check=False)
        return out.strip().splitlines()[0] == "yes"

    assert can("patch", "deployments", "-n", "anywhere")
    assert can("patch", "modeldeployments.serving.tokenfleet.dev", "--subresource=status", "-n", "anywhere")
    assert not can("get", "secrets", "-n", "anywhere")
    assert not can("delete", "deployments", "-n", "anywhere")
    assert not can("create", "pods", "-n", "anywhere")
    assert not can("create", "clusterrolebindings")
    assert not can("bind", "clusterroles/cluster-admin")
