"""e2e fixtures: one real cluster per session — etcd, kube-apiserver (RBAC on), controller-manager,
scheduler and the process kubelet with two CPU nodes, pods in their own network namespaces on a bridge
made for the session — CRDs + RBAC from manifests/, the operator running as a subprocess under the
least-privilege identity, and a fresh namespace per test (deleted after it, so its pods stop).

Everything the session made (processes, namespaces, links, mount points, files) is removed at its end,
also after a failure; the components' logs stay in pytest's temp dir and are printed when a test fails.

The harness modules sit next to this file; pytest runs with --import-mode=importlib, so this directory is
put on sys.path for them (the repository root never is).
"""

from __future__ import annotations

import os
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import host_paths  # noqa: E402
from envtest import ControlPlane, wait_for  # noqa: E402
from image_payload import cached_payload  # noqa: E402
from kubelet import KubeletProcess, NodeSpec  # noqa: E402
from operator_process import OperatorProcess  # noqa: E402
from pod_network import PodNetwork  # noqa: E402

REPO = HERE.parent
# Two CPU-only nodes. Their allocatable is what they announce to the scheduler (pods really share this
# machine's cores); enough for a few runtime pods plus a rollout's surge pod and two routers.
NODES = [NodeSpec("node-a", cpu="8", memory="32Gi"), NodeSpec("node-b", cpu="8", memory="32Gi")]
CRD_NAMES = [
    "modeldeployments.serving.tokenfleet.dev",
    "cachepolicies.serving.tokenfleet.dev",
    "routingpolicies.serving.tokenfleet.dev",
]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if Path(str(item.fspath)).resolve().is_relative_to(HERE):
            item.add_marker(pytest.mark.e2e)


def _node_ready(node: dict | None) -> bool:
    conditions = ((node or {}).get("status") or {}).get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


@pytest.fixture(scope="session")
def pod_network() -> Iterator[PodNetwork]:
    network = PodNetwork.create()  # raises NetworkSetupError with the reason: never a weaker mode
    try:
        yield network
    finally:
        network.destroy()
        host_paths.release(os.getpid())


@pytest.fixture(scope="session")
def image() -> Path:
    """What the image would ship: the wheel built from the Dockerfile's build stage, in a venv of its own
    (cached by the staged tree's content, so a session builds it at most once). Pods and the operator run it."""
    return cached_payload()


@pytest.fixture(scope="session")
def cluster(request: pytest.FixtureRequest, pod_network: PodNetwork, image: Path) -> Iterator[ControlPlane]:
    # Not under pytest's basetemp: concurrent sessions rotate those away, and the logs must outlive a failure.
    plane = ControlPlane(
        Path(tempfile.mkdtemp(prefix=f"tokenfleet-e2e-{pod_network.tag}-")), host=pod_network.host_ip
    )
    kubelet = KubeletProcess(plane.kubeconfig("admin"), pod_network, NODES, plane.dir / "kubelet", image)
    try:
        plane.start()
        kubelet.start()
        plane.kubelet = kubelet
        # The whole install, as a cluster admin would run it, except that the operator Deployment is
        # stored with zero replicas: the operator runs as a local process so tests can kill and restart it.
        docs = list(yaml.safe_load_all(plane.kubectl("kustomize", str(REPO / "manifests"))))
        for doc in docs:
            if doc and doc["kind"] == "Deployment":
                doc["spec"]["replicas"] = 0
        plane.kubectl("apply", "-f", "-", stdin=yaml.safe_dump_all(docs))
        for crd in CRD_NAMES:
            plane.kubectl("wait", "--for=condition=Established", f"crd/{crd}", "--timeout=30s")
        for node in NODES:
            wait_for(
                lambda n=node.name: kubelet.alive() and _node_ready(plane.get("node", n, "")),
                timeout=60,
                what=f"node {node.name} registered and Ready (kubelet log: {kubelet.log_path})",
            )
        yield plane
    finally:
        try:
            if request.session.testsfailed or not kubelet.alive():
                print(plane.logs(), file=sys.stderr)
                print(f"==== {kubelet.log_path}\n" + kubelet.log()[-6000:], file=sys.stderr)
        finally:
            try:
                kubelet.stop()
            finally:
                plane.stop()


@pytest.fixture(scope="session")
def kubelet(cluster: ControlPlane) -> KubeletProcess:
    return cluster.kubelet


@pytest.fixture(scope="session")
def operator(cluster: ControlPlane, image: Path) -> Iterator[OperatorProcess]:
    proc = OperatorProcess(cluster.kubeconfig("operator"), cluster.dir / "operator.log", image)
    proc.start()
    try:
        yield proc
    finally:
        proc.stop()
        # Least privilege is enough: not one request of the whole session was refused.
        # (A namespace being deleted refuses new Events with a 403 too: that is not a missing rule.)
        refused = [
            line for line in proc.log().splitlines()
            if "Forbidden" in line and "is being terminated" not in line
        ]  # fmt: skip
        if refused:
            log = "\n".join(refused)
            print(log[-5000:], file=sys.stderr)
            pytest.fail("the operator hit a 403 Forbidden: manifests/rbac.yaml lacks a rule")


@pytest.fixture
def namespace(cluster: ControlPlane, operator: OperatorProcess) -> Iterator[str]:
    name = f"e2e-{uuid.uuid4().hex[:8]}"
    cluster.kubectl("create", "namespace", name)
    yield name
    if not operator.alive():
        print(operator.log()[-5000:], file=sys.stderr)
    # Its pods stop (gracefully) while the next test runs; the session's teardown sweeps what is left.
    cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


@pytest.fixture
def wait():
    return wait_for
