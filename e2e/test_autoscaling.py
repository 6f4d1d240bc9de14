"""Autoscaling on a real cluster, as a user meets it: `kubectl apply` a ModelDeployment with
`spec.autoscaling`, send load through its router, and watch the operator size the fleet from what the real
CPU pods report on /metrics.

One story (one fleet, each step needs the previous one):
1. a step load (more streams than the pod runs at once) raises waiting requests -> 1 -> 2 replicas;
2. two replicas held (minReplicas 2) while the load drops to two long streams, one on each pod (checked);
   then minReplicas 1 -> back to 1 replica after the scale-down window; the removed pod was serving a stream
   when it was removed (checked, not assumed), and that stream ends well (drained, or handed back and
   continued on the other pod);
3. minReplicas edited to 0, no traffic -> 0 pods;
4. a request for the model's alias (a RoutingPolicy modelRoute) arrives -> the router holds it, counting it
   under the deployment's served model, the operator sees the demand, 0 -> 1, the request is served after
   the cold start.
Across the whole run not one request fails (429 and 503 count as failures here).

Every wait has its budget in WAITS, and the test's timeout is their sum: a slow step fails with its own
message, never with pytest's timeout in the middle of another.
"""

from __future__ import annotations

import contextlib
import json
import math
import time

import pytest
import yaml
from workload import STOP_TIMEOUT_S, StreamingLoad, post_json

MODEL_READY_S = 240  # model load on a busy 2-core machine + the startup/readiness probe periods
WAITS = {
    "router Ready": MODEL_READY_S,
    "1 runtime pod Ready": MODEL_READY_S,
    "a first decision": 60,
    "scale-up ordered": 120,
    "2 pods Ready": MODEL_READY_S,
    "requests served by both pods": 180,
    "heavy load stopped": STOP_TIMEOUT_S,
    "a stream on a pod": 120,
    "a stream on each pod": 180,
    "a pod removed": 120,
    "the removed pod gone": 120,
    "light load stopped": STOP_TIMEOUT_S,
    "scale to zero": 180,
    "no runtime pod left": 120,
    "Ready at zero": 30,
    "the request at zero served": MODEL_READY_S + 60,
}
# Session fixtures (the cluster, when this test comes first) and the kubectl calls between the waits.
SETUP_S = 180
# Each light stream must outlast the scale-down, so that whichever pod the ReplicaSet removes is serving one
# then: from the stream's start, the wait for a stream on each pod, the 15 s window, a decision period and the
# kubectl calls around them. Between a worker's streams its pod is idle for a moment, and the operator's
# deletion cost removes the idlest pod: a decision at that moment would remove a pod serving nothing.
LIGHT_HOLD_S = 45
LIGHT_TOKENS_MAX = 6000  # well inside the built-in model's context
RUNTIME = "app.kubernetes.io/instance=chat,app.kubernetes.io/component=runtime"
ROUTER = "app.kubernetes.io/instance=front,app.kubernetes.io/component=router"

ROUTING_POLICY = {
    "apiVersion": "serving.tokenfleet.dev/v1alpha1",
    "kind": "RoutingPolicy",
    "metadata": {"name": "front"},
    # Held requests must outlast a cold start (decision period + scheduling + model load).
    "spec": {
        "strategy": "least-load",
        "router": {"replicas": 1},
        "queueTimeoutSeconds": 300,
        # An alias: a request for it at zero replicas must wake `chat` (the router counts it under `chat`).
        "modelRoutes": [{"model": "assistant", "backends": ["chat"]}],
    },
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


def _url(pod: dict) -> str:
    return f"http://{pod['status']['podIP']}:8000"  # as the router names the pod (x-tokenfleet-endpoint)


def _light_tokens(load: StreamingLoad) -> int:
    """Tokens for a stream that lasts LIGHT_HOLD_S, from the fastest decode pace among `load`'s streams. A
    pod runs one sequence at a time here, so a stream's events after its first are pure decode; a fixed
    count would last seconds on a fast machine and a minute on a busy one."""
    paces = [
        (s.ended - s.first_event) / (s.events - 2)
        for s in load.streams
        if s.outcome == "ok" and s.first_event is not None and s.events > 8
    ]
    assert paces, f"no finished stream to measure the decode pace on: {dict(load.results)}"
    return max(48, min(LIGHT_TOKENS_MAX, math.ceil(LIGHT_HOLD_S / min(paces))))


def _set_min_replicas(cluster, ns: str, count: int) -> None:
    patch = {"spec": {"autoscaling": {"minReplicas": count}}}
    cluster.kubectl("patch", "md", "chat", "-n", ns, "--type=merge", "-p", json.dumps(patch))


def _terminating(cluster, ns: str) -> list[dict]:
    return [p for p in cluster.pods(ns, RUNTIME) if p["metadata"].get("deletionTimestamp")]


def _scale_events(cluster, ns: str) -> list[tuple[str, str]]:
    events = sorted(
        cluster.events(ns, "chat"), key=lambda e: e.get("lastTimestamp") or e.get("eventTime") or ""
    )
    return [(e["reason"], e["message"]) for e in events if e["reason"] in ("ScaledUp", "ScaledDown")]


@pytest.mark.slow
@pytest.mark.timeout(sum(WAITS.values()) + SETUP_S)
def test_step_load_scales_out_and_back_to_zero_and_from_zero_without_a_failed_request(
    cluster, namespace, wait
):
    def until(what: str, predicate):
        return wait(predicate, timeout=WAITS[what], what=what)

    ns = namespace
    cluster.kubectl(
        "apply", "-n", ns, "-f", "-", stdin=yaml.safe_dump_all([ROUTING_POLICY, MODEL_DEPLOYMENT])
    )
    (router,) = until("router Ready", lambda: _ready_count(cluster, ns, ROUTER, 1))
    router_url = f"http://{router['status']['podIP']}:8080"
    until("1 runtime pod Ready", lambda: _ready_count(cluster, ns, RUNTIME, 1))
    status = until("a first decision", lambda: _md(cluster, ns).get("status", {}).get("autoscaling"))
    assert status["desiredReplicas"] == 1

    # 1. A step: four streams against a pod that runs one at a time -> about three waiting, target 1.
    heavy = StreamingLoad(router_url, "chat", workers=4, max_tokens=48, max_requests=400).start()
    light = None
    try:
        started = time.monotonic()
        until("scale-up ordered", lambda: _replicas(cluster, ns) == 2)
        scale_up_s = time.monotonic() - started
        pods = until("2 pods Ready", lambda: _ready_count(cluster, ns, RUNTIME, 2))
        up = _md(cluster, ns)["status"]["autoscaling"]
        assert up["lastScaleReason"].startswith("scale up 1->2: waiting_requests_per_replica"), up
        heavy.wait_for_requests(heavy.count() + 4, timeout=WAITS["requests served by both pods"])

        # 2. Two replicas are held while the load drops to two long streams: the first one's pod is busy
        # when the second is routed, so least-load puts one on each pod (checked). Then nothing waits any
        # more -> 1 replica after the 15 s window, and whichever pod the ReplicaSet removes is still serving
        # its stream (each lasts LIGHT_HOLD_S). That pod leaves the endpoints first (preStop), then drains:
        # its stream finishes there or is handed back and continued on the other pod.
        _set_min_replicas(cluster, ns, 2)  # no scale-down before every pod serves a stream
        heavy.stop(timeout=WAITS["heavy load stopped"])
        light_tokens = _light_tokens(heavy)
        light = StreamingLoad(
            router_url, "chat", workers=1, max_tokens=light_tokens, max_requests=400
        ).start()
        until("a stream on a pod", light.in_flight)
        light.add_worker()
        urls = {_url(p) for p in pods}
        until("a stream on each pod", lambda: urls <= {s.endpoint for s in light.in_flight()})
        _set_min_replicas(cluster, ns, 1)
        started = time.monotonic()
        (victim,) = wait(lambda: _terminating(cluster, ns), timeout=WAITS["a pod removed"], interval=0.1,
                         what="a pod removed")  # fmt: skip
        seen = time.monotonic()  # the victim is terminating from here on (at the latest)
        scale_down_s = seen - started
        assert _replicas(cluster, ns) == 1
        until("the removed pod gone", lambda: _ready_count(cluster, ns, RUNTIME, 1))
        light.stop(timeout=WAITS["light load stopped"])
    finally:  # after a failure, the failure is the one to report, not a stream still running
        with contextlib.suppress(TimeoutError):
            heavy.stop()
        with contextlib.suppress(TimeoutError):
            if light is not None:
                light.stop()
    results = heavy.results + (light.results if light is not None else {})
    print(f"step load: {dict(results)}; scale-up ordered after {scale_up_s:.0f}s, "
          f"a pod removed {scale_down_s:.0f}s after minReplicas went back to 1; "
          f"light streams of {light_tokens} tokens")  # fmt: skip
    assert results["ok"] > 0
    assert results["failed_before_start"] == 0 and results["failed_in_flight"] == 0, results
    # The scale-down removed a pod that was serving: the case that could lose a stream, and none was lost.
    held = light.served_after(_url(victim), seen)
    assert held, f"the removed pod {_url(victim)} served no stream once terminating: the check proves nothing"
    assert all(s.outcome == "ok" for s in held), held
    print(f"the removed pod was serving {len(held)} stream(s) when seen terminating or later; all ended well")

    # 3. Scale to zero: allowed now, after scaleToZeroAfterSeconds without traffic (no tokens generated
    # over the 60 s rate window either).
    _set_min_replicas(cluster, ns, 0)
    until("scale to zero", lambda: _replicas(cluster, ns) == 0)
    until("no runtime pod left", lambda: cluster.pods(ns, RUNTIME) == [] or None)
    until("Ready at zero", lambda: _md(cluster, ns)["status"]["phase"] == "Ready")
    # What a request at zero will wait for, measured on the pods that ran (kept with no pod left).
    cold_start = _md(cluster, ns)["status"]["autoscaling"]["coldStartSeconds"]
    assert isinstance(cold_start, int | float) and 0 < cold_start < MODEL_READY_S, cold_start

    # 4. A request for the model's alias at zero: held by the router, 0 -> 1, served after the cold start,
    # the reply naming the model that served it.
    started = time.monotonic()
    body = {"model": "assistant", "prompt": "The capital of France is", "max_tokens": 3, "temperature": 0}
    out, _ = post_json(f"{router_url}/v1/completions", body, timeout=WAITS["the request at zero served"])
    cold_s = time.monotonic() - started
    print(f"first request at zero replicas (through the alias) served after {cold_s:.0f}s "
          f"(measured cold start of the pods before: {cold_start:.0f}s)")  # fmt: skip
    assert out["choices"][0]["text"].startswith(" Paris") and out["model"] == "chat"
    assert _replicas(cluster, ns) == 1

    reasons = [r for r, _ in _scale_events(cluster, ns)]
    assert reasons == ["ScaledUp", "ScaledDown", "ScaledDown", "ScaledUp"], _scale_events(cluster, ns)
    assert "requests pending" in _scale_events(cluster, ns)[-1][1]
