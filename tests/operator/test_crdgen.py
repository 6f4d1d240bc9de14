"""The checked-in CRDs equal the generator's output, and the schemas are structural."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenfleet.operator.api import CachePolicySpec
from tokenfleet.operator.crdgen import build_crd, openapi_schema, rendered_files

CRDS = Path(__file__).resolve().parents[2] / "crds"


@pytest.mark.parametrize("name", sorted(rendered_files()))
def test_checked_in_crds_match_the_models(name):
    path = CRDS / name
    assert path.exists(), f"{path} missing: run `make crds`"
    assert path.read_text() == rendered_files()[name], f"{path} drifted from operator/api.py: run `make crds`"


def test_no_stray_files_in_crds():
    assert sorted(p.name for p in CRDS.iterdir()) == sorted(rendered_files())


def _walk(node, path="$"):
    yield path, node
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _walk(value, f"{path}.{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _walk(value, f"{path}[{i}]")


@pytest.mark.parametrize("kind", ["ModelDeployment", "CachePolicy", "RoutingPolicy"])
def test_schemas_are_structural(kind):
    schema = build_crd(kind)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    for path, node in _walk(schema):
        if not isinstance(node, dict) or path.endswith(".properties") or "x-kubernetes-validations" in path:
            continue
        assert "$ref" not in node and "anyOf" not in node and "title" not in node, path
        if "exclusiveMinimum" in node:
            assert node["exclusiveMinimum"] is True, path
        if node.get("type") == "object" and "properties" in node:
            assert node.get("additionalProperties") is None, path
        if "properties" in node or "items" in node:
            assert "type" in node, f"{path} lacks a type"


def test_model_deployment_crd_shape():
    crd = build_crd("ModelDeployment")
    version = crd["spec"]["versions"][0]
    assert crd["spec"]["names"]["shortNames"] == ["md"]
    assert version["subresources"]["scale"] == {
        "specReplicasPath": ".spec.replicas",
        "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector",
    }
    assert [c["name"] for c in version["additionalPrinterColumns"]] == [
        "Model", "Replicas", "Desired", "Ready", "Asleep", "Loading", "Adapters", "Phase", "Endpoint", "Age"
    ]  # fmt: skip
    spec = version["schema"]["openAPIV3Schema"]["properties"]["spec"]
    assert spec["properties"]["replicas"]["default"] == 1
    assert spec["properties"]["model"]["default"] == {}  # so the API server fills nested defaults
    assert "tensorParallelSize must divide" in spec["x-kubernetes-validations"][0]["message"]
    assert spec["properties"]["tensorParallelSize"]["description"]


def test_nullable_and_aliases():
    schema = openapi_schema(CachePolicySpec)
    ttl = schema["properties"]["prefixCaching"]["properties"]["ttlSeconds"]
    assert ttl["nullable"] is True and ttl["type"] == "number"
    assert ttl["minimum"] == 0 and ttl["exclusiveMinimum"] is True
    assert "cpuKVCacheGiB" in schema["properties"]
    assert schema["properties"]["blockSize"]["enum"] == [8, 16, 32, 64, 128]
