"""The session's cluster as one context manager, for the pytest fixture and the long benches alike: the
control plane, one process kubelet per node (so one node can be stopped alone), and the whole install as
a cluster admin would run it — except that the operator Deployment is stored with zero replicas, since
the operator runs as a local process that a test can kill and restart.

On the way out the components stop in order; when `report` says so (a failed test), their logs' tails
are printed first.
"""

from __future__ import annotations

import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml
from envtest import ControlPlane, wait_for
from kubelet import KubeletProcess, NodeSpec
from pod_network import PodNetwork

REPO = Path(__file__).resolve().parent.parent
# Two CPU-only nodes. Their allocatable is what they announce to the scheduler (pods really share this
# machine's cores); enough for a few runtime pods plus a rollout's surge pod and two routers.
NODES = [NodeSpec("node-a", cpu="8", memory="32Gi"), NodeSpec("node-b", cpu="8", memory="32Gi")]
CRD_NAMES = [
    "modeldeployments.serving.tokenfleet.dev",
    "cachepolicies.serving.tokenfleet.dev",
    "routingpolicies.serving.tokenfleet.dev",
]
# The bridge's pod slots (2..254), split between the nodes' kubelets.
SLOTS_PER_NODE = 253 // len(NODES)


def node_ready(node: dict | None) -> bool:
    conditions = ((node or {}).get("status") or {}).get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def install(plane: ControlPlane) -> None:
    """manifests/ (CRDs, RBAC, the operator's Deployment at zero replicas), then the CRDs established."""
    docs = list(yaml.safe_load_all(plane.kubectl("kustomize", str(REPO / "manifests"))))
    for doc in docs:
        if doc and doc["kind"] == "Deployment":
            doc["spec"]["replicas"] = 0
    plane.kubectl("apply", "-f", "-", stdin=yaml.safe_dump_all(docs))
    for crd in CRD_NAMES:
        plane.kubectl("wait", "--for=condition=Established", f"crd/{crd}", "--timeout=30s")


def wait_node_ready(plane: ControlPlane, kubelet: KubeletProcess, node: str, timeout: float = 60) -> None:
    wait_for(
        lambda: kubelet.alive() and node_ready(plane.get("node", node, "")),
        timeout=timeout,
        what=f"node {node} registered and Ready (kubelet log: {kubelet.log_path})",
    )


@contextmanager
def running_cluster(
    network: PodNetwork, image: Path, report: Callable[[], bool] = lambda: False
) -> Iterator[ControlPlane]:
    """A started, installed cluster; `plane.kubelets` maps each node's name to its kubelet process."""
    # Not under pytest's basetemp: concurrent sessions rotate those away, and the logs must outlive a failure.
    plane = ControlPlane(
        Path(tempfile.mkdtemp(prefix=f"tokenfleet-e2e-{network.tag}-")), host=network.host_ip
    )
    kubelets: dict[str, Any] = {
        node.name: KubeletProcess(
            plane.kubeconfig("admin"),
            network,
            [node],
            plane.dir / f"kubelet-{node.name}",
            image,
            range(2 + i * SLOTS_PER_NODE, 2 + (i + 1) * SLOTS_PER_NODE),
        )
        for i, node in enumerate(NODES)
    }
    plane.kubelets = kubelets
    try:
        plane.start()
        for kubelet in kubelets.values():
            kubelet.start()
        install(plane)
        for name, kubelet in kubelets.items():
            wait_node_ready(plane, kubelet, name)
        yield plane
    finally:
        try:
            if report() or not all(k.alive() for k in kubelets.values()):
                print(plane.logs(), file=sys.stderr)
                for kubelet in kubelets.values():
                    print(f"==== {kubelet.log_path}\n" + kubelet.log()[-6000:], file=sys.stderr)
        finally:
            try:
                for kubelet in kubelets.values():
                    kubelet.stop()
            finally:
                plane.stop()
