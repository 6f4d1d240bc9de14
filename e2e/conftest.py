"""e2e fixtures: one real cluster per session — etcd, kube-apiserver (RBAC on), controller-manager,
scheduler and one process kubelet per CPU node (two nodes), pods in their own network namespaces on a bridge
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
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import host_paths  # noqa: E402
from cluster import running_cluster  # noqa: E402
from envtest import ControlPlane, wait_for  # noqa: E402
from failure_report import namespace_report  # noqa: E402
from image_payload import cached_payload  # noqa: E402
from kubelet import KubeletProcess  # noqa: E402
from operator_process import OperatorProcess, refused_requests  # noqa: E402
from pod_network import PodNetwork  # noqa: E402


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if Path(str(item.fspath)).resolve().is_relative_to(HERE):
            item.add_marker(pytest.mark.e2e)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> pytest.TestReport:
    """A failed test body's report gets its namespace's state as it was then (failure_report.py)."""
    report = yield
    args = getattr(item, "funcargs", {})
    if report.when == "call" and report.failed and "namespace" in args and "cluster" in args:
        try:
            state = namespace_report(args["cluster"], args["namespace"], args.get("operator"))
        except Exception as e:  # never hide the failure itself
            state = f"not read: {type(e).__name__}: {e}"
        report.sections.append(("namespace at the failure", state))
    return report


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
    with running_cluster(pod_network, image, report=lambda: bool(request.session.testsfailed)) as plane:
        yield plane


@pytest.fixture(scope="session")
def kubelets(cluster: ControlPlane) -> dict[str, KubeletProcess]:
    """Each node's kubelet process, by node name."""
    return cluster.kubelets


@pytest.fixture(scope="session")
def operator(cluster: ControlPlane, image: Path) -> Iterator[OperatorProcess]:
    proc = OperatorProcess(
        cluster.kubeconfig("operator"),
        cluster.dir / "operator.log",
        image,
        node_cache_dir=cluster.dir / "node-cache",
    )
    proc.start()
    try:
        yield proc
    finally:
        proc.stop()
        # Least privilege is enough: not one request of the whole session was refused.
        refused = refused_requests(proc.session_log(), cluster.apiserver_restarts)
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
