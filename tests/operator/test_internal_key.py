"""The internal key: one Secret per ModelDeployment, created once, mounted into its pods (both roles) and
into the routers that route to it, with the runtime's and the router's config pointing at the files."""

from __future__ import annotations

import base64
import copy
import importlib.util
from pathlib import Path
from typing import Any

import yaml
from tokenfleet.operator.api import parse_model_deployment, parse_routing_policy
from tokenfleet.operator.builders import build_deployment, build_runtime_config
from tokenfleet.operator.disaggregation import build_disaggregated_children, router_backends
from tokenfleet.operator.internal_key import (
    INTERNAL_KEY_DIR,
    internal_key_secret_name,
    router_key_volume,
)
from tokenfleet.operator.router_builders import build_backend, build_router_config, build_router_deployment
from tokenfleet.runtime.config import RuntimeConfig
from tokenfleet.runtime.router.config import RouterConfig

DISAGGREGATED = {"disaggregation": {"prefill": {"replicas": 1}, "decode": {"replicas": 2}}}


def _cluster():
    """The in-memory cluster of test_reconcile.py (one definition of how the API server behaves)."""
    spec = importlib.util.spec_from_file_location(
        "reconcile_cluster", Path(__file__).with_name("test_reconcile.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _pod(deployment: dict[str, Any]) -> dict[str, Any]:
    return deployment["spec"]["template"]["spec"]


def _file_in_pod(pod: dict[str, Any], path: str) -> tuple[str, str]:
    """(Secret name, entry) a pod's container sees at `path`, resolved through its mounts and volumes the
    way the kubelet lays them out; fails when nothing mounted provides that file."""
    (container,) = pod["containers"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    for mount in container["volumeMounts"]:
        prefix = mount["mountPath"].rstrip("/") + "/"
        if not path.startswith(prefix):
            continue
        assert "subPath" not in mount, "a subPath mount never sees the kubelet's updates (no rotation)"
        rest = path.removeprefix(prefix)
        volume = volumes[mount["name"]]
        if "secret" in volume:
            return volume["secret"]["secretName"], rest
        for source in volume["projected"]["sources"]:
            for item in source["secret"]["items"]:
                if item["path"] == rest:
                    return source["secret"]["name"], item["key"]
    raise AssertionError(f"no mount provides {path}")


def test_every_runtime_pod_reads_its_deployments_key_from_the_whole_secret():
    spec = parse_model_deployment({})
    config = build_runtime_config(spec, None)
    assert config.server.internal_api_key_file == f"{INTERNAL_KEY_DIR}/key"
    pod = _pod(build_deployment("chat", spec, config))
    assert _file_in_pod(pod, config.server.internal_api_key_file) == ("chat-internal-key", "key")


def test_both_roles_of_a_disaggregated_deployment_share_one_key():
    spec = parse_model_deployment(DISAGGREGATED)
    children = build_disaggregated_children("chat", spec, None)
    configs = {
        c["metadata"]["name"]: RuntimeConfig.model_validate(yaml.safe_load(c["data"]["runtime.yaml"]))
        for c in children
        if c["kind"] == "ConfigMap"
    }
    deployments = [c for c in children if c["kind"] == "Deployment"]
    assert len(deployments) == 2
    for dep in deployments:
        config = configs[f"{dep['metadata']['name']}-runtime"]
        # The decode pod fetches KV from the prefill pod with this key: it must be the same Secret.
        assert _file_in_pod(_pod(dep), config.server.internal_api_key_file) == ("chat-internal-key", "key")


def test_a_router_mounts_the_key_of_every_deployment_it_routes_to():
    aggregated = parse_model_deployment({})
    split = parse_model_deployment(DISAGGREGATED)
    backends = [
        build_backend("chat", "ns", build_runtime_config(aggregated, None), True),
        *router_backends("code", "ns", split, None, True),
    ]
    config = build_router_config("ns", parse_routing_policy({}), backends)
    pod = _pod(build_router_deployment("front", config, "img:1", ["chat", "code"]))
    # Active-active routers on different nodes where they can be: one lost node takes one router.
    (spread,) = pod["topologySpreadConstraints"]
    assert spread["labelSelector"]["matchLabels"] == {
        "app.kubernetes.io/instance": "front",
        "app.kubernetes.io/component": "router",
    }
    # Routers on a lost node are replaced elsewhere after 30 s, as runtime pods are.
    assert {t["key"]: t["tolerationSeconds"] for t in pod["tolerations"]} == {
        "node.kubernetes.io/not-ready": 30,
        "node.kubernetes.io/unreachable": 30,
    }
    # What the router reads (its own schema) for each backend is a file the pod has, from the right Secret.
    loaded = RouterConfig.model_validate(yaml.safe_load(yaml.safe_dump(config.model_dump(mode="json"))))
    seen = {b.name: _file_in_pod(pod, b.internal_key_file) for b in loaded.backends}
    assert seen == {
        "chat": ("chat-internal-key", "key"),
        "code-prefill": ("code-internal-key", "key"),
        "code-decode": ("code-internal-key", "key"),
    }
    (volume,) = [v for v in pod["volumes"] if "projected" in v]
    # One source per deployment (the two roles share one), each optional: a router must start while a new
    # deployment's Secret is still being created.
    assert [s["secret"]["name"] for s in volume["projected"]["sources"]] == [
        "chat-internal-key",
        "code-internal-key",
    ]
    assert all(s["secret"]["optional"] for s in volume["projected"]["sources"])
    assert router_key_volume([]) == ([], [])


def _key(kube, name: str = "chat") -> str:
    secret = kube.obj("Secret", internal_key_secret_name(name))
    return base64.b64decode(secret["data"]["key"]).decode()


def test_the_key_is_created_once_owned_by_the_deployment_and_never_rotated_by_a_reconcile():
    c = _cluster()
    kube, clock = c.FakeKube(), c.Clock()
    ctx = c._ctx(kube, [], clock)
    kube.create("ModelDeployment", "chat", {"replicas": 1})
    c._reconcile(ctx, kube, "chat")
    first = _key(kube)
    assert len(first) >= 43  # token_urlsafe(32): 32 random bytes
    secret = kube.obj("Secret", "chat-internal-key")
    (owner,) = secret["metadata"]["ownerReferences"]
    assert (owner["kind"], owner["uid"]) == (
        "ModelDeployment",
        kube.obj("ModelDeployment", "chat")["metadata"]["uid"],
    )

    # A resync, a spec change and a restarted operator (a new context) keep the key.
    c._reconcile(ctx, kube, "chat")
    kube.edit("ModelDeployment", "chat", {"replicas": 3})
    c._reconcile(c._ctx(kube, [], clock), kube, "chat")
    assert _key(kube) == first

    # An admin rotates it by replacing the data: the operator leaves the new key alone.
    rotated = copy.deepcopy(secret)
    rotated["data"]["key"] = base64.b64encode(b"rotated-by-admin").decode()
    kube.objects[("Secret", c.NS, "chat-internal-key")] = rotated
    c._reconcile(ctx, kube, "chat")
    assert _key(kube) == "rotated-by-admin"

    # Deleted: the next reconcile makes a new one (another rotation), never the old one again.
    del kube.objects[("Secret", c.NS, "chat-internal-key")]
    c._reconcile(ctx, kube, "chat")
    assert _key(kube) not in (first, "rotated-by-admin")

    # Each deployment has its own key; deleting the deployment collects its Secret.
    kube.create("ModelDeployment", "other", {})
    c._reconcile(ctx, kube, "other")
    assert _key(kube, "other") != _key(kube)
    kube.remove("ModelDeployment", "chat")
    assert kube.names("Secret") == ["other-internal-key"]


def test_the_key_exists_before_the_pods_that_mount_it():
    c = _cluster()
    kube = c.FakeKube()
    ctx = c._ctx(kube, [], c.Clock())
    kube.create("ModelDeployment", "chat", DISAGGREGATED)
    c._reconcile(ctx, kube, "chat")
    writes = [(verb, kind) for verb, kind, _ in kube.calls if verb in ("create", "apply")]
    assert writes.index(("create", "Secret")) < writes.index(("apply", "Deployment"))
    assert kube.names("Secret") == ["chat-internal-key"]  # one for both roles


def test_the_reconciled_router_mounts_each_backends_key():
    c = _cluster()
    from tokenfleet.operator.reconcile import reconcile_routers

    kube = c.FakeKube()
    ctx = c._ctx(kube, [], c.Clock())
    kube.create("RoutingPolicy", "front", {})
    kube.create("ModelDeployment", "chat", {"routingPolicyRef": "front"})
    kube.create("ModelDeployment", "code", {**DISAGGREGATED, "routingPolicyRef": "front"})
    kube.create("ModelDeployment", "alone", {})  # routed by nobody: no router mounts its key
    reconcile_routers(ctx, kube.watched(), c.NS, c.LOG)
    config = RouterConfig.model_validate(
        yaml.safe_load(kube.obj("ConfigMap", "front-router")["data"]["router.yaml"])
    )
    pod = _pod(kube.obj("Deployment", "front-router"))
    assert {b.name: _file_in_pod(pod, b.internal_key_file)[0] for b in config.backends} == {
        "chat": "chat-internal-key",
        "code-prefill": "code-internal-key",
        "code-decode": "code-internal-key",
    }
    assert "alone-internal-key" not in str(pod)
