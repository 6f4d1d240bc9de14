"""Gateway-ready: one InferencePool (Gateway API Inference Extension, inference.networking.k8s.io/v1) per
ModelDeployment once the CRD is installed, in sync with the spec, garbage-collected with its owner; without
the CRD the operator says so once and reconciles everything else as before.

The CRD is the vendored one in manifests/gateway/ (the published v1 API). ModelDeployments here run zero
replicas: the pool is about selection, not about serving, so no model is loaded.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

POOL_CRD = "inferencepools.inference.networking.k8s.io"
POOL_MANIFEST = (
    Path(__file__).resolve().parents[1]
    / "manifests"
    / "gateway"
    / "inference.networking.k8s.io_inferencepools.yaml"
)
NOT_INSTALLED = "InferencePool CRD (inference.networking.k8s.io/v1) is not installed"


def _md(name: str, **spec) -> str:
    body = {
        "apiVersion": "serving.tokenfleet.dev/v1alpha1",
        "kind": "ModelDeployment",
        "metadata": {"name": name},
        "spec": {"replicas": 0, **spec},
    }
    return json.dumps(body)


@pytest.fixture
def pool_crd(cluster) -> Iterator[None]:
    """Installs the vendored CRD for one test and removes it after (later tests run without it again)."""
    cluster.kubectl("apply", "-f", str(POOL_MANIFEST))
    cluster.kubectl("wait", "--for=condition=Established", f"crd/{POOL_CRD}", "--timeout=30s")
    yield
    cluster.kubectl("delete", "crd", POOL_CRD, "--ignore-not-found", "--wait=true", "--timeout=60s")


def test_without_the_crd_everything_else_reconciles_and_the_log_says_so_once(
    cluster, operator, namespace, wait
):
    assert cluster.get("crd", POOL_CRD, "") is None, "this test needs a cluster without the InferencePool CRD"
    for name in ("first", "second"):
        cluster.kubectl("apply", "-n", namespace, "-f", "-", stdin=_md(name))
    for name in ("first", "second"):
        wait(lambda n=name: cluster.get("deployment", n, namespace), what=f"deployment {name}")
        assert cluster.get("service", name, namespace) is not None
        assert cluster.get("configmap", f"{name}-runtime", namespace) is not None
        md = wait(
            lambda n=name: (
                (cluster.get("md", n, namespace).get("status") or {}).get("phase") == "Ready"
                and cluster.get("md", n, namespace)
            ),
            what=f"{name} Ready (scaled to zero)",
        )
        assert md["status"]["observedGeneration"] == md["metadata"]["generation"]
    wait(lambda: NOT_INSTALLED in operator.log(), what="the operator noting the missing CRD")
    # A deleted child comes back on the next timer resync: proof that reconciling went on after the
    # absence was noted, and that it was not noted again.
    cluster.kubectl("delete", "service", "first", "-n", namespace, "--wait=true")
    wait(
        lambda: cluster.get("service", "first", namespace),
        timeout=30,
        what="the Service repaired by a resync",
    )
    assert operator.log().count(NOT_INSTALLED) == 1


def test_inference_pool_follows_the_model_deployment(cluster, operator, namespace, wait, pool_crd):
    cluster.kubectl("apply", "-n", namespace, "-f", "-", stdin=_md("chat"))
    pool = wait(
        lambda: cluster.get("inferencepool", "chat", namespace), timeout=30, what="InferencePool chat"
    )
    dep = wait(lambda: cluster.get("deployment", "chat", namespace), what="deployment chat")
    md = cluster.get("md", "chat", namespace)

    # The pool selects the runtime pods (those of this deployment only), on the port the runtime serves.
    template_labels = dep["spec"]["template"]["metadata"]["labels"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= template_labels.items()
    assert pool["spec"]["selector"]["matchLabels"]["serving.tokenfleet.dev/model-deployment"] == "chat"
    (container,) = dep["spec"]["template"]["spec"]["containers"]
    assert pool["spec"]["targetPorts"] == [{"number": container["ports"][0]["containerPort"]}]
    picker = pool["spec"]["endpointPickerRef"]
    assert (picker["name"], picker["kind"], picker["port"], picker["failureMode"]) == (
        "chat-epp",
        "Service",
        {"number": 9002},
        "FailClose",
    )
    (owner,) = pool["metadata"]["ownerReferences"]
    assert (owner["kind"], owner["uid"]) == ("ModelDeployment", md["metadata"]["uid"])

    # Kept in sync: another endpoint picker in the spec reaches the pool.
    patch = {"spec": {"inferencePool": {"endpointPicker": {"name": "shared-epp", "failureMode": "FailOpen"}}}}
    cluster.kubectl("patch", "md", "chat", "-n", namespace, "--type=merge", "-p", json.dumps(patch))
    wait(
        lambda: (
            (cluster.get("inferencepool", "chat", namespace) or {})
            .get("spec", {})
            .get("endpointPickerRef", {})
            .get("name")
            == "shared-epp"
        ),
        what="the pool to name the new picker",
    )
    assert (
        cluster.get("inferencepool", "chat", namespace)["spec"]["endpointPickerRef"]["failureMode"]
        == "FailOpen"
    )

    # Turned off in the spec: the pool goes, the rest stays.
    cluster.kubectl(
        "patch",
        "md",
        "chat",
        "-n",
        namespace,
        "--type=merge",
        "-p",
        '{"spec": {"inferencePool": {"enabled": false}}}',
    )
    wait(lambda: cluster.get("inferencepool", "chat", namespace) is None, what="the pool removed")
    assert cluster.get("deployment", "chat", namespace) is not None
    cluster.kubectl(
        "patch",
        "md",
        "chat",
        "-n",
        namespace,
        "--type=merge",
        "-p",
        '{"spec": {"inferencePool": {"enabled": true}}}',
    )
    wait(lambda: cluster.get("inferencepool", "chat", namespace), what="the pool back")

    # Deleting the ModelDeployment removes the pool (garbage collection through the owner reference).
    cluster.kubectl("delete", "md", "chat", "-n", namespace, "--wait=true")
    wait(
        lambda: cluster.get("inferencepool", "chat", namespace) is None, timeout=30, what="the pool collected"
    )
    wait(
        lambda: cluster.get("deployment", "chat", namespace) is None,
        timeout=30,
        what="the deployment collected",
    )


def test_a_disaggregated_deployments_pool_selects_both_roles(cluster, operator, namespace, wait, pool_crd):
    roles = {"prefill": {"replicas": 0}, "decode": {"replicas": 0}}
    cluster.kubectl("apply", "-n", namespace, "-f", "-", stdin=_md("split", disaggregation=roles))
    pool = wait(
        lambda: cluster.get("inferencepool", "split", namespace), timeout=30, what="InferencePool split"
    )
    selector = pool["spec"]["selector"]["matchLabels"]
    for role in ("prefill", "decode"):
        dep = wait(lambda r=role: cluster.get("deployment", f"split-{r}", namespace), what=f"split-{role}")
        labels = dep["spec"]["template"]["metadata"]["labels"]
        # Every pod of the role is in the pool, and carries the role a P/D-aware picker filters on.
        assert selector.items() <= labels.items()
        assert labels["serving.tokenfleet.dev/role"] == role
