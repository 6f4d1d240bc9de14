"""A disaggregated ModelDeployment on a real cluster: the operator runs a prefill and a decode Deployment,
the router learns their roles from the two Services' EndpointSlices, and a completion through the router
is computed on the prefill pod, moved to the decode pod by block hash, and equals a plain pod's answer."""

from __future__ import annotations

import re
import urllib.request

import pytest
import yaml
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


@pytest.mark.slow
def test_a_disaggregated_model_deployment_serves_through_the_router(cluster, namespace, wait):
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
