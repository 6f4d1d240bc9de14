"""e2e fixtures: one control plane per session (RBAC on), CRDs + RBAC from manifests/, the operator running
as a subprocess under the least-privilege identity, and a fresh namespace per test.

The harness modules sit next to this file; pytest runs with --import-mode=importlib, so this directory is
put on sys.path for them (the repository root never is).
"""

from __future__ import annotations

import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from envtest import ControlPlane, wait_for  # noqa: E402
from operator_process import OperatorProcess  # noqa: E402

REPO = HERE.parent
CRD_NAMES = [
    "modeldeployments.serving.tokenfleet.dev",
    "cachepolicies.serving.tokenfleet.dev",
    "routingpolicies.serving.tokenfleet.dev",
]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if Path(str(item.fspath)).resolve().is_relative_to(HERE):
            item.add_marker(pytest.mark.e2e)


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    plane = ControlPlane(tmp_path_factory.mktemp("envtest")).start()
    try:
        # The whole install, as a cluster admin would run it (the operator Deployment is stored, never run:
        # there is no kubelet; the operator runs as a local process below).
        plane.kubectl("apply", "-k", str(REPO / "manifests"))
        for crd in CRD_NAMES:
            plane.kubectl("wait", "--for=condition=Established", f"crd/{crd}", "--timeout=30s")
        yield plane
    finally:
        plane.stop()


@pytest.fixture(scope="session")
def operator(cluster: ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> Iterator[OperatorProcess]:
    proc = OperatorProcess(
        cluster.kubeconfig("operator"), tmp_path_factory.mktemp("operator") / "operator.log"
    )
    proc.start()
    try:
        yield proc
    finally:
        proc.stop()
        # Least privilege is enough: not one request of the whole session was refused.
        log = proc.log()
        if "403" in log and "Forbidden" in log:
            print(log[-5000:], file=sys.stderr)
            pytest.fail("the operator hit a 403 Forbidden: manifests/rbac.yaml lacks a rule")


@pytest.fixture
def namespace(cluster: ControlPlane, operator: OperatorProcess) -> Iterator[str]:
    name = f"e2e-{uuid.uuid4().hex[:8]}"
    cluster.kubectl("create", "namespace", name)
    yield name
    if not operator.alive():
        print(operator.log()[-5000:], file=sys.stderr)


@pytest.fixture
def wait():
    return wait_for
