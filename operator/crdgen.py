"""Generate the CustomResourceDefinitions from the pydantic models in api.py.

`python -m tokenfleet.operator.crdgen crds/` (what `make crds` runs) writes one YAML file per kind; a unit
test fails when the checked-in files drift from the models.

Kubernetes wants *structural* OpenAPI v3.0 schemas, which differ from pydantic's JSON Schema 2020-12:
no `$ref`, `anyOf` only as a refinement (so `X | None` becomes X + `nullable`), boolean
`exclusiveMinimum`, no `additionalProperties: false` next to `properties` (unknown fields are pruned
instead), and defaults that themselves validate. The conversion below is a pure function of the JSON
Schema, so the same code serves every kind.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel
from tokenfleet.operator.api import CEL_RULES, GROUP, KINDS, LIST_MAP_KEYS, VERSION

_DROP_KEYS = {"title", "additionalProperties", "$defs"}

PRINTER_COLUMNS: dict[str, list[dict[str, Any]]] = {
    "ModelDeployment": [
        {"name": "Model", "type": "string", "jsonPath": ".spec.model.source"},
        {"name": "Replicas", "type": "integer", "jsonPath": ".spec.replicas"},
        # Empty unless spec.autoscaling is set: the autoscaler's latest decision.
        {"name": "Desired", "type": "integer", "jsonPath": ".status.autoscaling.desiredReplicas"},
        {"name": "Ready", "type": "integer", "jsonPath": ".status.readyReplicas"},
        # Empty unless autoscaling.idle is sleep: the warm tier's pods.
        {
            "name": "Asleep",
            "type": "integer",
            "jsonPath": ".status.autoscaling.sleepingReplicas",
            "priority": 1,
        },
        # Empty unless a pod is on its way: the first starting pod's stage (download, load, ...).
        {"name": "Loading", "type": "string", "jsonPath": ".status.loading[0].stage", "priority": 1},
        {"name": "Adapters", "type": "string", "jsonPath": ".status.adaptersReady"},
        {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
        {"name": "Endpoint", "type": "string", "jsonPath": ".status.endpoint"},
        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    ],
    "CachePolicy": [
        {"name": "Block", "type": "integer", "jsonPath": ".spec.blockSize"},
        {"name": "Prefix", "type": "boolean", "jsonPath": ".spec.prefixCaching.enabled"},
        {"name": "Eviction", "type": "string", "jsonPath": ".spec.prefixCaching.eviction"},
        {"name": "KV-Dtype", "type": "string", "jsonPath": ".spec.kvCacheDtype"},
        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    ],
    "RoutingPolicy": [
        {"name": "Strategy", "type": "string", "jsonPath": ".spec.strategy"},
        {"name": "Routers", "type": "integer", "jsonPath": ".spec.router.replicas"},
        {"name": "Endpoint", "type": "string", "jsonPath": ".status.endpoint"},
        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    ],
}

# Lists the API server must bound for CEL's cost estimate (rules iterate over them).
MAX_ITEMS = 64


def _resolve(node: Any, defs: dict[str, Any]) -> Any:
    """Inline every `$ref` (pydantic puts nested models under `$defs`)."""
    if isinstance(node, list):
        return [_resolve(item, defs) for item in node]
    if not isinstance(node, dict):
        return node
    if "$ref" in node:
        target = copy.deepcopy(defs[node["$ref"].rsplit("/", 1)[-1]])
        siblings = {k: v for k, v in node.items() if k != "$ref"}
        target.update(siblings)  # the field's own description wins over the class docstring
        return _resolve(target, defs)
    return {key: _resolve(value, defs) for key, value in node.items()}


def _structural(node: dict[str, Any]) -> dict[str, Any]:
    """One JSON-Schema node -> one structural OpenAPI v3.0 node (recursively)."""
    node = dict(node)
    any_of = node.pop("anyOf", None)
    if any_of is not None:
        non_null = [s for s in any_of if s.get("type") != "null"]
        if len(non_null) != 1:
            raise ValueError(f"unions other than `X | None` have no structural form: {any_of}")
        merged = {**non_null[0], **node}
        merged["nullable"] = True
        node = merged
    if "const" in node:
        node["enum"] = [node.pop("const")]
    for bound, plain in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        if bound in node and not isinstance(node[bound], bool):
            node[plain] = node.pop(bound)
            node[bound] = True
    if node.get("default", 0) is None:
        del node["default"]
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in _DROP_KEYS and not (key == "additionalProperties" and isinstance(value, dict)):
            continue
        if key == "properties":
            out[key] = {name: _structural(sub) for name, sub in value.items()}
        elif key in ("items", "additionalProperties"):
            out[key] = _structural(value)
        else:
            out[key] = value
    if out.get("type") == "object" and "properties" in out:
        # Object defaults are dropped and replaced by `{}`: the API server then fills nested defaults
        # itself, and a default never disagrees with the nested ones. An object with required fields has
        # no default at all (`{}` would not validate).
        out.pop("default", None)
        if not out.get("required") and not out.get("nullable"):  # `X | None` defaults to null, not to X()
            out["default"] = {}
        # Nor does a required property: the API server validates every default against the schema and
        # its CEL rules (an empty `targets` fails "set at least one"), and a required field has none.
        for name in out.get("required") or ():
            out["properties"][name].pop("default", None)
    if out.get("type") == "array":
        out.setdefault("maxItems", MAX_ITEMS)
        if out.get("default") == []:
            del out["default"]
    return out


def _without_defaults(node: Any) -> Any:
    """The schema with every `default` removed (recursively)."""
    if isinstance(node, list):
        return [_without_defaults(item) for item in node]
    if not isinstance(node, dict):
        return node
    return {k: _without_defaults(v) for k, v in node.items() if k != "default"}


def _attach_rules(schema: dict[str, Any], rules: dict[str, list[dict[str, str]]]) -> None:
    for path, rule_list in rules.items():
        node = schema
        for part in filter(None, path.split(".")):
            node = node["properties"][part]
        node["x-kubernetes-validations"] = rule_list


def _attach_list_keys(schema: dict[str, Any], keys: dict[str, list[str]]) -> None:
    for path, key_names in keys.items():
        node = schema
        for part in path.split("."):
            node = node["properties"][part]
        node["x-kubernetes-list-type"] = "map"
        node["x-kubernetes-list-map-keys"] = key_names


def openapi_schema(model: type[BaseModel]) -> dict[str, Any]:
    """The structural schema of one pydantic model (camelCase, as stored in the cluster)."""
    raw = model.model_json_schema(by_alias=True, mode="validation")
    resolved = _resolve({k: v for k, v in raw.items() if k != "$defs"}, raw.get("$defs", {}))
    return _structural(resolved)


def build_crd(kind: str) -> dict[str, Any]:
    info = KINDS[kind]
    plural: str = info["plural"]
    spec = openapi_schema(info["spec"])
    spec.setdefault("description", f"Desired state of the {kind}.")
    _attach_rules(spec, CEL_RULES.get(kind, {}))
    _attach_list_keys(spec, LIST_MAP_KEYS.get(kind, {}))
    # Status is written whole by the operator and never defaulted: a default would make the API server
    # invent sub-objects (e.g. an empty `autoscaling` on every ModelDeployment, or one the operator cleared).
    status = _without_defaults(openapi_schema(info["status"]))
    status["description"] = f"Observed state of the {kind}, written by the operator."
    subresources: dict[str, Any] = {"status": {}}
    if kind == "ModelDeployment":
        subresources["scale"] = {
            "specReplicasPath": ".spec.replicas",
            "statusReplicasPath": ".status.replicas",
            "labelSelectorPath": ".status.selector",
        }
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.{GROUP}"},
        "spec": {
            "group": GROUP,
            "names": {
                "kind": kind,
                "listKind": f"{kind}List",
                "plural": plural,
                "singular": kind.lower(),
                "shortNames": info["short"],
                "categories": ["tokenfleet"],
            },
            "scope": "Namespaced",
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "description": _KIND_DOCS[kind],
                            "properties": {
                                "apiVersion": {"type": "string"},
                                "kind": {"type": "string"},
                                "metadata": {"type": "object"},
                                "spec": spec,
                                "status": status,
                            },
                        }
                    },
                    "subresources": subresources,
                    "additionalPrinterColumns": PRINTER_COLUMNS[kind],
                }
            ],
        },
    }


_KIND_DOCS = {
    "ModelDeployment": "A model served by a fleet of tokenfleet runtime pods (Deployment + Service + config).",
    "CachePolicy": "KV-cache settings shared by the ModelDeployments that reference it.",
    "RoutingPolicy": "How a router fleet spreads requests over the ModelDeployments that reference it.",
}


def render(kind: str) -> str:
    header = "# Generated by `make crds` (python -m tokenfleet.operator.crdgen) from operator/api.py. Do not edit.\n"
    return header + yaml.safe_dump(build_crd(kind), sort_keys=False, width=120)


def file_name(kind: str) -> str:
    return f"{GROUP}_{KINDS[kind]['plural']}.yaml"


def render_kustomization() -> str:
    """crds/ is a kustomization of its own so manifests/ can include it (kustomize loads only whole dirs)."""
    body = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": [file_name(kind) for kind in KINDS],
    }
    return "# Generated by `make crds`. Do not edit.\n" + yaml.safe_dump(body, sort_keys=False)


def rendered_files() -> dict[str, str]:
    """Every file `make crds` writes, by name: what the drift test compares crds/ against."""
    files = {file_name(kind): render(kind) for kind in KINDS}
    files["kustomization.yaml"] = render_kustomization()
    return files


def write_all(out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in rendered_files().items():
        path = out_dir / name
        path.write_text(text)
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    for path in write_all(Path(args[0] if args else "crds")):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
