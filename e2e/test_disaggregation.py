"""A disaggregated ModelDeployment on a real cluster: the operator runs a prefill and a decode Deployment,
the router learns their roles from the two Services' EndpointSlices, and a completion through the router
is computed on the prefill pod, moved to the decode pod by block hash, and equals a plain pod's answer.
Then the decode role is autoscaled on its own (its count, its status; prefill untouched), and the
deployment is switched back to aggregated serving: the roles keep serving until the aggregated pod can, then
their Deployments, Services and ConfigMaps go, and their counts in the status with them."""

from __future__ import annotations

import json
import re
import urllib.request

import pytest
import yaml
from tokenfleet.runtime.router.config import Discovery
from workload import post_json

MODEL_READY_S = 300  # two model loads on a busy 2-core machine + the probe periods
ROUTER = "app.kubernetes.io/instance=front,app.kubernetes.io/component=router"
PREFILL = "app.kubernetes.io/instance=chat-prefill,app.kubernetes.io/component=runtime"
DECODE = "app.kubernetes.io/instance=chat-decode,app.kubernetes.io/component=runtime"
ROUTING_POLICY = {
    "apiVersion": "serving.tokenfleet.dev/v1alpha1",
    "kind": "RoutingPolicy",
    "metadata": {"name": "front"},
    "spec": {"strategy": "least-load", "router": {"replicas": 1}},
}
MODEL_DEPLOYMENT = {
    "apiVersion": "serving.tokenfleet.dev/v1alpha1",
    "kind": "ModelDeployment",
    "metadata": {"name": "chat"},
    "spec": {
        "model": {"servedName": "chat"},
        "routingPolicyRef": "front",
        "disaggregation": {"prefill": {"replicas": 1}, "decode": {"replicas": 1}},
    },
}
PROMPT = (
    "The museum's east wing holds maps, globes and the letters of explorers. " * 4 + "Its west wing holds"
)


def _ready(pod: dict) -> bool:
    conds = {c["type"]: c["status"] for c in pod.get("status", {}).get("conditions") or []}
    return conds.get("Ready") == "True"


def _one_ready(cluster, ns: str, selector: str) -> dict | None:
    pods = [p for p in cluster.pods(ns, selector) if not p["metadata"].get("deletionTimestamp")]
    return pods[0] if len(pods) == 1 and _ready(pods[0]) else None


def _received_blocks(url: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    m = re.search(
        r'^tokenfleet:kv_transfer_blocks_total\{[^}]*direction="received"[^}]*\} ([0-9.e+]+)$', text, re.M
    )
    return float(m.group(1)) if m else 0.0


def _roles_seen(cluster, ns: str, monkeypatch, wait) -> dict[str, str]:
    """What the router's EndpointSlice watch (with its pod-label watch) reports for Service `chat-all`."""
    import asyncio

    from tokenfleet.runtime.router.config import Backend
    from tokenfleet.runtime.router.endpoints import EndpointSet, EndpointSliceWatch

    monkeypatch.setenv("KUBECONFIG", str(cluster.kubeconfig("admin")))
    backend = Backend(name="chat-all", model="chat", url=f"http://chat-all.{ns}.svc:8000")

    async def watch() -> dict[str, str]:
        endpoints = EndpointSet(Discovery())
        loop = asyncio.get_running_loop()
        w = EndpointSliceWatch(backend, ns, lambda b, urls: endpoints.sync(b, urls), loop)
        w.start()
        try:
            deadline = loop.time() + 60
            while loop.time() < deadline:
                roles = {e.url: e.role for e in endpoints.by_id.values()}
                if len(roles) == 2 and "both" not in roles.values():
                    return roles
                await asyncio.sleep(0.5)
            return roles
        finally:
            w.stop()

    return asyncio.run(watch())


@pytest.mark.slow
def test_a_disaggregated_model_deployment_serves_through_the_router(cluster, namespace, wait, monkeypatch):
    ns = namespace
    cluster.kubectl(
        "apply", "-n", ns, "-f", "-", stdin=yaml.safe_dump_all([ROUTING_POLICY, MODEL_DEPLOYMENT])
    )
    router = wait(lambda: _one_ready(cluster, ns, ROUTER), timeout=MODEL_READY_S, what="the router")
    prefill = wait(lambda: _one_ready(cluster, ns, PREFILL), timeout=MODEL_READY_S, what="the prefill pod")
    decode = wait(lambda: _one_ready(cluster, ns, DECODE), timeout=MODEL_READY_S, what="the decode pod")
    assert prefill["metadata"]["labels"]["serving.tokenfleet.dev/role"] == "prefill"
    assert decode["metadata"]["labels"]["serving.tokenfleet.dev/role"] == "decode"
    router_url = f"http://{router['status']['podIP']}:8080"
    decode_url = f"http://{decode['status']['podIP']}:8000"
    prefill_url = f"http://{prefill['status']['podIP']}:8000"

    body = {"model": "chat", "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    plain, _ = post_json(prefill_url + "/v1/completions", body)  # the prefill pod answering alone

    def routed():  # the router's discovery must have seen both roles' endpoints
        try:
            out, headers = post_json(router_url + "/v1/completions", body)
        except OSError:  # urllib's HTTPError/URLError: not routable yet
            return None
        return headers.get("x-tokenfleet-endpoint") == decode_url and _received_blocks(decode_url) > 0 and out

    out = wait(routed, timeout=120, what="a completion through the prefill and decode pods")
    assert out["choices"][0]["text"] == plain["choices"][0]["text"]

    # One Service over both roles' pods: the router's discovery gives each endpoint its pod's role label.
    both = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "chat-all"},
        "spec": {
            "selector": {"serving.tokenfleet.dev/model-deployment": "chat"},
            "ports": [{"name": "http", "port": 8000, "targetPort": "http"}],
        },
    }
    cluster.kubectl("apply", "-n", ns, "-f", "-", stdin=yaml.safe_dump(both))
    assert _roles_seen(cluster, ns, monkeypatch, wait) == {prefill_url: "prefill", decode_url: "decode"}

    # Per-role autoscaling: the decode role only, held at 2 by its bounds (no load needed to decide).
    decode_autoscaling = {"minReplicas": 2, "maxReplicas": 2, "targets": {"kvCacheUsage": 0.9}}
    patch = {"spec": {"disaggregation": {"decode": {"autoscaling": decode_autoscaling}}}}
    cluster.kubectl("patch", "-n", ns, "md", "chat", "--type=merge", "-p", json.dumps(patch))

    def decode_scaled():
        md = cluster.get("modeldeployments.serving.tokenfleet.dev", "chat", ns)
        dep = cluster.get("deployments", "chat-decode", ns)
        status = (((md or {}).get("status") or {}).get("roles") or {}).get("decode") or {}
        scaled = md["spec"]["disaggregation"]["decode"]["replicas"] == 2 and dep["spec"]["replicas"] == 2
        return scaled and (status.get("autoscaling") or {}).get("desiredReplicas") == 2 and md

    # A 15 s autoscaler tick, the patch and a reconcile, while the second decode pod loads its model.
    md = wait(decode_scaled, timeout=120, what="the decode role scaled to its minReplicas 2")
    assert md["spec"]["disaggregation"]["prefill"]["replicas"] == 1
    assert cluster.get("deployments", "chat-prefill", ns)["spec"]["replicas"] == 1
    assert "autoscaling" not in (md["status"].get("roles") or {}).get("prefill", {})
    assert md["status"]["roles"]["prefill"] == {"replicas": 1, "readyReplicas": 1}  # each role's pods
    assert not md["status"].get("autoscaling")

    # Back to aggregated serving: one Deployment `chat`. The roles' pods keep serving until it has an
    # available pod (a model load); then the roles' children are removed, and status.roles with them.
    switch = {"spec": {"disaggregation": None}}
    cluster.kubectl("patch", "-n", ns, "md", "chat", "--type=merge", "-p", json.dumps(switch))
    role_children = [
        (kind, f"chat-{role}{suffix}")
        for role in ("prefill", "decode")
        for kind, suffix in (("deployments", ""), ("services", ""), ("configmaps", "-runtime"))
    ]

    def available(deployment: dict | None) -> int:
        return int(((deployment or {}).get("status") or {}).get("availableReplicas") or 0)

    wait(lambda: cluster.get("deployments", "chat", ns), timeout=60, what="the aggregated Deployment")
    # In this order: a decode Deployment already gone means `chat` had an available pod before.
    decode_left = cluster.get("deployments", "chat-decode", ns)
    assert decode_left is not None or available(cluster.get("deployments", "chat", ns)) >= 1

    def switched():
        gone = all(cluster.get(kind, name, ns) is None for kind, name in role_children)
        md = cluster.get("modeldeployments.serving.tokenfleet.dev", "chat", ns)
        return gone and not ((md or {}).get("status") or {}).get("roles")

    wait(switched, timeout=MODEL_READY_S, what="the prefill/decode children replaced by the aggregated ones")
    assert available(cluster.get("deployments", "chat", ns)) >= 1
    assert cluster.get("services", "chat", ns) is not None
    assert cluster.get("configmaps", "chat-runtime", ns) is not None
