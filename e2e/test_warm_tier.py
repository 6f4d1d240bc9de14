"""The warm tier on a real cluster, as a user meets it: a ModelDeployment with `autoscaling.idle: sleep`
scales to zero by putting its pod to sleep rather than removing it, and a request through the router wakes
that same pod — no new pod, no model load — and gets the same tokens as before the sleep.

1. one pod serves a request (the reference answer);
2. no traffic for scaleToZeroAfterSeconds -> zero awake: the pod is still there, not Ready, and its own
   /metrics says it sleeps; the count stays 1 (the warm pool) and the operator says so in its status;
3. the same request through the router: the router holds it, wakes the pod, and it is served — the time
   is printed beside the cold start measured on this fleet (figures, not asserted: CI machines vary) — with
   the same text, by the same pod, and no pod created meanwhile.
"""

from __future__ import annotations

import time
import urllib.request

import pytest
import yaml
from workload import post_json

MODEL_READY_S = 240
WAITS = {
    "router Ready": MODEL_READY_S,
    "1 runtime pod Ready": MODEL_READY_S,
    "the pod asleep": 150,
    "the request served from sleep": 120,
}
SETUP_S = 180
RUNTIME = "app.kubernetes.io/instance=warm,app.kubernetes.io/component=runtime"
ROUTER = "app.kubernetes.io/instance=warm-front,app.kubernetes.io/component=router"

ROUTING_POLICY = {
    "apiVersion": "serving.tokenfleet.dev/v1alpha1",
    "kind": "RoutingPolicy",
    "metadata": {"name": "warm-front"},
    "spec": {"strategy": "least-load", "router": {"replicas": 1}, "queueTimeoutSeconds": 120},
}
MODEL_DEPLOYMENT = {
    "apiVersion": "serving.tokenfleet.dev/v1alpha1",
    "kind": "ModelDeployment",
    "metadata": {"name": "warm"},
    "spec": {
        "model": {"servedName": "warm"},
        "routingPolicyRef": "warm-front",
        "autoscaling": {
            "minReplicas": 0,
            "maxReplicas": 1,
            "targets": {"waitingRequestsPerReplica": 1},
            "scaleDown": {"stabilizationWindowSeconds": 0, "cooldownSeconds": 0},
            "scaleToZeroAfterSeconds": 10,
            "idle": "sleep",
            "warmPoolSize": 1,
        },
    },
}
REQUEST = {"model": "warm", "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}


def _ready(pod: dict) -> bool:
    conds = {c["type"]: c["status"] for c in pod.get("status", {}).get("conditions") or []}
    return conds.get("Ready") == "True"


def _pod_url(pod: dict) -> str:
    return f"http://{pod['status']['podIP']}:8000"


def _sleep_state(pod: dict) -> float | None:
    """The pod's own word (its open /metrics), not the operator's."""
    with urllib.request.urlopen(_pod_url(pod) + "/metrics", timeout=5) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith("tokenfleet:engine_sleep_state"):
                return float(line.rsplit(" ", 1)[1])
    return None


@pytest.mark.slow
@pytest.mark.timeout(sum(WAITS.values()) + SETUP_S)
def test_idle_pod_sleeps_instead_of_leaving_and_the_router_wakes_it_for_a_request(cluster, namespace, wait):
    def until(what: str, predicate):
        return wait(predicate, timeout=WAITS[what], what=what)

    ns = namespace
    cluster.kubectl(
        "apply", "-n", ns, "-f", "-", stdin=yaml.safe_dump_all([ROUTING_POLICY, MODEL_DEPLOYMENT])
    )
    (router,) = until(
        # Exactly one: the router rolls once when the deployment's backend (and its key) joins its config.
        "router Ready",
        lambda: (p := cluster.pods(ns, ROUTER)) and len(p) == 1 and _ready(p[0]) and p,
    )
    router_url = f"http://{router['status']['podIP']}:8080"
    (pod,) = until(
        "1 runtime pod Ready", lambda: (p := cluster.pods(ns, RUNTIME)) and len(p) == 1 and _ready(p[0]) and p
    )

    # 1. The reference answer, from the awake pod.
    before, headers = post_json(f"{router_url}/v1/completions", REQUEST, timeout=120)
    assert headers.get("x-tokenfleet-endpoint") == _pod_url(pod), headers

    # 2. Idle -> zero awake, and the pod sleeps instead of leaving.
    def asleep():
        md = cluster.get("md", "warm", ns) or {}
        status = (md.get("status") or {}).get("autoscaling") or {}
        pods = cluster.pods(ns, RUNTIME)
        if status.get("sleepingReplicas") == 1 and len(pods) == 1 and not _ready(pods[0]):
            return md, pods[0]
        return None

    md, slept = until("the pod asleep", asleep)
    assert slept["metadata"]["name"] == pod["metadata"]["name"]
    assert md["spec"]["replicas"] == 1 and md["status"]["autoscaling"]["desiredReplicas"] == 0
    assert md["status"]["autoscaling"]["scaledReplicas"] == 1
    assert _sleep_state(slept) == 1.0
    reasons = [e["reason"] for e in cluster.events(ns, "warm")]
    assert "PodsAsleep" in reasons, reasons

    # 3. A request wakes it: held by the router, the same pod serves it, with the same tokens.
    started = time.monotonic()
    after, headers = post_json(
        f"{router_url}/v1/completions", REQUEST, timeout=WAITS["the request served from sleep"]
    )
    wake_s = time.monotonic() - started
    assert after["choices"][0]["text"] == before["choices"][0]["text"], (before, after)
    assert headers.get("x-tokenfleet-endpoint") == _pod_url(pod), headers
    pods = cluster.pods(ns, RUNTIME)
    assert [p["metadata"]["name"] for p in pods] == [pod["metadata"]["name"]], "a new pod was created"
    assert _sleep_state(pods[0]) == 0.0
    cold = md["status"]["autoscaling"].get("coldStartSeconds")
    print(f"request at zero awake (idle: sleep) served after {wake_s:.1f}s by the woken pod; "
          f"this fleet's measured cold start: {cold}s")  # fmt: skip
