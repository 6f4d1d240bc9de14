"""The examples on a real cluster, as a user meets them (one namespace, the tests run in order):

1. apply the examples -> children with ownerReferences, probes and resources; the CPU model's pod is
   scheduled, Running and Ready; a completion through the Service's endpoints and through the router
   pods; the ModelDeployment is Ready with readyReplicas from the real pod; the GPU model stays Pending
   with the scheduler's reason in its status;
2. `kubectl scale md` -> three pod processes, the router spreads requests over them;
3. `kubectl delete pod` under a small streaming load, on a pod serving a stream that has just started ->
   the ReplicaSet replaces it, no request fails, and the streams the deleted pod was serving end well;
4. deleting the ModelDeployment -> the garbage collector removes every child.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import time
from collections import Counter

import pytest
import yaml
from envtest import wait_for
from workload import STOP_TIMEOUT_S, StreamingLoad, complete, examples_manifest, post_json

SELECTOR = "app.kubernetes.io/instance=smollm2,app.kubernetes.io/component=runtime"
ROUTER_SELECTOR = "app.kubernetes.io/instance=chat-routing"
MODEL_READY_S = 240  # model load on a busy 2-core machine + the startup/readiness probe periods
# The deleted-pod test's waits; its timeout is their sum (plus SETUP_S), so a slow step fails with its own
# message rather than with pytest's timeout in the middle of another.
DELETE_WAITS = {
    "3 Ready pods": MODEL_READY_S,
    "a stream just started": 60,
    "a replacement pod Ready": MODEL_READY_S,
    "requests after the replacement": 120,
    "the load stopped": STOP_TIMEOUT_S,
}
# The module's fixtures (the cluster and the routers, when this test runs alone) and the kubectl calls.
SETUP_S = 300
# The victim's stream has received under a quarter of its tokens: most of it is still to come when
# `kubectl delete` returns (a fraction of a second later), however fast the pods generate.
DELETE_TOKENS = 96


def _owner(obj: dict, kind: str) -> dict:
    refs = obj["metadata"].get("ownerReferences") or []
    assert len(refs) == 1, refs
    assert refs[0]["kind"] == kind and refs[0]["controller"] is True
    return refs[0]


def _ready(pod: dict) -> bool:
    conds = {c["type"]: c["status"] for c in pod.get("status", {}).get("conditions") or []}
    return pod["status"].get("phase") == "Running" and conds.get("Ready") == "True"


def _ready_pods(cluster, ns: str, selector: str, count: int) -> list[dict] | None:
    pods = [p for p in cluster.pods(ns, selector) if not p["metadata"].get("deletionTimestamp")]
    return pods if len(pods) == count and all(_ready(p) for p in pods) else None


def _md_status(cluster, ns: str, name: str) -> dict:
    return (cluster.get("md", name, ns) or {}).get("status") or {}


@pytest.fixture(scope="module")
def ns(cluster, operator):
    name = "e2e-examples"
    cluster.kubectl("create", "namespace", name)
    cluster.kubectl("apply", "-n", name, "-f", "-", stdin=examples_manifest(cluster))
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


@pytest.fixture(scope="module")
def router_url(cluster, ns) -> str:
    pods = wait_for(
        lambda: _ready_pods(cluster, ns, ROUTER_SELECTOR, 2), timeout=MODEL_READY_S, what="2 routers"
    )
    return f"http://{pods[0]['status']['podIP']}:8080"


@pytest.mark.slow
def test_examples_run_and_serve(cluster, ns, wait, router_url, pod_network):
    md = wait(lambda: cluster.get("md", "smollm2", ns), what="md")
    uid = md["metadata"]["uid"]

    # The children, as the operator built them.
    cm = wait(lambda: cluster.get("configmap", "smollm2-runtime", ns), what="configmap")
    assert _owner(cm, "ModelDeployment")["uid"] == uid
    runtime = yaml.safe_load(cm["data"]["runtime.yaml"])
    assert runtime["model"]["model"] == "smollm2-135m-instruct" and runtime["model"]["device"] == "cpu"
    assert runtime["cache"]["ttl_seconds"] == 600 and runtime["server"]["host"] == "0.0.0.0"
    dep = wait(lambda: cluster.get("deployment", "smollm2", ns), what="deployment")
    assert _owner(dep, "ModelDeployment")["uid"] == uid
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    assert c["command"] == ["tokenfleet", "serve", "--config", "/etc/tokenfleet/runtime.yaml"]
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert c["resources"]["requests"] == {"cpu": "2", "memory": "4Gi"}
    # A CPU pod's torch threads are its CPU request, not one per core of the node.
    assert {"name": "OMP_NUM_THREADS", "value": "2"} in c["env"]
    assert dep["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    svc = cluster.get("service", "smollm2", ns)
    assert _owner(svc, "ModelDeployment")["uid"] == uid
    assert svc["spec"]["selector"] == dep["spec"]["selector"]["matchLabels"]
    rcm = wait(lambda: cluster.get("configmap", "chat-routing-router", ns), what="router configmap")
    routed = yaml.safe_load(rcm["data"]["router.yaml"])
    assert [b["name"] for b in routed["backends"]] == ["llama-8b", "smollm2"]

    # The pod: scheduled by the scheduler, run by the kubelet in its own namespace, Ready by its probes.
    (pod,) = wait(lambda: _ready_pods(cluster, ns, SELECTOR, 1), timeout=MODEL_READY_S, what="a Ready pod")
    ip = pod["status"]["podIP"]
    assert pod["spec"]["nodeName"] in ("node-a", "node-b")
    assert ip.startswith(pod_network.subnet.rsplit(".", 1)[0] + ".")
    assert pod["status"]["containerStatuses"][0]["restartCount"] == 0
    assert any(v.get("projected") for v in pod["spec"]["volumes"]), "ServiceAccount admission mounts a token"

    st = wait(
        lambda: (s := _md_status(cluster, ns, "smollm2")).get("phase") == "Ready" and s, what="md Ready"
    )
    assert st["readyReplicas"] == 1 and st["observedGeneration"] == md["metadata"]["generation"]
    assert "Ready" in cluster.kubectl("get", "md", "smollm2", "-n", ns)

    # Through the Service's endpoints (the EndpointSlice the controller wrote from the pod's readiness) ...
    assert wait(lambda: cluster.ready_addresses(ns, "smollm2") == [ip] and ip, what="endpoint")
    out = complete(f"http://{ip}:8000", "smollm2")
    assert out["choices"][0]["text"].startswith(" Paris") and out["usage"]["completion_tokens"] == 3
    # ... and through the router, which found that pod in the EndpointSlices with its in-cluster identity.
    body = {"model": "smollm2", "prompt": "The capital of France is", "max_tokens": 3, "temperature": 0}
    out, headers = post_json(f"{router_url}/v1/completions", body)
    assert out["choices"][0]["text"].startswith(" Paris")
    assert headers["x-tokenfleet-endpoint"] == f"http://{ip}:8000"

    # The GPU example: Pending (its claim `models` does not exist here, and no node has a GPU), and the
    # ModelDeployment's status carries the scheduler's own words.
    gpu_pods = wait(lambda: cluster.pods(ns, "app.kubernetes.io/instance=llama-8b"), what="gpu pods")
    cond = {c["type"]: c for c in gpu_pods[0]["status"]["conditions"]}["PodScheduled"]
    assert cond["status"] == "False" and cond["reason"] == "Unschedulable"

    def explained():
        st = _md_status(cluster, ns, "llama-8b")
        ready = {c["type"]: c for c in st.get("conditions") or []}.get("Ready") or {}
        return cond["message"] in ready.get("message", "") and (st, ready)

    gst, ready = wait(
        explained, timeout=60, what="the scheduler's reason in the GPU ModelDeployment's status"
    )
    assert gst["phase"] != "Ready" and gst["readyReplicas"] == 0 and ready["reason"] == "Unschedulable"


@pytest.mark.slow
def test_kubectl_scale_runs_three_pods_and_the_router_spreads(cluster, ns, wait, router_url):
    cluster.kubectl("scale", "md/smollm2", "-n", ns, "--replicas=3")
    pods = wait(lambda: _ready_pods(cluster, ns, SELECTOR, 3), timeout=MODEL_READY_S, what="3 Ready pods")
    ips = {p["status"]["podIP"] for p in pods}
    assert len(ips) == 3
    st = wait(
        lambda: (s := _md_status(cluster, ns, "smollm2")).get("readyReplicas") == 3 and s, what="3 ready"
    )
    assert st["phase"] == "Ready"
    scale = json.loads(cluster.kubectl(
        "get", "--raw", f"/apis/serving.tokenfleet.dev/v1alpha1/namespaces/{ns}/modeldeployments/smollm2/scale"
    ))  # fmt: skip
    assert scale["spec"]["replicas"] == 3 and scale["status"]["replicas"] == 3
    assert scale["status"]["selector"] == SELECTOR
    wait(lambda: len(cluster.ready_addresses(ns, "smollm2")) == 3, what="3 endpoints")

    # Distinct prompts (no shared prefix to be affine to): the router spreads them over the pods.
    served: Counter = Counter()
    for i in range(9):
        body = {"model": "smollm2", "prompt": f"{i} {'abcdefghij'[i]} Question number {i}:", "max_tokens": 1}
        served[post_json(f"{router_url}/v1/completions", body)[1]["x-tokenfleet-endpoint"]] += 1
    assert set(served) <= {f"http://{ip}:8000" for ip in ips}
    assert len(served) >= 2, served


@pytest.mark.slow
@pytest.mark.timeout(sum(DELETE_WAITS.values()) + SETUP_S)
def test_deleted_pod_is_replaced_under_streaming_load(cluster, ns, wait, router_url):
    def until(what: str, predicate):
        return wait(predicate, timeout=DELETE_WAITS[what], what=what)

    pods = until("3 Ready pods", lambda: _ready_pods(cluster, ns, SELECTOR, 3))
    names = {f"http://{p['status']['podIP']}:8000": p["metadata"]["name"] for p in pods}  # router's names
    load = StreamingLoad(router_url, "smollm2", workers=2, max_tokens=DELETE_TOKENS).start()
    try:
        # The victim is the pod serving a stream that has just started: deleted under that stream.
        def fresh():
            return [s for s in load.in_flight() if s.endpoint in names and s.events < DELETE_TOKENS // 4]

        stream = until("a stream just started", fresh)[0]
        victim = names[stream.endpoint]
        cluster.kubectl("delete", "pod", victim, "-n", ns, "--wait=false")
        deleted = time.monotonic()  # the pod is terminating from here on
        after = until(
            "a replacement pod Ready",
            lambda: (
                (p := _ready_pods(cluster, ns, SELECTOR, 3))
                and victim not in {x["metadata"]["name"] for x in p}
                and p
            ),
        )
        load.wait_for_requests(load.count() + 2, timeout=DELETE_WAITS["requests after the replacement"])
        results = load.stop(timeout=DELETE_WAITS["the load stopped"])
    finally:  # after a failure, the failure is the one to report, not a stream still running
        with contextlib.suppress(TimeoutError):
            load.stop()
    print(f"streaming load while a pod was deleted: {dict(results)}")
    assert {p["metadata"]["uid"] for p in after} != {p["metadata"]["uid"] for p in pods}
    assert cluster.get("pod", victim, ns) is None
    assert results["ok"] > 0
    assert results["failed_before_start"] == 0, results  # the router retried these on another pod
    # A deleted pod leaves the EndpointSlice during its preStop sleep, drains, and hands back whatever is still
    # running at its drain deadline; the router continues those streams on another pod.
    assert results["failed_in_flight"] == 0, results
    # The deletion hit streams in flight (the case that could lose one), and each of them ended well.
    held = load.served_after(stream.endpoint, deleted)
    assert held, f"the deleted pod {victim} served no stream once terminating: the check proves nothing"
    assert all(s.outcome == "ok" for s in held), held
    print(f"the deleted pod was serving {len(held)} stream(s) when it was deleted or later; all ended well")


@pytest.mark.slow
def test_deleting_the_model_deployment_collects_every_child(cluster, ns, wait):
    dep_uid = cluster.get("deployment", "smollm2", ns)["metadata"]["uid"]
    cluster.kubectl("delete", "md", "smollm2", "-n", ns, "--wait=false")

    def gone():
        left = {
            "deployment": cluster.get("deployment", "smollm2", ns),
            "configmap": cluster.get("configmap", "smollm2-runtime", ns),
            "service": cluster.get("service", "smollm2", ns),
            "replicasets": [
                r["metadata"]["name"]
                for r in json.loads(cluster.kubectl("get", "rs", "-n", ns, "-o", "json"))["items"]
                if any(o["uid"] == dep_uid for o in r["metadata"].get("ownerReferences") or [])
            ],
            "pods": [p["metadata"]["name"] for p in cluster.pods(ns, SELECTOR)],
        }
        return not any(left.values()) or None

    wait(gone, timeout=120, what="every child of smollm2 collected")
    with pytest.raises(subprocess.CalledProcessError):
        cluster.kubectl("get", "md", "smollm2", "-n", ns)
