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
    build_router_service,
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
    dep = build_router_deployment("chat", cfg, "img:1", ["a"])
    pod = dep["spec"]["template"]["spec"]
    assert dep["spec"]["replicas"] == 3
    assert pod["serviceAccountName"] == "chat-router"
    assert pod["containers"][0]["command"] == [
        "tokenfleet",
        "route",
        "--config",
        "/etc/tokenfleet/router.yaml",
    ]
    key = "serving.tokenfleet.dev/config-hash"
    annotations = dep["spec"]["template"]["metadata"]["annotations"]
    # Policy edits and backend changes are applied live by the routers: the pod template stays the same.
    edited = parse_routing_policy(
        {"strategy": "round-robin", "weights": {"prefix": 9}, "router": {"replicas": 5}}
    )
    other = build_router_deployment(
        "chat", build_router_config("ns", edited, [_backend("a", "pvc://m/x")], generation=7), "img:1", ["a"]
    )
    assert other["spec"]["template"] == dep["spec"]["template"]
    assert other["spec"]["replicas"] == 5
    assert annotations[key] == other["spec"]["template"]["metadata"]["annotations"][key]
    # A deployment joining the policy brings its internal key, a volume: only that rolls the routers.
    joined = build_router_deployment(
        "chat", build_router_config("ns", edited, [_backend("a"), _backend("b")]), "img:1", ["a", "b"]
    )
    assert joined["spec"]["template"]["spec"]["volumes"] != pod["volumes"]
    assert annotations[key] == joined["spec"]["template"]["metadata"]["annotations"][key]
    rb = build_router_role_binding("chat")
    assert rb["roleRef"]["name"] == "tokenfleet-router"
    assert rb["subjects"] == [{"kind": "ServiceAccount", "name": "chat-router"}]


def test_router_keys_from_a_secret():
    spec = parse_routing_policy({"apiKeySecret": {"name": "router-keys", "key": "tiers"}})
    cfg = build_router_config("ns", spec, [_backend("a")], generation=3)
    assert cfg.api_key_file == "/etc/tokenfleet-keys/tiers" and cfg.generation == 3
    dep = build_router_deployment("chat", cfg, "img:1")
    pod = dep["spec"]["template"]["spec"]
    assert {"name": "api-keys", "secret": {"secretName": "router-keys", "defaultMode": 0o440}} in pod[
        "volumes"
    ]
    mount = {"name": "api-keys", "mountPath": "/etc/tokenfleet-keys", "readOnly": True}
    assert mount in pod["containers"][0]["volumeMounts"]  # the whole Secret: no subPath, rotation reaches it
    assert "subPath" not in str(pod)


def test_model_deployment_keys_from_a_secret():
    from tokenfleet.operator.builders import build_deployment

    md = parse_model_deployment({"apiKeySecret": {"name": "pod-keys"}})
    config = build_runtime_config(md, None)
    assert config.server.api_key_file == "/etc/tokenfleet-keys/keys"
    pod = build_deployment("chat", md, config)["spec"]["template"]["spec"]
    assert {"name": "api-keys", "secret": {"secretName": "pod-keys", "defaultMode": 0o440}} in pod["volumes"]
    assert build_runtime_config(parse_model_deployment({}), None).server.api_key_file is None


def _router_pod(name: str, ip: str | None, ready: bool = True, deleting: bool = False) -> dict:
    meta = {"name": name, **({"deletionTimestamp": "2026-01-01T00:00:00Z"} if deleting else {})}
    conditions = [{"type": "Ready", "status": "True" if ready else "False"}]
    return {"metadata": meta, "status": {"podIP": ip, "conditions": conditions}}


def test_routing_policy_status_reports_the_generation_each_router_applied():
    from tokenfleet.operator.router_status import routers_status

    metrics = {
        "http://10.0.0.1:8080/metrics": "# HELP x\ntokenfleet:router_config_generation 4.0\n",
        "http://10.0.0.2:8080/metrics": "tokenfleet:router_config_generation 3.0\n",  # not swapped in yet
        "http://10.0.0.3:8080/metrics": None,  # unreachable
    }
    pods = [
        _router_pod("r-b", "10.0.0.2"),
        _router_pod("r-a", "10.0.0.1"),
        _router_pod("r-c", "10.0.0.3"),
        _router_pod("r-starting", "10.0.0.4", ready=False),
        _router_pod("r-leaving", "10.0.0.5", deleting=True),
    ]
    assert routers_status(pods, metrics.get) == [
        {"pod": "r-a", "generation": 4},
        {"pod": "r-b", "generation": 3},
        {"pod": "r-c", "generation": None},
    ]
    assert routers_status([], metrics.get) == []


async def test_the_router_exports_the_generation_the_operator_reads(tmp_path):
    from tokenfleet.operator.router_status import applied_generation
    from tokenfleet.runtime.router.metrics import RouterMetrics

    metrics = RouterMetrics()
    metrics.config_generation.set(7)
    assert applied_generation(metrics.render().decode()) == 7
    metrics.config_generation.set(-1)  # a hand-written file names no generation
    assert applied_generation(metrics.render().decode()) is None


def test_router_replicas_find_each_other_through_their_service_to_hold_one_quota():
    cfg = build_router_config("ns", parse_routing_policy({}), [_backend("a")], rp_name="chat")
    assert (cfg.peers.service, cfg.peers.port) == ("chat-router", 8080)
    assert build_router_service("chat")["metadata"]["name"] == "chat-router"


def test_an_adapters_copies_bounds_reach_the_routers():
    md = parse_model_deployment(
        {
            "adapters": [
                {"name": "sql", "source": "pvc://c/sql", "minCopies": 1, "maxCopies": 2},
                {"name": "chat", "source": "pvc://c/chat"},
            ]
        }
    )
    backend = build_backend("m", "ns", build_runtime_config(md, None), True, adapters=md.adapters)
    assert backend.adapters == ("sql", "chat")
    assert {n: (c.min_copies, c.max_copies) for n, c in backend.adapter_copies.items()} == {"sql": (1, 2)}
    text = yaml.safe_dump(backend.model_dump(mode="json", by_alias=True))
    assert (
        RouterConfig.model_validate({"backends": [yaml.safe_load(text)]}).backends[0].adapter_copies
        == backend.adapter_copies
    )
