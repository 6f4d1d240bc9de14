"""CachePolicy edits reach running pods: a live field is reloaded in place by every pod that uses the policy
(same pods, no restart); a RoutingPolicy edit is applied in place by its router; a restart-only field rolls the pods with `maxUnavailable: 0` while a small load
through the router sees no failure. An invalid spec gives a False condition and an Event; fixing it
recovers, and readiness then comes from a real pod."""

from __future__ import annotations

import json
import subprocess
import threading
import time

import pytest
import yaml
from pod_keys import auth_headers, internal_key
from workload import StreamingLoad, get_json

HASH = "serving.tokenfleet.dev/config-hash"
MODEL_READY_S = 240

CACHE_POLICY = """
apiVersion: serving.tokenfleet.dev/v1alpha1
kind: CachePolicy
metadata: {name: shared}
spec: {blockSize: 16, prefixCaching: {enabled: true, ttlSeconds: 60}, cpuKVCacheGiB: 0.125}
"""
ROUTING_POLICY = """
apiVersion: serving.tokenfleet.dev/v1alpha1
kind: RoutingPolicy
metadata: {name: front}
spec: {strategy: least-load, retries: {maxAttempts: 3}, router: {replicas: 1}}
"""


def _md(name: str, cache_ref: str | None = None, routing_ref: str | None = None, **spec) -> str:
    body = {
        "apiVersion": "serving.tokenfleet.dev/v1alpha1",
        "kind": "ModelDeployment",
        "metadata": {"name": name},
    }
    refs = {"cachePolicyRef": cache_ref, "routingPolicyRef": routing_ref}
    small = {
        "engine": {"maxNumSeqs": 4, "maxNumBatchedTokens": 256},
        "model": {"servedName": name, "maxModelLen": 512},
    }
    body["spec"] = {**{k: v for k, v in refs.items() if v}, **small, **spec}
    return json.dumps(body)


def _hash(cluster, ns: str, name: str) -> str:
    return cluster.get("deployment", name, ns)["spec"]["template"]["metadata"]["annotations"][HASH]


def _runtime(cluster, ns: str, name: str) -> dict:
    return yaml.safe_load(cluster.get("configmap", f"{name}-runtime", ns)["data"]["runtime.yaml"])


def _pod_config(cluster, ns: str, name: str, pod: dict) -> dict:
    """The pod's /v1/config, read with the deployment's internal key when its config names one."""
    key = internal_key(cluster, ns, pod, _runtime(cluster, ns, name))
    return get_json(f"http://{pod['status']['podIP']}:8000/v1/config", headers=auth_headers(key))


def _pods(cluster, ns: str, name: str, component: str = "runtime") -> list[dict]:
    return cluster.pods(ns, f"app.kubernetes.io/instance={name},app.kubernetes.io/component={component}")


def _ready(pod: dict) -> bool:
    conds = {c["type"]: c["status"] for c in pod.get("status", {}).get("conditions") or []}
    return conds.get("Ready") == "True" and not pod["metadata"].get("deletionTimestamp")


def _ready_pods(cluster, ns: str, name: str, count: int = 1, component: str = "runtime") -> list[dict] | None:
    pods = _pods(cluster, ns, name, component)
    return pods if len(pods) == count and all(_ready(p) for p in pods) else None


class PodTimeline(threading.Thread):
    """Samples one ModelDeployment's pods (uid, ready, terminating) twice a second during a rollout."""

    def __init__(self, cluster, ns: str, name: str):
        super().__init__(daemon=True)
        self.cluster, self.ns, self.name = cluster, ns, name
        self.samples: list[list[tuple[str, bool, bool]]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            pods = _pods(self.cluster, self.ns, self.name)
            self.samples.append(
                [
                    (p["metadata"]["uid"], _ready(p), bool(p["metadata"].get("deletionTimestamp")))
                    for p in pods
                ]
            )
            time.sleep(0.5)


@pytest.mark.slow
def test_cache_policy_edit_reloads_live_and_rolls_without_loss(cluster, namespace, wait):
    cluster.kubectl("apply", "-n", namespace, "-f", "-", stdin=CACHE_POLICY + "---" + ROUTING_POLICY)
    cluster.kubectl("apply", "-n", namespace, "-f", "-", stdin=_md("a", "shared", "front"))
    cluster.kubectl("apply", "-n", namespace, "-f", "-", stdin=_md("b", "shared"))
    pods = {n: wait(lambda n=n: _ready_pods(cluster, namespace, n), timeout=MODEL_READY_S, what=f"pod {n}")[0]
            for n in ("a", "b")}  # fmt: skip
    hashes = {n: _hash(cluster, namespace, n) for n in ("a", "b")}

    # A live field: the ConfigMap changes, the kubelet swaps the mounted files, each pod reloads them.
    cluster.kubectl("patch", "cachepolicy", "shared", "-n", namespace, "--type=merge",
                    "-p", '{"spec": {"prefixCaching": {"ttlSeconds": 120, "eviction": "lfu"}}}')  # fmt: skip
    for n, pod in pods.items():
        cfg = wait(
            lambda p=pod, n=n: (
                (c := _pod_config(cluster, namespace, n, p))["effective"]["cache"]["ttl_seconds"] == 120 and c
            ),
            timeout=60,
            what=f"pod {n} to reload ttl_seconds",
        )
        assert cfg["effective"]["cache"]["eviction"] == "lfu" and cfg["pending_restart"] == []
        assert _hash(cluster, namespace, n) == hashes[n]
        (now,) = _pods(cluster, namespace, n)
        assert now["metadata"]["uid"] == pod["metadata"]["uid"]
        assert now["status"]["containerStatuses"][0]["restartCount"] == 0

    # A restart-only field: a new config hash, a rolling update (maxSurge 1, maxUnavailable 0) under load.
    router = wait(
        lambda: _ready_pods(cluster, namespace, "front", component="router"),
        timeout=MODEL_READY_S,
        what="router",
    )[0]

    # A live RoutingPolicy field: the router applies it in place (same pod, no restart, no rollout) and the
    # policy's status names the generation each router runs.
    rp_generation = cluster.get("routingpolicy", "front", namespace)["metadata"]["generation"]
    router_hash = _hash(cluster, namespace, "front-router")
    cluster.kubectl("patch", "routingpolicy", "front", "-n", namespace, "--type=merge",
                    "-p", '{"spec": {"strategy": "round-robin"}}')  # fmt: skip
    router_url = f"http://{router['status']['podIP']}:8080"
    applied = wait(
        lambda: (
            (c := get_json(f"{router_url}/v1/config"))["effective"]["routing"]["strategy"] == "round-robin"
            and c
        ),
        timeout=60,
        what="the router to apply the new strategy",
    )
    assert applied["generation"] == rp_generation + 1 and applied["pending_restart"] == [], applied
    (router_now,) = _pods(cluster, namespace, "front", component="router")
    assert router_now["metadata"]["uid"] == router["metadata"]["uid"]
    assert router_now["status"]["containerStatuses"][0]["restartCount"] == 0
    assert _hash(cluster, namespace, "front-router") == router_hash
    wait(
        lambda: (
            (cluster.get("routingpolicy", "front", namespace).get("status") or {}).get("routers")
            == [{"pod": router["metadata"]["name"], "generation": rp_generation + 1}]
        ),
        timeout=60,
        what="status.routers to report the applied generation",
    )

    load = StreamingLoad(f"http://{router['status']['podIP']}:8080", "a", workers=2, max_tokens=12).start()
    timeline = PodTimeline(cluster, namespace, "a")
    timeline.start()
    try:
        load.wait_for_requests(2)
        cluster.kubectl("patch", "cachepolicy", "shared", "-n", namespace, "--type=merge",
                        "-p", '{"spec": {"blockSize": 32}}')  # fmt: skip
        for n in ("a", "b"):
            wait(lambda n=n: _hash(cluster, namespace, n) != hashes[n], what=f"new hash on {n}")
            assert _runtime(cluster, namespace, n)["cache"]["block_size"] == 32
        new = wait(
            lambda: (
                (p := _ready_pods(cluster, namespace, "a"))
                and p[0]["metadata"]["uid"] != pods["a"]["metadata"]["uid"]
                and p
            ),
            timeout=MODEL_READY_S,
            what="a's new pod alone and Ready",
        )
        load.wait_for_requests(sum(load.results.values()) + 2)
    finally:
        timeline.stop.set()
        results = load.stop()
        timeline.join(5)
    print(f"load through the rollout: {dict(results)}")
    assert results["ok"] > 0 and results["failed_before_start"] == 0 and results["failed_in_flight"] == 0
    new_cfg = _pod_config(cluster, namespace, "a", new[0])
    assert new_cfg["effective"]["cache"]["block_size"] == 32
    # maxUnavailable 0: at every sample some pod was Ready, and the old pod began terminating only after
    # a new one was Ready.
    old = pods["a"]["metadata"]["uid"]
    assert all(any(ready for _, ready, _ in s) for s in timeline.samples if s), timeline.samples
    first_going = next(
        i for i, s in enumerate(timeline.samples) if not any(u == old and not t for u, _, t in s)
    )
    assert any(u != old and ready for u, ready, _ in timeline.samples[first_going]), timeline.samples
    wait(
        lambda: (
            (p := _ready_pods(cluster, namespace, "b"))
            and p[0]["metadata"]["uid"] != pods["b"]["metadata"]["uid"]
        ),
        timeout=MODEL_READY_S,
        what="b rolled",
    )
    cp = wait(
        lambda: (cluster.get("cachepolicy", "shared", namespace).get("status") or {}).get("usedBy"),
        what="usedBy",
    )
    assert cp == ["a", "b"]


@pytest.mark.slow
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

    # Fix it: create the policy under the referenced name -> children, a real pod, Ready.
    cluster.kubectl(
        "apply", "-n", namespace, "-f", "-", stdin=CACHE_POLICY.replace("name: shared", "name: nowhere")
    )
    wait(lambda: cluster.get("deployment", "lonely", namespace), what="deployment after the fix")
    st = wait(
        lambda: (s := cluster.get("md", "lonely", namespace)["status"])["phase"] == "Ready" and s,
        timeout=MODEL_READY_S,
        what="Ready from a real pod",
    )
    assert st["readyReplicas"] == 1
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
