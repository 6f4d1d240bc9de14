"""Autoscaling on a real cluster, as a user meets it: `kubectl apply` a ModelDeployment with
`spec.autoscaling`, send load through its router, and watch the operator size the fleet from what the real
CPU pods report on /metrics.

One story (one fleet, each step needs the previous one):
1. a step load (more streams than the pod runs at once) raises waiting requests -> 1 -> 2 replicas;
2. the load drops to one stream -> back to 1 replica after the scale-down window, the removed pod drained
   while the stream kept going;
3. minReplicas edited to 0, no traffic -> 0 pods;
4. a request arrives -> the router holds it, the operator sees the demand, 0 -> 1, the request is served
   after the cold start.
Across the whole run not one request fails (429 and 503 count as failures here).
"""

from __future__ import annotations

import json
import time

import pytest
import yaml
from workload import StreamingLoad, post_json

MODEL_READY_S = 240  # model load on a busy 2-core machine + the startup/readiness probe periods
RUNTIME = "app.kubernetes.io/instance=chat,app.kubernetes.io/component=runtime"
ROUTER = "app.kubernetes.io/instance=front,app.kubernetes.io/component=router"

ROUTING_POLICY = {
    "apiVersion": "serving.tokenfleet.dev/v1alpha1",
    "kind": "RoutingPolicy",
    "metadata": {"name": "front"},
    # Held requests must outlast a cold start (decision period + scheduling + model load).
    "spec": {"strategy": "least-load", "router": {"replicas": 1}, "queueTimeoutSeconds": 300},
}
MODEL_DEPLOYMENT = {
    "apiVersion": "serving.tokenfleet.dev/v1alpha1",
    "kind": "ModelDeployment",
    "metadata": {"name": "chat"},
    "spec": {
        "model": {"servedName": "chat"},
        "routingPolicyRef": "front",
        # One request at a time per pod: a few concurrent streams queue at once (the signal).
        "engine": {"maxNumSeqs": 1},
        "autoscaling": {
            "minReplicas": 1,
            "maxReplicas": 2,
            "targets": {"waitingRequestsPerReplica": 1},
            "scaleUp": {"stabilizationWindowSeconds": 3},
            "scaleDown": {"stabilizationWindowSeconds": 15, "maxStep": 1, "cooldownSeconds": 0},
            "scaleToZeroAfterSeconds": 20,
        },
    },
}


def _ready(pod: dict) -> bool:
    conds = {c["type"]: c["status"] for c in pod.get("status", {}).get("conditions") or []}
    return conds.get("Ready") == "True"


def _pods(cluster, ns: str, selector: str) -> list[dict]:
    return [p for p in cluster.pods(ns, selector) if not p["metadata"].get("deletionTimestamp")]


def _ready_count(cluster, ns: str, selector: str, count: int) -> list[dict] | None:
    pods = cluster.pods(ns, selector)  # terminating ones included: "back to 1" means the other is gone
    return pods if len(pods) == count and all(_ready(p) for p in pods) else None


def _md(cluster, ns: str) -> dict:
    return cluster.get("md", "chat", ns) or {}


def _replicas(cluster, ns: str) -> int:
    return _md(cluster, ns).get("spec", {}).get("replicas")


def _scale_events(cluster, ns: str) -> list[tuple[str, str]]:
    events = sorted(
        cluster.events(ns, "chat"), key=lambda e: e.get("lastTimestamp") or e.get("eventTime") or ""
    )
    return [(e["reason"], e["message"]) for e in events if e["reason"] in ("ScaledUp", "ScaledDown")]


@pytest.mark.slow
def test_step_load_scales_out_and_back_to_zero_and_from_zero_without_a_failed_request(
    cluster, namespace, wait
):
    ns = namespace
    cluster.kubectl(
        "apply", "-n", ns, "-f", "-", stdin=yaml.safe_dump_all([ROUTING_POLICY, MODEL_DEPLOYMENT])
    )
    (router,) = wait(lambda: _ready_count(cluster, ns, ROUTER, 1), timeout=MODEL_READY_S, what="the router")
    router_url = f"http://{router['status']['podIP']}:8080"
    wait(lambda: _ready_count(cluster, ns, RUNTIME, 1), timeout=MODEL_READY_S, what="1 Ready runtime pod")
    status = wait(
        lambda: _md(cluster, ns).get("status", {}).get("autoscaling"), timeout=60, what="a decision"
    )
    assert status["desiredReplicas"] == 1

    # 1. A step: four streams against a pod that runs one at a time -> about three waiting, target 1.
    heavy = StreamingLoad(router_url, "chat", workers=4, max_tokens=48, max_requests=400).start()
    light = None
    try:
        started = time.monotonic()
        wait(lambda: _replicas(cluster, ns) == 2, timeout=120, what="the autoscaler ordering a 2nd replica")
        scale_up_s = time.monotonic() - started
        wait(lambda: _ready_count(cluster, ns, RUNTIME, 2), timeout=MODEL_READY_S, what="2 Ready pods")
        up = _md(cluster, ns)["status"]["autoscaling"]
        assert up["lastScaleReason"].startswith("scale up 1->2: waiting_requests_per_replica"), up
        heavy.wait_for_requests(sum(heavy.results.values()) + 4, timeout=180)  # served by both pods

        # 2. The load drops to one stream: nothing waits any more -> 1 replica after the 15 s window; the
        # pod chosen for removal leaves the endpoints first, then drains, while the stream keeps going.
        light = StreamingLoad(router_url, "chat", workers=1, max_tokens=48, max_requests=400).start()
        heavy.stop()
        started = time.monotonic()
        wait(lambda: _replicas(cluster, ns) == 1, timeout=120, what="the scale-down to 1")
        scale_down_s = time.monotonic() - started
        wait(lambda: _ready_count(cluster, ns, RUNTIME, 1), timeout=120, what="the removed pod gone")
        light.wait_for_requests(sum(light.results.values()) + 2, timeout=180)
    finally:
        heavy.stop()
        if light is not None:
            light.stop()
    results = heavy.results + (light.results if light is not None else {})
    print(f"step load: {dict(results)}; scale-up ordered after {scale_up_s:.0f}s, "
          f"scale-down after {scale_down_s:.0f}s of light load")  # fmt: skip
    assert results["ok"] > 0
    assert results["failed_before_start"] == 0 and results["failed_in_flight"] == 0, results

    # 3. Scale to zero: allowed now, after scaleToZeroAfterSeconds without traffic (no tokens generated
    # over the 60 s rate window either).
    patch = {"spec": {"autoscaling": {"minReplicas": 0}}}
    cluster.kubectl("patch", "md", "chat", "-n", ns, "--type=merge", "-p", json.dumps(patch))
    wait(lambda: _replicas(cluster, ns) == 0, timeout=180, what="the scale to zero")
    wait(lambda: cluster.pods(ns, RUNTIME) == [] or None, timeout=120, what="no runtime pod left")
    wait(lambda: _md(cluster, ns)["status"]["phase"] == "Ready", timeout=30, what="Ready at zero")

    # 4. A request for the model at zero: held by the router, 0 -> 1, served after the cold start.
    started = time.monotonic()
    body = {"model": "chat", "prompt": "The capital of France is", "max_tokens": 3, "temperature": 0}
    out, _ = post_json(f"{router_url}/v1/completions", body, timeout=MODEL_READY_S + 60)
    cold_s = time.monotonic() - started
    print(f"first request at zero replicas served after {cold_s:.0f}s")
    assert out["choices"][0]["text"].startswith(" Paris")
    assert _replicas(cluster, ns) == 1

    reasons = [r for r, _ in _scale_events(cluster, ns)]
    assert reasons == ["ScaledUp", "ScaledDown", "ScaledDown", "ScaledUp"], _scale_events(cluster, ns)
    assert "requests pending" in _scale_events(cluster, ns)[-1][1]
