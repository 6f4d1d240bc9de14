"""Scenarios 3 and 4: a CachePolicy edit reaches the pods' config (live fields without a rollout, the rest
through the config hash); an invalid spec gives a False condition and an Event, and fixing it recovers."""

from __future__ import annotations

import json
import subprocess

import pytest
import yaml

HASH = "serving.tokenfleet.dev/config-hash"

CACHE_POLICY = """
apiVersion: serving.tokenfleet.dev/v1alpha1
kind: CachePolicy
metadata: {name: shared}
spec: {blockSize: 16, prefixCaching: {enabled: true, ttlSeconds: 60}}
"""


def _md(name: str, cache_ref: str | None = None, **spec) -> str:
    body = {
        "apiVersion": "serving.tokenfleet.dev/v1alpha1",
        "kind": "ModelDeployment",
        "metadata": {"name": name},
    }
    body["spec"] = {**({"cachePolicyRef": cache_ref} if cache_ref else {}), **spec}
    return json.dumps(body)


def _hash(cluster, ns: str, name: str) -> str:
    return cluster.get("deployment", name, ns)["spec"]["template"]["metadata"]["annotations"][HASH]


def _runtime(cluster, ns: str, name: str) -> dict:
    return yaml.safe_load(cluster.get("configmap", f"{name}-runtime", ns)["data"]["runtime.yaml"])


def test_cache_policy_edit_reaches_every_dependent(cluster, namespace, wait):
    cluster.kubectl("apply", "-n", namespace, "-f", "-", stdin=CACHE_POLICY)
    for name in ("a", "b"):
        cluster.kubectl("apply", "-n", namespace, "-f", "-", stdin=_md(name, "shared"))
    for name in ("a", "b"):
        wait(lambda n=name: cluster.get("deployment", n, namespace), what=f"deployment {name}")
    hashes = {n: _hash(cluster, namespace, n) for n in ("a", "b")}

    # A live field: the ConfigMap changes, the pod template does not (no rollout).
    cluster.kubectl("patch", "cachepolicy", "shared", "-n", namespace, "--type=merge",
                    "-p", '{"spec": {"prefixCaching": {"ttlSeconds": 120, "eviction": "lfu"}}}')  # fmt: skip
    for n in ("a", "b"):
        wait(lambda n=n: _runtime(cluster, namespace, n)["cache"]["ttl_seconds"] == 120, what=f"ttl in {n}")
        assert _runtime(cluster, namespace, n)["cache"]["eviction"] == "lfu"
        assert _hash(cluster, namespace, n) == hashes[n]

    # A restart-requiring field: the config hash on the pod template changes (rolling update).
    cluster.kubectl(
        "patch", "cachepolicy", "shared", "-n", namespace, "--type=merge", "-p", '{"spec": {"blockSize": 32}}'
    )
    for n in ("a", "b"):
        wait(lambda n=n: _hash(cluster, namespace, n) != hashes[n], what=f"new hash on {n}")
        assert _runtime(cluster, namespace, n)["cache"]["block_size"] == 32
    cp = wait(
        lambda: (cluster.get("cachepolicy", "shared", namespace).get("status") or {}).get("usedBy"),
        what="usedBy",
    )
    assert cp == ["a", "b"]


def test_missing_policy_reports_and_recovers(cluster, namespace, wait):
    cluster.kubectl("apply", "-n", namespace, "-f", "-", stdin=_md("lonely", "nowhere"))

    def pending():
        st = cluster.get("md", "lonely", namespace).get("status") or {}
        return st.get("phase") == "Pending" and st

    st = wait(pending, what="Pending")
    cond = {c["type"]: c for c in st["conditions"]}
    assert cond["PoliciesResolved"]["status"] == "False"
    assert "CachePolicy/nowhere" in cond["PoliciesResolved"]["message"]
    assert cluster.get("deployment", "lonely", namespace) is None
    events = wait(
        lambda: [e for e in cluster.events(namespace, "lonely") if "CachePolicy/nowhere" in e["message"]],
        what="an Event naming the missing policy",
    )
    assert events[0]["type"] == "Warning"

    # Fix it: create the policy under the referenced name -> children appear; pods ready -> Ready.
    cluster.kubectl(
        "apply", "-n", namespace, "-f", "-", stdin=CACHE_POLICY.replace("name: shared", "name: nowhere")
    )
    dep = wait(lambda: cluster.get("deployment", "lonely", namespace), what="deployment after the fix")
    status = {"observedGeneration": dep["metadata"]["generation"], "replicas": 1, "updatedReplicas": 1,
              "readyReplicas": 1, "availableReplicas": 1}  # fmt: skip
    cluster.kubectl("patch", "deployment", "lonely", "-n", namespace, "--subresource=status", "--type=merge",
                    "-p", json.dumps({"status": status}))  # fmt: skip
    st = wait(
        lambda: (s := cluster.get("md", "lonely", namespace)["status"])["phase"] == "Ready" and s,
        what="Ready",
    )
    assert all(c["status"] == "True" for c in st["conditions"])


def test_schema_rejects_what_it_can_express(cluster, namespace):
    """CEL: tensor parallelism must divide the GPUs; the message reaches the kubectl user."""
    bad = _md("tp", resources={"gpus": 3}, tensorParallelSize=2)
    with pytest.raises(subprocess.CalledProcessError) as err:
        cluster.kubectl("apply", "-n", namespace, "-f", "-", stdin=bad)
    assert "tensorParallelSize must divide resources.gpus" in err.value.stderr
    with pytest.raises(subprocess.CalledProcessError) as err:
        cluster.kubectl("apply", "-n", namespace, "-f", "-", stdin=_md("src", model={"source": "ftp://x"}))
    assert "spec.model.source" in err.value.stderr
