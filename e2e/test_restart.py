"""The operator is killed and restarted with objects present -> no duplicates and no writes (no churn); a
deleted child comes back; killed in the middle of a rollout it converges on the new pods with no duplicate
children. The pods are real (the process kubelet runs them), so "settled" includes their readiness. The
whole session runs the operator under the ServiceAccount identity bound only to manifests/rbac.yaml (the
`operator` fixture fails on any 403)."""

from __future__ import annotations

import json
import time
from collections import Counter

import pytest
from workload import examples_manifest

KINDS = "md,cp,rp,deployment,service,configmap,serviceaccount,rolebinding"
NAMESPACE_DEFAULTS = ("ConfigMap/kube-root-ca.crt", "ServiceAccount/default")
CHILD_KINDS = "deployment,service,configmap,serviceaccount,rolebinding"
HASH = "serving.tokenfleet.dev/config-hash"
SELECTOR = "app.kubernetes.io/instance=smollm2,app.kubernetes.io/component=runtime"


def _versions(cluster, ns: str) -> dict[str, str]:
    items = json.loads(cluster.kubectl("get", KINDS, "-n", ns, "-o", "json"))["items"]
    versions = {f"{i['kind']}/{i['metadata']['name']}": i["metadata"]["resourceVersion"] for i in items}
    for own in NAMESPACE_DEFAULTS:  # what the controller-manager puts in every namespace
        versions.pop(own, None)
    return versions


def _children_by_owner(cluster, ns: str) -> Counter:
    items = json.loads(cluster.kubectl("get", CHILD_KINDS, "-n", ns, "-o", "json"))["items"]
    return Counter(
        (ref["kind"], ref["name"], i["kind"])
        for i in items
        for ref in i["metadata"].get("ownerReferences") or []
        if ref.get("controller")
    )


@pytest.mark.slow
def test_restart_causes_no_churn_and_deleted_children_return(cluster, namespace, operator, wait):
    cluster.kubectl("apply", "-n", namespace, "-f", "-", stdin=examples_manifest(cluster))
    expected = {
        "ModelDeployment/smollm2", "ModelDeployment/llama-8b", "CachePolicy/chat-cache",
        "RoutingPolicy/chat-routing", "Deployment/smollm2", "Deployment/llama-8b",
        "Deployment/chat-routing-router", "Service/smollm2", "Service/llama-8b", "Service/chat-routing-router",
        "ConfigMap/smollm2-runtime", "ConfigMap/llama-8b-runtime", "ConfigMap/chat-routing-router",
        "ServiceAccount/chat-routing-router", "RoleBinding/chat-routing-router",
    }  # fmt: skip
    wait(lambda: set(_versions(cluster, namespace)) == expected, what="every child")

    # Settled: the pods that can run are Ready (the GPU model stays Pending on CPU nodes), every router reports
    # the policy generation it runs, and two consecutive snapshots a resync apart are identical (status
    # written once, not per resync). Readiness first: a pod that turns Ready later changes its Deployment's
    # status and the RoutingPolicy's status.routers, which would look like churn after the restart.
    def running() -> bool:
        for name in ("smollm2", "chat-routing-router"):
            dep = cluster.get("deployment", name, namespace)
            if (dep.get("status") or {}).get("readyReplicas") != dep["spec"]["replicas"]:
                return False
        routers = (cluster.get("rp", "chat-routing", namespace).get("status") or {}).get("routers") or []
        replicas = cluster.get("deployment", "chat-routing-router", namespace)["spec"]["replicas"]
        return len(routers) == replicas and all(r.get("generation") is not None for r in routers)

    def settled():
        if not running():
            time.sleep(1)
            return False
        before = _versions(cluster, namespace)
        time.sleep(operator.resync_seconds + 1)
        return before == _versions(cluster, namespace) and before

    before = wait(settled, timeout=240, interval=0, what="a settled namespace (pods Ready)")

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

    # Killed during a rollout: the CachePolicy's restart-only field changes the template hash; the operator
    # dies right after writing it, the Deployment controller keeps rolling, the restarted operator
    # converges on the new pods and duplicates nothing.
    old_hash = cluster.get("deployment", "smollm2", namespace)["spec"]["template"]["metadata"]["annotations"][
        HASH
    ]
    cluster.kubectl("patch", "cachepolicy", "chat-cache", "-n", namespace, "--type=merge",
                    "-p", '{"spec": {"blockSize": 32}}')  # fmt: skip
    wait(
        lambda: (
            cluster.get("deployment", "smollm2", namespace)["spec"]["template"]["metadata"]["annotations"][
                HASH
            ]
            != old_hash
        ),
        what="the rollout to start",
    )
    operator.kill()
    time.sleep(2)
    operator.start()
    st = wait(
        lambda: (
            (s := cluster.get("md", "smollm2", namespace)["status"]).get("phase") == "Ready"
            and s["configHash"] != old_hash
            and s
        ),
        timeout=240,
        what="Ready on the new config after the restart",
    )
    assert st["readyReplicas"] == 1
    # The Deployment controller scales the old ReplicaSet down just after the new pod is Ready.
    (pod,) = wait(
        lambda: (
            len(
                live := [
                    p for p in cluster.pods(namespace, SELECTOR) if not p["metadata"].get("deletionTimestamp")
                ]
            )
            == 1
            and live
        ),
        timeout=60,
        what="the old pod to be terminating",
    )
    assert pod["metadata"]["annotations"][HASH] == st["configHash"]
    owned = _children_by_owner(cluster, namespace)
    assert all(n == 1 for n in owned.values()), owned
    rs = json.loads(cluster.kubectl("get", "rs", "-n", namespace, "-l", SELECTOR, "-o", "json"))["items"]
    assert sorted(r["spec"]["replicas"] for r in rs) == [0, 1], [r["metadata"]["name"] for r in rs]
    assert operator.alive(), operator.log()[-3000:]


def test_operator_identity_is_least_privilege(cluster):
    """Scenario 6's other half: the identity the operator runs as cannot do what it does not need."""

    def can(*args: str) -> bool:
        out = cluster.kubectl("auth", "can-i", *args, who="operator", check=False)
        return out.strip().splitlines()[0] == "yes"

    assert can("patch", "deployments", "-n", "anywhere")
    assert can("patch", "modeldeployments.serving.tokenfleet.dev", "--subresource=status", "-n", "anywhere")
    # Secrets: read by name (the warm tier's internal key), never listed, watched or rewritten.
    assert can("get", "secrets", "-n", "anywhere")
    assert not can("list", "secrets", "-n", "anywhere") and not can("watch", "secrets", "-n", "anywhere")
    assert not can("patch", "secrets", "-n", "anywhere")
    # It deletes its own runtime children after a switch between aggregated and disaggregated serving, and
    # a warm-tier pod that failed to wake (for its ReplicaSet to replace).
    assert can("delete", "deployments", "-n", "anywhere")
    assert can("delete", "pods", "-n", "anywhere")
    assert not can("delete", "secrets", "-n", "anywhere")
    assert not can("delete", "rolebindings", "-n", "anywhere")
    assert not can("create", "pods", "-n", "anywhere")
    assert not can("create", "clusterrolebindings")
    assert not can("bind", "clusterroles/cluster-admin")
