"""RoutingPolicy -> the router's config file (which the router itself validates) and its objects."""

from __future__ import annotations

import yaml
from tokenfleet.operator.api import parse_model_deployment, parse_routing_policy
from tokenfleet.operator.builders import build_runtime_config
from tokenfleet.operator.router_builders import (
    build_backend,
    build_router_config,
    build_router_config_map,
    build_router_deployment,
    build_router_role_binding,
)
from tokenfleet.runtime.router.config import RouterConfig


def _backend(name: str, source: str = "smollm2-135m-instruct"):
    md = parse_model_deployment({"model": {"source": source, "servedName": name}})
    return build_backend(name, "ns", build_runtime_config(md, None), source == "smollm2-135m-instruct")


def test_router_config_round_trips_through_the_routers_own_schema():
    spec = parse_routing_policy({"strategy": "least-load", "router": {"replicas": 3}})
    cfg = build_router_config("ns", spec, [_backend("zeta"), _backend("alpha", "pvc://m/llama")])
    text = build_router_config_map("chat", cfg)["data"]["router.yaml"]
    loaded = RouterConfig.model_validate(yaml.safe_load(text))
    assert loaded == cfg
    assert [b.name for b in loaded.backends] == ["alpha", "zeta"]  # stable order: no spurious rollouts
    assert loaded.backends[1].url == "http://zeta.ns.svc:8000"
    assert loaded.backends[1].tokenizer == "smollm2-135m-instruct"
    assert loaded.backends[0].tokenizer is None  # a PVC model's files are not in the router pod
    assert (loaded.discovery.mode, loaded.discovery.namespace) == ("kubernetes", "ns")
    assert yaml.safe_load(text)["routing"]["strategy"] == "least-load"


def test_router_deployment_and_binding():
    spec = parse_routing_policy({"router": {"replicas": 3}})
    cfg = build_router_config("ns", spec, [_backend("a")])
    dep = build_router_deployment("chat", cfg, "img:1")
    pod = dep["spec"]["template"]["spec"]
    assert dep["spec"]["replicas"] == 3
    assert pod["serviceAccountName"] == "chat-router"
    assert pod["containers"][0]["command"] == [
        "tokenfleet",
        "route",
        "--config",
        "/etc/tokenfleet/router.yaml",
    ]
    other = build_router_deployment(
        "chat", build_router_config("ns", spec, [_backend("a"), _backend("b")]), "img:1"
    )
    key = "serving.tokenfleet.dev/config-hash"
    assert (
        dep["spec"]["template"]["metadata"]["annotations"][key]
        != other["spec"]["template"]["metadata"]["annotations"][key]
    )
    rb = build_router_role_binding("chat")
    assert rb["roleRef"]["name"] == "tokenfleet-router"
    assert rb["subjects"] == [{"kind": "ServiceAccount", "name": "chat-router"}]
