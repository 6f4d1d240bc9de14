"""A disaggregated ModelDeployment: two Deployments (and Services, ConfigMaps) with role labels."""

from __future__ import annotations

import pytest
import yaml
from tokenfleet.operator.api import GROUP, parse_model_deployment
from tokenfleet.operator.disaggregation import ROLE_LABEL, build_disaggregated_children, router_backends
from tokenfleet.runtime.config import RuntimeConfig
from tokenfleet.runtime.errors import ConfigError

SPEC = {
    "resources": {"cpu": "2", "memory": "4Gi"},
    "engine": {"maxNumSeqs": 64},
    "disaggregation": {
        "prefill": {"replicas": 2, "resources": {"cpu": "8", "memory": "8Gi"}},
        "decode": {"replicas": 3, "engine": {"maxNumSeqs": 256}},
    },
}


def _by(children, kind: str, name: str) -> dict:
    return next(c for c in children if c["kind"] == kind and c["metadata"]["name"] == name)


def test_each_role_gets_its_deployment_service_and_config_with_its_overrides():
    spec = parse_model_deployment(SPEC)
    children = build_disaggregated_children("chat", spec, None)
    assert sorted((c["kind"], c["metadata"]["name"]) for c in children) == [
        ("ConfigMap", "chat-decode-runtime"),
        ("ConfigMap", "chat-prefill-runtime"),
        ("Deployment", "chat-decode"),
        ("Deployment", "chat-prefill"),
        ("Service", "chat-decode"),
        ("Service", "chat-prefill"),
    ]
    pre, dec = _by(children, "Deployment", "chat-prefill"), _by(children, "Deployment", "chat-decode")
    assert pre["spec"]["replicas"] == 2 and dec["spec"]["replicas"] == 3
    pre_res = pre["spec"]["template"]["spec"]["containers"][0]["resources"]
    dec_res = dec["spec"]["template"]["spec"]["containers"][0]["resources"]
    assert pre_res["requests"] == {"cpu": "8", "memory": "8Gi"}  # the role's own resources
    assert dec_res["requests"] == {"cpu": "2", "memory": "4Gi"}  # the deployment's
    for dep, role in ((pre, "prefill"), (dec, "decode")):
        assert dep["spec"]["selector"]["matchLabels"][ROLE_LABEL] == role
        labels = dep["spec"]["template"]["metadata"]["labels"]
        assert labels[ROLE_LABEL] == role and labels[f"{GROUP}/model-deployment"] == "chat"
        # The pods mount their own role's config.
        volumes = dep["spec"]["template"]["spec"]["volumes"]
        assert {"name": "config", "configMap": {"name": f"chat-{role}-runtime"}} in volumes
        svc = _by(children, "Service", f"chat-{role}")
        assert svc["spec"]["selector"][ROLE_LABEL] == role
        # A Service selects exactly its role's pods: its selector is a subset of those pods' labels only.
        assert svc["spec"]["selector"].items() <= labels.items()
    other = _by(children, "Deployment", "chat-prefill")["spec"]["template"]["metadata"]["labels"]
    assert not _by(children, "Service", "chat-decode")["spec"]["selector"].items() <= other.items()
    decode_cfg = RuntimeConfig.model_validate(
        yaml.safe_load(_by(children, "ConfigMap", "chat-decode-runtime")["data"]["runtime.yaml"])
    )
    prefill_cfg = RuntimeConfig.model_validate(
        yaml.safe_load(_by(children, "ConfigMap", "chat-prefill-runtime")["data"]["runtime.yaml"])
    )
    assert decode_cfg.scheduler.max_num_seqs == 256 and prefill_cfg.scheduler.max_num_seqs == 64
    # Blocks move by hash between the roles: same model, same block size.
    assert decode_cfg.model == prefill_cfg.model and decode_cfg.cache == prefill_cfg.cache


def test_the_router_gets_one_backend_per_role_with_its_role():
    spec = parse_model_deployment(SPEC)
    backends = router_backends("chat", "ml", spec, None, builtin_model=True)
    assert [(b.name, b.role) for b in backends] == [("chat-prefill", "prefill"), ("chat-decode", "decode")]
    assert backends[0].url.startswith("http://chat-prefill.ml.svc")
    assert backends[0].model == backends[1].model


def test_autoscaling_a_disaggregated_deployment_is_refused_with_a_reason():
    with pytest.raises(ConfigError, match="disaggregated"):
        parse_model_deployment({**SPEC, "autoscaling": {"maxReplicas": 4, "targets": {"kvCacheUsage": 0.8}}})
    with pytest.raises(ConfigError):
        parse_model_deployment({"disaggregation": {"prefill": {"replicas": -1}}})


def test_reconcile_creates_both_roles_reports_on_decode_and_the_router_gets_both_backends():
    import importlib.util
    from pathlib import Path

    # The in-memory cluster (`Kube` over a dict) of the reconcile tests.
    spec = importlib.util.spec_from_file_location(
        "reconcile_cluster", Path(__file__).with_name("test_reconcile.py")
    )
    cluster = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cluster)
    LOG, NS, Clock, FakeKube, _ctx = cluster.LOG, cluster.NS, cluster.Clock, cluster.FakeKube, cluster._ctx
    from tokenfleet.operator.reconcile import reconcile_model_deployment, reconcile_routers

    kube, events = FakeKube(), []
    ctx = _ctx(kube, events, Clock())
    kube.create("RoutingPolicy", "front", {"strategy": "least-load"})
    kube.create("ModelDeployment", "chat", {**SPEC, "routingPolicyRef": "front"})
    reconcile_model_deployment(ctx, kube.watched(), NS, "chat", LOG)
    assert kube.names("Deployment") == ["chat-decode", "chat-prefill"]
    assert kube.names("Service") == ["chat-decode", "chat-prefill"]
    status = kube.obj("ModelDeployment", "chat")["status"]
    assert status["phase"] == "Progressing"
    reconcile_routers(ctx, kube.watched(), NS, LOG)
    config = yaml.safe_load(kube.obj("ConfigMap", "front-router")["data"]["router.yaml"])
    assert sorted((b["name"], b["role"]) for b in config["backends"]) == [
        ("chat-decode", "decode"),
        ("chat-prefill", "prefill"),
    ]
