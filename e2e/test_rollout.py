"""Scenarios 1 and 2: apply the examples -> children with ownerReferences, probes and resources; readiness
flows from the Deployment's status into the ModelDeployment; `kubectl scale md` drives the Deployment."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

EXAMPLES = Path(__file__).resolve().parent.parent / "manifests" / "examples"


def _owner(obj: dict, kind: str) -> dict:
    refs = obj["metadata"].get("ownerReferences") or []
    assert len(refs) == 1, refs
    assert refs[0]["kind"] == kind and refs[0]["controller"] is True
    return refs[0]


def _make_ready(cluster, namespace: str, name: str, replicas: int) -> None:
    """Play the kubelet + ReplicaSet controller: report `replicas` ready pods on the current generation."""
    dep = cluster.get("deployment", name, namespace)
    status = {
        "observedGeneration": dep["metadata"]["generation"],
        "replicas": replicas,
        "updatedReplicas": replicas,
        "readyReplicas": replicas,
        "availableReplicas": replicas,
    }
    cluster.kubectl(
        "patch", "deployment", name, "-n", namespace, "--subresource=status", "--type=merge",
        "-p", json.dumps({"status": status}),
    )  # fmt: skip


def test_examples_reconcile_into_children_and_readiness(cluster, namespace, wait):
    cluster.kubectl("apply", "-n", namespace, "-k", str(EXAMPLES))
    md = wait(lambda: cluster.get("md", "smollm2", namespace), what="md")
    uid = md["metadata"]["uid"]

    # ConfigMap: the runtime config, built from the spec and the referenced CachePolicy.
    cm = wait(lambda: cluster.get("configmap", "smollm2-runtime", namespace), what="configmap")
    assert _owner(cm, "ModelDeployment")["uid"] == uid
    runtime = yaml.safe_load(cm["data"]["runtime.yaml"])
    assert runtime["model"]["model"] == "smollm2-135m-instruct"
    assert runtime["model"]["served_name"] == "smollm2"
    assert runtime["model"]["device"] == "cpu"
    assert runtime["cache"]["ttl_seconds"] == 600
    assert runtime["scheduler"]["max_num_seqs"] == 16
    assert runtime["server"]["host"] == "0.0.0.0"

    # Deployment: command, probes, resources, security, config hash.
    dep = wait(lambda: cluster.get("deployment", "smollm2", namespace), what="deployment")
    assert _owner(dep, "ModelDeployment")["uid"] == uid
    pod = dep["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["command"] == ["tokenfleet", "serve", "--config", "/etc/tokenfleet/runtime.yaml"]
    assert c["livenessProbe"]["httpGet"]["path"] == "/health"
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert c["startupProbe"]["failureThreshold"] * c["startupProbe"]["periodSeconds"] >= 300
    assert c["resources"]["requests"] == {"cpu": "2", "memory": "4Gi"}
    assert "nvidia.com/gpu" not in c["resources"]["limits"]
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["terminationGracePeriodSeconds"] == 35
    assert dep["spec"]["template"]["metadata"]["annotations"]["serving.tokenfleet.dev/config-hash"]

    svc = wait(lambda: cluster.get("service", "smollm2", namespace), what="service")
    assert _owner(svc, "ModelDeployment")["uid"] == uid
    assert svc["spec"]["selector"] == dep["spec"]["selector"]["matchLabels"]

    # The GPU example: nvidia.com/gpu sized by the spec, the PVC mounted read-only, the tolerations.
    gpu = wait(lambda: cluster.get("deployment", "llama-8b", namespace), what="gpu deployment")
    gpod = gpu["spec"]["template"]["spec"]
    assert gpod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert {"name": "model", "persistentVolumeClaim": {"claimName": "models", "readOnly": True}} in gpod[
        "volumes"
    ]
    gcm = cluster.get("configmap", "llama-8b-runtime", namespace)
    assert yaml.safe_load(gcm["data"]["runtime.yaml"])["model"]["quantization"] == "fp8"

    # The router: its config lists both ModelDeployments as backends.
    rcm = wait(lambda: cluster.get("configmap", "chat-routing-router", namespace), what="router configmap")
    _owner(rcm, "RoutingPolicy")
    routed = yaml.safe_load(rcm["data"]["router.yaml"])
    assert routed["routing"]["strategy"] == "prefix-affinity"
    assert [b["name"] for b in routed["backends"]] == ["llama-8b", "smollm2"]
    assert routed["backends"][1]["url"] == f"http://smollm2.{namespace}.svc:8000"
    assert cluster.get("deployment", "chat-routing-router", namespace)["spec"]["replicas"] == 2
    assert (
        cluster.get("rolebinding", "chat-routing-router", namespace)["roleRef"]["name"] == "tokenfleet-router"
    )

    # Status: Progressing until pods report ready, then Ready with readyReplicas.
    # (Pending first if the MD was seen before its policies: apply order is kustomize's, not ours.)
    st = wait(
        lambda: (
            (s := cluster.get("md", "smollm2", namespace).get("status") or {}).get("phase") == "Progressing"
            and s
        ),
        what="phase Progressing",
    )
    assert st["readyReplicas"] == 0
    assert st["endpoint"] == f"http://smollm2.{namespace}.svc:8000"
    assert st["observedGeneration"] == md["metadata"]["generation"]
    _make_ready(cluster, namespace, "smollm2", 1)
    st = wait(
        lambda: (s := cluster.get("md", "smollm2", namespace)["status"])["phase"] == "Ready" and s,
        what="phase Ready",
    )
    assert st["readyReplicas"] == 1
    ready = {c["type"]: c for c in st["conditions"]}
    assert ready["Ready"]["status"] == "True" and ready["PoliciesResolved"]["status"] == "True"
    printed = cluster.kubectl("get", "md", "smollm2", "-n", namespace)
    assert "Ready" in printed and "smollm2-135m-instruct" in printed


def test_kubectl_scale_drives_the_deployment(cluster, namespace, wait):
    cluster.kubectl("apply", "-n", namespace, "-f", str(EXAMPLES / "cpu-modeldeployment.yaml"))
    cluster.kubectl("apply", "-n", namespace, "-f", str(EXAMPLES / "cachepolicy.yaml"))
    cluster.kubectl("apply", "-n", namespace, "-f", str(EXAMPLES / "routingpolicy.yaml"))
    wait(lambda: cluster.get("deployment", "smollm2", namespace), what="deployment")

    cluster.kubectl("scale", "md/smollm2", "-n", namespace, "--replicas=3")
    wait(lambda: cluster.get("deployment", "smollm2", namespace)["spec"]["replicas"] == 3, what="3 replicas")
    _make_ready(cluster, namespace, "smollm2", 3)
    st = wait(
        lambda: (s := cluster.get("md", "smollm2", namespace)["status"]).get("readyReplicas") == 3 and s,
        what="3 ready",
    )
    assert st["phase"] == "Ready" and st["replicas"] == 3
    # The scale subresource reads back through the same paths kubectl and an HPA use.
    scale = json.loads(
        cluster.kubectl(
            "get",
            "--raw",
            f"/apis/serving.tokenfleet.dev/v1alpha1/namespaces/{namespace}/modeldeployments/smollm2/scale",
        )
    )
    assert scale["spec"]["replicas"] == 3 and scale["status"]["replicas"] == 3
    assert (
        scale["status"]["selector"]
        == "app.kubernetes.io/instance=smollm2,app.kubernetes.io/component=runtime"
    )
