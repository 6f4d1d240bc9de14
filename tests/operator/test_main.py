"""`tokenfleet operator`: arguments, the credentials handed to kopf, and the handler registry."""

from __future__ import annotations

import subprocess
import sys

import kopf
import pytest
from kubernetes import client
from tokenfleet.operator.handlers import register
from tokenfleet.operator.main import connection_info, own_namespace, parse_args


def test_defaults_and_validation():
    args = parse_args([])
    assert (args.namespace, args.resync_seconds, args.kubeconfig) == ([], 60.0, None)
    assert parse_args(["-n", "a", "-n", "b*"]).namespace == ["a", "b*"]
    with pytest.raises(SystemExit):
        parse_args(["--resync-seconds", "0"])


def test_the_operator_namespace_is_the_flag_or_the_pods_own(tmp_path):
    assert parse_args(["--operator-namespace", "ops"]).operator_namespace == "ops"
    assert parse_args([]).operator_namespace is None  # then: where the operator's pod runs
    (tmp_path / "namespace").write_text("platform\n")
    assert own_namespace(tmp_path) == "platform"
    assert own_namespace(tmp_path / "not-in-a-pod") == "tokenfleet-system"  # the manifests' namespace


def test_kopf_gets_the_same_credentials_as_the_client():
    cfg = client.Configuration()
    cfg.host = "https://10.0.0.1:6443"
    cfg.api_key = {"authorization": "Bearer s3cret"}
    cfg.ssl_ca_cert = "/var/run/ca.crt"
    info = connection_info(cfg)
    assert (info.server, info.scheme, info.token, info.ca_path, info.insecure) == (
        "https://10.0.0.1:6443", "Bearer", "s3cret", "/var/run/ca.crt", False
    )  # fmt: skip


def test_registry_has_stable_handler_ids_and_no_finalizer_handlers():
    registry = kopf.OperatorRegistry()
    register(registry, resync_seconds=5)
    ids = {h.id for h in registry._changing.get_all_handlers()}
    assert {"model-deployment", "cache-policy", "routing-policy"} <= ids
    # Deletion handlers are optional: no finalizers block `kubectl delete` when the operator is down.
    assert all(h.requires_finalizer is not True for h in registry._changing.get_all_handlers())
    assert {h.id for h in registry._spawning.get_all_handlers()} == {
        "model-deployment-resync",
        "routing-policy-resync",
        "autoscaler",
        "autoscaler-demand",
        "model-deployment-loading",
        "model-deployment-adapters",
    }


def test_operator_never_imports_torch():
    # A fresh interpreter: other tests in this process may have imported torch already.
    code = "import sys, tokenfleet.operator.main; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0
