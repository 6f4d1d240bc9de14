"""A disaggregated ModelDeployment: two Deployments (and Services, ConfigMaps) with role labels."""

from __future__ import annotations

import kopf
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
        ("PodDisruptionBudget", "chat-decode"),
        ("PodDisruptionBudget", "chat-prefill"),
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
        # Its pods spread over nodes among themselves, and over the whole model: prefill and decode pods
        # on different nodes where they can be, so one lost node does not take the whole model.
        pod = dep["spec"]["template"]["spec"]
        (spread,) = pod["topologySpreadConstraints"]
        assert spread["labelSelector"]["matchLabels"].items() <= labels.items()
        assert spread["labelSelector"]["matchLabels"]["app.kubernetes.io/instance"] == f"chat-{role}"
        (apart,) = pod["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
        assert apart["podAffinityTerm"]["labelSelector"]["matchLabels"] == {
            f"{GROUP}/model-deployment": "chat"
        }
        # So does the role's disruption budget: a drain takes at most one pod of each role at a time.
        budget = _by(children, "PodDisruptionBudget", f"chat-{role}")["spec"]
        assert budget["maxUnavailable"] == 1
        assert budget["selector"]["matchLabels"] == dep["spec"]["selector"]["matchLabels"]
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


def test_the_pods_carry_the_role_label_the_router_reads():
    from tokenfleet.runtime.router.config import ROLE_LABEL as ROUTER_ROLE_LABEL

    assert ROLE_LABEL == ROUTER_ROLE_LABEL
    children = build_disaggregated_children("chat", parse_model_deployment(SPEC), None)
    svc = _by(children, "Service", "chat-decode")
    assert svc["metadata"]["labels"][ROLE_LABEL] == "decode"  # mirrored onto its EndpointSlices


def test_the_router_gets_one_backend_per_role_with_its_role():
    spec = parse_model_deployment(SPEC)
    backends = router_backends("chat", "ml", spec, None, builtin_model=True)
    assert [(b.name, b.role) for b in backends] == [("chat-prefill", "prefill"), ("chat-decode", "decode")]
    assert backends[0].url.startswith("http://chat-prefill.ml.svc")
    assert backends[0].model == backends[1].model


def test_deployment_wide_autoscaling_on_a_disaggregated_deployment_points_to_the_roles():
    with pytest.raises(ConfigError, match=r"disaggregation\.prefill\.autoscaling and/or"):
        parse_model_deployment({**SPEC, "autoscaling": {"maxReplicas": 4, "targets": {"kvCacheUsage": 0.8}}})
    with pytest.raises(ConfigError):
        parse_model_deployment({"disaggregation": {"prefill": {"replicas": -1}}})


def _role_autoscaling(**overrides) -> dict:
    return {"maxReplicas": 4, "targets": {"waitingRequestsPerReplica": 2}} | overrides


def test_each_role_takes_its_own_autoscaling():
    spec = parse_model_deployment(
        {
            "disaggregation": {
                "prefill": {"autoscaling": _role_autoscaling()},
                "decode": {"autoscaling": _role_autoscaling(targets={"kvCacheUsage": 0.7}, maxReplicas=8)},
            }
        }
    )
    assert spec.disaggregation.prefill.autoscaling.targets.waiting_requests_per_replica == 2
    assert spec.disaggregation.decode.autoscaling.max_replicas == 8


@pytest.mark.parametrize(
    ("role_autoscaling", "message"),
    [
        (_role_autoscaling(minReplicas=0), "disaggregation.decode.autoscaling.minReplicas must be >= 1"),
        (
            _role_autoscaling(maxReplicas=3000),
            "disaggregation.decode.autoscaling.maxReplicas must be <= 1000",
        ),
        (_role_autoscaling(minReplicas=5), "must be <= maxReplicas"),
        (_role_autoscaling(targets={}), "set at least one of"),
    ],
)
def test_invalid_role_autoscaling_is_refused_naming_the_role(role_autoscaling, message):
    with pytest.raises(ConfigError, match=message):
        parse_model_deployment({"disaggregation": {"decode": {"autoscaling": role_autoscaling}}})


def test_the_crd_checks_role_autoscaling_with_the_same_rules():
    from tokenfleet.operator.crdgen import build_crd

    schema = build_crd("ModelDeployment")["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    spec = schema["properties"]["spec"]
    for role in ("prefill", "decode"):
        a = spec["properties"]["disaggregation"]["properties"][role]["properties"]["autoscaling"]
        rules = [r["rule"] for r in a["x-kubernetes-validations"]]
        assert "!has(self.minReplicas) || self.minReplicas >= 1" in rules
        assert "!has(self.minReplicas) || self.minReplicas <= self.maxReplicas" in rules
        assert any(
            "has(self.ttft)" in r["rule"] for r in a["properties"]["targets"]["x-kubernetes-validations"]
        )
    assert "!has(self.autoscaling) || !has(self.disaggregation)" in [
        r["rule"] for r in spec["x-kubernetes-validations"]
    ]
    roles = schema["properties"]["status"]["properties"]["roles"]["properties"]
    assert set(roles) == {"prefill", "decode"} and "autoscaling" in roles["decode"]["properties"]


def _reconcile_cluster():
    """The in-memory cluster (`Kube` over a dict) of the reconcile tests."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "reconcile_cluster", Path(__file__).with_name("test_reconcile.py")
    )
    cluster = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cluster)
    return cluster


def test_reconcile_creates_both_roles_reports_on_decode_and_the_router_gets_both_backends():
    cluster = _reconcile_cluster()
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
    # Each role's pods are counted in status.roles (the phase follows the decode role).
    assert status["roles"] == {
        "prefill": {"replicas": 0, "readyReplicas": 0},
        "decode": {"replicas": 0, "readyReplicas": 0},
    }
    reconcile_model_deployment(ctx, kube.watched(), NS, "chat", LOG)  # settles the first status
    kube.objects[("Deployment", NS, "chat-prefill")]["status"] = {"replicas": 2, "readyReplicas": 1}
    calls = len(kube.calls)
    reconcile_model_deployment(ctx, kube.watched(), NS, "chat", LOG)
    assert kube.obj("ModelDeployment", "chat")["status"]["roles"]["prefill"] == {
        "replicas": 2,
        "readyReplicas": 1,
    }
    reconcile_model_deployment(ctx, kube.watched(), NS, "chat", LOG)  # nothing changed: nothing written
    assert [c for c in kube.calls[calls:] if c[0] == "patch_status"] == [
        ("patch_status", "ModelDeployment", "chat")
    ]
    reconcile_routers(ctx, kube.watched(), NS, LOG)
    config = yaml.safe_load(kube.obj("ConfigMap", "front-router")["data"]["router.yaml"])
    assert sorted((b["name"], b["role"]) for b in config["backends"]) == [
        ("chat-decode", "decode"),
        ("chat-prefill", "prefill"),
    ]


AGGREGATED = [
    ("ConfigMap", "chat-runtime"),
    ("Deployment", "chat"),
    ("PodDisruptionBudget", "chat"),
    ("Service", "chat"),
]
DISAGGREGATED = [
    ("ConfigMap", "chat-decode-runtime"),
    ("ConfigMap", "chat-prefill-runtime"),
    ("Deployment", "chat-decode"),
    ("Deployment", "chat-prefill"),
    ("PodDisruptionBudget", "chat-decode"),
    ("PodDisruptionBudget", "chat-prefill"),
    ("Service", "chat-decode"),
    ("Service", "chat-prefill"),
]


def _children(kube) -> list[tuple[str, str]]:
    """The ModelDeployment's runtime children (not the router's)."""
    kinds = ("ConfigMap", "Deployment", "PodDisruptionBudget", "Service")
    return sorted((k, n) for k in kinds for n in kube.names(k) if not n.startswith("front-"))


def test_switching_modes_removes_the_other_modes_children_once_the_new_ones_serve():
    cluster = _reconcile_cluster()
    LOG, NS, Clock, FakeKube, _ctx = cluster.LOG, cluster.NS, cluster.Clock, cluster.FakeKube, cluster._ctx
    from tokenfleet.operator.reconcile import reconcile_model_deployment, reconcile_routers

    kube, events = FakeKube(), []
    ctx = _ctx(kube, events, Clock())
    notes = ("ConfigMap", "chat-notes")
    kube.create("RoutingPolicy", "front", {})
    kube.create("ModelDeployment", "chat", {"routingPolicyRef": "front"})
    # A ConfigMap someone else made with our label (not owned by the ModelDeployment): never touched.
    kube.objects[("ConfigMap", NS, "chat-notes")] = {
        "kind": "ConfigMap",
        "metadata": {"name": "chat-notes", "namespace": NS, "labels": {f"{GROUP}/model-deployment": "chat"}},
    }
    reconcile_model_deployment(ctx, kube.watched(), NS, "chat", LOG)
    assert _children(kube) == sorted([*AGGREGATED, notes])
    cluster._ready(kube, "chat", 1)

    # aggregated -> disaggregated: the roles' children come, and the single Deployment keeps serving until
    # both roles' Deployments have an available replica; one role is not enough.
    kube.edit("ModelDeployment", "chat", {**SPEC, "routingPolicyRef": "front"})
    with pytest.raises(kopf.TemporaryError, match="chat-decode, chat-prefill"):
        reconcile_model_deployment(ctx, kube.watched(), NS, "chat", LOG)
    assert _children(kube) == sorted([*AGGREGATED, *DISAGGREGATED, notes])
    assert kube.obj("ModelDeployment", "chat")["status"]["endpoint"].startswith("http://chat-decode.")
    cluster._ready(kube, "chat-decode", 3)
    with pytest.raises(kopf.TemporaryError, match="Deployment chat-prefill to have an available replica"):
        reconcile_model_deployment(ctx, kube.watched(), NS, "chat", LOG)
    assert _children(kube) == sorted([*AGGREGATED, *DISAGGREGATED, notes])
    cluster._ready(kube, "chat-prefill", 2)
    calls = len(kube.calls)
    reconcile_model_deployment(ctx, kube.watched(), NS, "chat", LOG)
    assert _children(kube) == sorted([*DISAGGREGATED, notes])
    # The Deployment goes last: while one is left, the next reconcile knows there is more to remove.
    assert [c for c in kube.calls[calls:] if c[0] == "delete"] == [
        ("delete", "ConfigMap", "chat-runtime"),
        ("delete", "PodDisruptionBudget", "chat"),
        ("delete", "Service", "chat"),
        ("delete", "Deployment", "chat"),
    ]
    reconcile_routers(ctx, kube.watched(), NS, LOG)
    config = yaml.safe_load(kube.obj("ConfigMap", "front-router")["data"]["router.yaml"])
    assert sorted(b["name"] for b in config["backends"]) == ["chat-decode", "chat-prefill"]
    assert set(kube.obj("ModelDeployment", "chat")["status"]["roles"]) == {"prefill", "decode"}

    # disaggregated -> aggregated: the roles keep serving (and counting in status.roles) until `chat` can.
    kube.edit("ModelDeployment", "chat", {"routingPolicyRef": "front"})
    with pytest.raises(kopf.TemporaryError, match="Deployment chat to have an available replica"):
        reconcile_model_deployment(ctx, kube.watched(), NS, "chat", LOG)
    assert _children(kube) == sorted([*AGGREGATED, *DISAGGREGATED, notes])
    assert kube.obj("ModelDeployment", "chat")["status"]["roles"]["decode"]["readyReplicas"] == 3
    cluster._ready(kube, "chat", 1)
    reconcile_model_deployment(ctx, kube.watched(), NS, "chat", LOG)
    assert _children(kube) == sorted([*AGGREGATED, notes])
    assert "roles" not in kube.obj("ModelDeployment", "chat")["status"]

    # Level-based and cheap: done, a reconcile removes nothing and lists none of the children.
    calls = len(kube.calls)
    reconcile_model_deployment(ctx, kube.watched(), NS, "chat", LOG)
    assert [c for c in kube.calls[calls:] if c[0] in ("delete", "list") and c[1] != "Pod"] == []
    reconcile_routers(ctx, kube.watched(), NS, LOG)
    config = yaml.safe_load(kube.obj("ConfigMap", "front-router")["data"]["router.yaml"])
    assert [b["name"] for b in config["backends"]] == ["chat"]


def test_a_switch_made_while_the_operator_was_down_is_cleaned_up_by_the_next_one():
    cluster = _reconcile_cluster()
    LOG, NS, Clock, FakeKube, _ctx = cluster.LOG, cluster.NS, cluster.Clock, cluster.FakeKube, cluster._ctx
    from tokenfleet.operator.reconcile import reconcile_model_deployment

    kube = FakeKube()
    kube.create("ModelDeployment", "chat", SPEC)
    reconcile_model_deployment(_ctx(kube, [], Clock()), kube.watched(), NS, "chat", LOG)
    assert _children(kube) == DISAGGREGATED
    # The spec changes while no operator runs; a new operator (new context, nothing remembered) starts,
    # and another one after it once the new Deployment serves: what is stored is all either needs.
    kube.edit("ModelDeployment", "chat", {})
    with pytest.raises(kopf.TemporaryError):
        reconcile_model_deployment(_ctx(kube, [], Clock()), kube.watched(), NS, "chat", LOG)
    cluster._ready(kube, "chat", 1)
    reconcile_model_deployment(_ctx(kube, [], Clock()), kube.watched(), NS, "chat", LOG)
    assert _children(kube) == AGGREGATED


def test_back_to_aggregated_the_roles_status_goes_with_the_roles():
    cluster = _reconcile_cluster()
    LOG, NS, Clock, FakeKube, _ctx = cluster.LOG, cluster.NS, cluster.Clock, cluster.FakeKube, cluster._ctx
    from tokenfleet.operator.reconcile import reconcile_model_deployment

    kube = FakeKube()
    ctx = _ctx(kube, [], Clock())
    kube.create("ModelDeployment", "chat", SPEC)
    reconcile_model_deployment(ctx, kube.watched(), NS, "chat", LOG)
    kube.patch_status("ModelDeployment", NS, "chat", {"roles": {"decode": {"autoscaling": {"reason": "x"}}}})
    assert set(kube.obj("ModelDeployment", "chat")["status"]["roles"]) == {"prefill", "decode"}
    # Scaled to zero, the aggregated Deployment has nothing to wait for: the roles go at once, and so do
    # their counts and decisions, which would otherwise describe pods that are gone.
    kube.edit("ModelDeployment", "chat", {"replicas": 0})
    reconcile_model_deployment(ctx, kube.watched(), NS, "chat", LOG)
    assert _children(kube) == AGGREGATED
    assert "roles" not in kube.obj("ModelDeployment", "chat")["status"]


def test_a_reconcile_without_a_switch_lists_no_children():
    cluster = _reconcile_cluster()
    LOG, NS, Clock, FakeKube, _ctx = cluster.LOG, cluster.NS, cluster.Clock, cluster.FakeKube, cluster._ctx
    from tokenfleet.operator.reconcile import reconcile_model_deployment

    kube = FakeKube()
    ctx = _ctx(kube, [], Clock())
    kube.create("ModelDeployment", "plain", {"replicas": 1})
    kube.create("ModelDeployment", "split", SPEC)
    # A Deployment named like the disaggregated one but not its own (someone else's): not a leftover.
    kube.objects[("Deployment", NS, "split")] = {"kind": "Deployment", "metadata": {"name": "split"}}
    for _ in range(3):
        for name in ("plain", "split"):
            reconcile_model_deployment(ctx, kube.watched(), NS, name, LOG)
    assert [c for c in kube.calls if c[0] in ("list", "delete") and c[1] != "Pod"] == []
    assert "split" in kube.names("Deployment")


def test_a_deployment_serves_with_an_available_replica_or_when_none_is_wanted():
    from tokenfleet.operator.reconcile import serving

    def dep(wanted, available):
        return {"spec": {"replicas": wanted}, "status": {"availableReplicas": available}}

    assert serving(dep(3, 1)) and serving(dep(0, 0)) and serving({"spec": {"replicas": 0}})
    assert not serving(dep(2, 0)) and not serving({"spec": {}}) and not serving({"spec": {"replicas": 1}})


def test_only_controlled_children_are_stale():
    from tokenfleet.operator.reconcile import stale_children

    owner = {"metadata": {"name": "chat", "uid": "u1"}}

    def obj(kind, name, uid, controller=True):
        refs = [{"uid": uid, "controller": controller}] if uid else []
        return {"kind": kind, "metadata": {"name": name, "ownerReferences": refs}}

    wanted = [obj("Deployment", "chat-decode", "u1")]
    existing = [
        obj("Deployment", "chat-decode", "u1"),  # still built
        obj("Deployment", "chat", "u1"),  # the old mode's
        obj("Service", "chat", "u2"),  # another owner's
        obj("ConfigMap", "chat-runtime", "u1", controller=False),  # merely referenced, not controlled
        obj("ConfigMap", "loose", None),
    ]
    assert stale_children(owner, wanted, existing) == [("Deployment", "chat")]
