"""RouterConfig reads what the operator writes: the RoutingPolicy spec in camelCase plus backends."""

from __future__ import annotations

import pytest
import yaml
from tokenfleet.runtime.errors import ConfigError
from tokenfleet.runtime.router.config import RouterConfig

OPERATOR_CONFIG = {
    "routing": {
        "strategy": "session-affinity",
        "weights": {"prefix": 2, "queue": 1, "kvUsage": 0.5},
        "balance": {"absolute": 4, "relative": 1.2},
        "modelRoutes": [{"model": "chat", "backends": ["small"], "fallback": ["tiny"]}],
        "priorityClasses": [
            {"name": "batch", "priority": -1},
            {"name": "interactive", "priority": 10, "tiers": ["gold"]},
        ],
        "rateLimits": {
            "requestsPerMinute": 60,
            "tokensPerMinute": 10000,
            "tiers": {"gold": {"requestsPerMinute": 600}},
        },
        "retries": {"maxAttempts": 2, "connectTimeoutSeconds": 1},
        "router": {"replicas": 2},
    },
    "backends": [
        {"name": "small", "model": "chat", "url": "http://small.ns1.svc:8000", "blockSize": 32},
        {"name": "tiny", "model": "tiny", "url": "http://tiny.ns1.svc.cluster.local:9000"},
    ],
    "discovery": {"mode": "kubernetes"},
}


def test_parses_the_operator_shape(tmp_path):
    path = tmp_path / "router.yaml"
    path.write_text(yaml.safe_dump(OPERATOR_CONFIG))
    cfg = RouterConfig.load(path)
    assert cfg.routing.weights.kv_usage == 0.5
    assert cfg.routing.model_routes[0].fallback == ("tiny",)
    assert cfg.routing.rate_limits.tiers["gold"].requests_per_minute == 600
    assert cfg.routing.retries.max_attempts == 2
    assert cfg.backends[0].block_size == 32
    assert cfg.backends[0].service == ("small", "ns1", 8000)
    assert cfg.backends[1].service == ("tiny", "ns1", 9000)
    # Round trip through the operator's dump (by alias) is lossless.
    assert RouterConfig.model_validate(cfg.model_dump(mode="json", by_alias=True)) == cfg


@pytest.mark.parametrize(
    "patch",
    [
        {"routing": {"strategy": "random"}},
        {"routing": {"weigths": {}}},  # a typo must not silently mean defaults
        {"routing": {"modelRoutes": [{"model": "x", "backends": ["nope"]}]}},
        {"backends": [{"name": "a", "model": "m", "url": "ftp://x"}]},
        {
            "backends": [
                {"name": "a", "model": "m", "url": "http://x"},
                {"name": "a", "model": "m", "url": "http://y"},
            ]
        },
    ],
)
def test_invalid_configs_fail_loudly(tmp_path, patch):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(patch))
    with pytest.raises(ConfigError):
        RouterConfig.load(path)


def test_api_keys_with_tiers(tmp_path):
    keyfile = tmp_path / "keys"
    keyfile.write_text("# comment\nk2:gold\n\nk3\n")
    cfg = RouterConfig(api_keys=("k1",), api_key_file=str(keyfile))
    assert cfg.key_tiers() == {"k1": "default", "k2": "gold", "k3": "default"}


def test_minimum_shares_of_priority_classes_cannot_exceed_the_whole():
    classes = [{"name": "a", "priority": 0, "minShare": 0.6}, {"name": "b", "priority": 5, "minShare": 0.5}]
    with pytest.raises(ValueError, match="minShare"):
        RouterConfig.model_validate({"routing": {"priorityClasses": classes}})
