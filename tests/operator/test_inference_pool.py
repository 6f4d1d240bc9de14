"""The InferencePool the operator writes fits the vendored v1 CRD (manifests/gateway), offline.

The e2e suite proves it against a real API server; this checks the same schema without one, with a small
validator for the OpenAPI subset the CRD uses (types, required, enums, bounds, patterns, item counts).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from tokenfleet.operator.api import parse_model_deployment
from tokenfleet.operator.inference_pool import build_inference_pool
from tokenfleet.operator.kube import KINDS

CRD = (
    Path(__file__).resolve().parents[2]
    / "manifests"
    / "gateway"
    / "inference.networking.k8s.io_inferencepools.yaml"
)
TYPES = {"object": dict, "array": list, "string": str, "integer": int, "boolean": bool}


def _problems(node: dict[str, Any], value: Any, path: str = "$") -> list[str]:
    if not isinstance(value, TYPES.get(node.get("type", ""), object)):
        return [f"{path}: {value!r} is not {node['type']}"]
    out: list[str] = []
    if "enum" in node and value not in node["enum"]:
        out.append(f"{path}: {value!r} not in {node['enum']}")
    if isinstance(value, str):
        if "pattern" in node and not re.search(node["pattern"], value):
            out.append(f"{path}: {value!r} does not match {node['pattern']}")
        if not node.get("minLength", 0) <= len(value) <= node.get("maxLength", 1 << 30):
            out.append(f"{path}: length of {value!r}")
    if isinstance(value, int) and not node.get("minimum", -(1 << 62)) <= value <= node.get(
        "maximum", 1 << 62
    ):
        out.append(f"{path}: {value} out of range")
    if isinstance(value, list):
        if not node.get("minItems", 0) <= len(value) <= node.get("maxItems", 1 << 30):
            out.append(f"{path}: {len(value)} items")
        out += [p for i, item in enumerate(value) for p in _problems(node["items"], item, f"{path}[{i}]")]
    if isinstance(value, dict):
        out += [f"{path}.{key}: required" for key in node.get("required", []) if key not in value]
        props = node.get("properties", {})
        for key, item in value.items():
            if key in props:
                out += _problems(props[key], item, f"{path}.{key}")
            elif "additionalProperties" in node:
                out += _problems(node["additionalProperties"], item, f"{path}.{key}")
            elif props:
                out.append(f"{path}.{key}: unknown field (the API server would prune it)")
    return out


@pytest.fixture(scope="module")
def crd() -> dict[str, Any]:
    return yaml.safe_load(CRD.read_text())


def test_the_vendored_crd_is_the_kind_the_operator_writes(crd):
    assert "commit" in CRD.read_text().split("apiVersion:")[0]  # the header names its upstream version
    (version,) = crd["spec"]["versions"]
    kind = KINDS["InferencePool"]
    assert f"{crd['spec']['group']}/{version['name']}" == kind.api_version == "inference.networking.k8s.io/v1"
    assert crd["spec"]["names"]["plural"] == kind.plural
    assert crd["metadata"]["annotations"]["api-approved.kubernetes.io"]  # required for *.k8s.io groups


@pytest.mark.parametrize(
    "spec",
    [
        {},
        {
            "inferencePool": {
                "endpointPicker": {"name": "shared-epp", "port": 9010, "failureMode": "FailOpen"}
            }
        },
        {"inferencePool": {"endpointPicker": {"kind": "EndpointPicker", "group": "llm-d.ai", "name": "epp"}}},
    ],
)
def test_every_pool_the_operator_writes_validates(crd, spec):
    pool = build_inference_pool("chat", parse_model_deployment(spec))
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    assert _problems(schema, {k: v for k, v in pool.items() if k != "metadata"}) == []
    # The CRD's CEL rule: a Service referent needs a port (the operator always names one).
    ref = pool["spec"]["endpointPickerRef"]
    assert ref["kind"] != "Service" or "port" in ref


def test_the_validator_catches_what_the_api_server_rejects(crd):
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    pool = build_inference_pool("chat", parse_model_deployment({}))
    bad = {**pool["spec"], "targetPorts": [{"number": 8000}, {"number": 8001}]}
    assert _problems(schema, {"spec": bad})
    bad = {**pool["spec"], "endpointPickerRef": {**pool["spec"]["endpointPickerRef"], "failureMode": "Maybe"}}
    assert _problems(schema, {"spec": bad})
