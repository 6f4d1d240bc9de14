"""Fuzz documents for the three custom resources, generated from the CRD schemas in crds/ with a seeded RNG.

Three families:
- valid: every property drawn from its schema (enum, bounds, pattern examples, list lengths), optional
  properties present at random;
- boundary: the same with numbers at their bounds, strings and lists at their longest or shortest, maps
  empty, names up to 253 characters (or with dots, or a leading digit);
- malformed: a valid document with one mutation at a known field — a wrong type, an unknown field, a value
  out of range (number, length, pattern, enum, list size), a required field removed — or one contradictory
  combination taken from the cross-field rules (CEL and the operator's validators).

Every document keeps the cluster quiet when it is accepted: replica counts are forced to 0 (runtime pods,
each role's pods, routers) unless the mutation is on that field, and no valid document carries
`autoscaling` (the autoscaler would scale it to its minimum and start pods).

Names carry a unique token `q<5 digits>` (no other `q` is ever generated in a name) so an API call on any
child object (`<name>-runtime`, `<name>-router`, ...) can be attributed to its document (audit_log.py).
"""

from __future__ import annotations

import copy
import random
import re
import string
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from tokenfleet.operator.api import parse_cache_policy, parse_model_deployment, parse_routing_policy
from tokenfleet.runtime.errors import ConfigError

CRDS = Path(__file__).resolve().parent.parent / "crds"
API_VERSION = "serving.tokenfleet.dev/v1alpha1"
PLURALS = {
    "ModelDeployment": "modeldeployments",
    "CachePolicy": "cachepolicies",
    "RoutingPolicy": "routingpolicies",
}
TOKEN = re.compile(r"q(\d{5})")
UNKNOWN_FIELD = "bogusField"
MAX_NAME = 253
LONG_STRING = 300  # strings without a maxLength: long enough to overflow any name or label they reach

# Values for each pattern the schemas use: a pattern cannot be sampled generally without a regex engine,
# so each one needs examples here; `pattern_examples` fails naming a pattern that has none, and every
# example is checked against its pattern before use.
PATTERN_EXAMPLES = {
    "source": ["smollm2-135m-instruct", "pvc://models/llama/model.gguf", "file:///models/tiny",
               "hf://org/name@main", "m"],
    "quantity-cpu": ["2", "500m", "0.5", "64"],
    "quantity-memory": ["4Gi", "512Mi", "1G", "1024"],
    "ref": ["a", "shared", "front-1"],
    "kind": ["Service", "X", "InferenceService"],
    "group": ["", "example.com", "a"],
    "adapter-name": ["sql", "team-a/chat-v2", "org:fine.tune_1"],
    "adapter-source": ["pvc://adapters/team-a/sql", "file:///srv/lora/x", "pvc://a/b", "hf://org/name", "hf://org/name@main"],
    # Documents start no pod (ZERO_REPLICAS): nothing ever downloads from these.
    "url": ["https://huggingface.co", "http://127.0.0.1:9", "https://hf-mirror.example/hub"],
}  # fmt: skip
NON_MATCHING = ["", "-bad-", "UPPER_case!", "pvc://", "1.5.5", "a b", "\u00e9t\u00e9", "hf://x"]
# Unset fields that the operator needs a (fixed) zero for: accepted documents must start no pod.
ZERO_REPLICAS = {
    "ModelDeployment": [("replicas",), ("disaggregation", "prefill", "replicas"),
                        ("disaggregation", "decode", "replicas")],
    "RoutingPolicy": [("router", "replicas")],
    "CachePolicy": [],
}  # fmt: skip
NO_AUTOSCALING = {"autoscaling"}
PARSERS = {
    "ModelDeployment": parse_model_deployment,
    "CachePolicy": parse_cache_policy,
    "RoutingPolicy": parse_routing_policy,
}


@dataclass(frozen=True, slots=True)
class FuzzDoc:
    kind: str
    name: str
    body: dict[str, Any]
    family: str  # valid | boundary | malformed
    mutation: str  # "" for valid/boundary; else wrong-type, unknown-field, out-of-range, ...
    field: str | None  # the offending field's path ("spec.engine.maxNumSeqs") for a malformed document

    @property
    def index(self) -> int:
        return int(TOKEN.search(self.name).group(1))  # type: ignore[union-attr]

    @property
    def leaf(self) -> str | None:
        """The offending field's own name, as any message about it would say it."""
        if self.field is None:
            return None
        return re.sub(r"\[\d+\]$", "", self.field.rsplit(".", 1)[-1])


def spec_schemas() -> dict[str, dict[str, Any]]:
    out = {}
    for kind, plural in PLURALS.items():
        crd = yaml.safe_load((CRDS / f"serving.tokenfleet.dev_{plural}.yaml").read_text())
        out[kind] = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    return out


def field_names(schemas: dict[str, dict[str, Any]]) -> set[str]:
    """Every property name in the schemas: what a message that names a field contains."""
    names: set[str] = set()

    def walk(node: dict[str, Any]) -> None:
        for key, child in (node.get("properties") or {}).items():
            names.add(key)
            walk(child)
        for sub in ("items", "additionalProperties"):
            if isinstance(node.get(sub), dict):
                walk(node[sub])

    for schema in schemas.values():
        walk(schema)
    return names


def _pattern_key(path: tuple[str, ...], pattern: str) -> str:
    if "adapters" in path:  # a LoRA adapter's name (any model name) or folder (pvc://, file:// or hf://)
        return "adapter-source" if path[-1] == "source" else "adapter-name"
    if pattern.startswith("^(pvc://"):
        return "source"
    if path[-1] == "cpu":
        return "quantity-cpu"
    if path[-1] == "memory":
        return "quantity-memory"
    if path[-1] == "kind":
        return "kind"
    if path[-1] == "group":
        return "group"
    if path[-1] == "hfEndpoint":
        return "url"
    if pattern == r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$":
        return "ref"
    raise KeyError(f"no PATTERN_EXAMPLES for {'.'.join(path)} ({pattern}): add some")


def pattern_examples(path: tuple[str, ...], pattern: str) -> list[str]:
    examples = PATTERN_EXAMPLES[_pattern_key(path, pattern)]
    bad = [e for e in examples if not re.fullmatch(pattern.removeprefix("^").removesuffix("$"), e)]
    assert not bad, f"examples {bad} do not match {pattern}"
    return examples


def _bounds(schema: dict[str, Any], integer: bool) -> tuple[float, float]:
    step = 1 if integer else 1e-3
    lo = schema.get("minimum", -1e6 if not integer else -(2**31))
    hi = schema.get("maximum", 2**31 - 1 if integer else 1e9)
    if schema.get("exclusiveMinimum"):
        lo += step
    if schema.get("exclusiveMaximum"):
        hi -= step
    return lo, hi


class Generator:
    def __init__(self, seed: int):
        self.rng = random.Random(seed)
        self.schemas = spec_schemas()

    # ------------------------------------------------------------------------------------------- valid values
    def value(self, schema: dict[str, Any], path: tuple[str, ...], boundary: bool) -> Any:
        rng = self.rng
        t = schema.get("type")
        if "enum" in schema:
            return rng.choice(schema["enum"])
        if t == "object":
            return self.obj(schema, path, boundary)
        if t == "array":
            return self.array(schema, path, boundary)
        if t == "boolean":
            return rng.random() < 0.5
        if t in ("integer", "number"):
            lo, hi = _bounds(schema, t == "integer")
            if boundary:
                x = rng.choice([lo, hi])
            elif t == "integer":
                x = rng.randint(int(lo), int(min(hi, lo + 64 if lo > -1e6 else 64)))
            else:
                x = rng.uniform(lo, min(hi, max(lo, 0) + 10))
            return int(x) if t == "integer" else float(x)
        if t == "string":
            if "pattern" in schema:
                examples = pattern_examples(path, schema["pattern"])
                value = rng.choice(examples)
                if boundary and "maxLength" in schema and _pattern_key(path, schema["pattern"]) == "ref":
                    value = "a" * schema["maxLength"]
                return value
            lo = schema.get("minLength", 0)
            hi = schema.get("maxLength", LONG_STRING)
            n = rng.choice([lo, hi]) if boundary else rng.randint(max(lo, 1), min(hi, 12))
            return "".join(rng.choice(string.ascii_lowercase + " -_") for _ in range(n)) if n else ""
        raise ValueError(f"unhandled schema type {t!r} at {'.'.join(path)}")

    def obj(self, schema: dict[str, Any], path: tuple[str, ...], boundary: bool) -> dict[str, Any]:
        rng = self.rng
        required = set(schema.get("required") or ())
        out: dict[str, Any] = {}
        for key, child in (schema.get("properties") or {}).items():
            if key in NO_AUTOSCALING and key not in required:
                continue
            if key in required or rng.random() < (0.7 if boundary else 0.4):
                out[key] = self.value(child, (*path, key), boundary)
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for _ in range(0 if boundary and rng.random() < 0.5 else rng.randint(0, 2)):
                out[rng.choice(["free", "gold", "t-1"])] = self.value(extra, (*path, "*"), boundary)
        return out

    def array(self, schema: dict[str, Any], path: tuple[str, ...], boundary: bool) -> list[Any]:
        rng = self.rng
        hi = min(schema.get("maxItems", 8), 8)
        n = rng.choice([0, hi]) if boundary else rng.randint(0, min(hi, 3))
        items = [self.value(schema["items"], (*path, "[]"), boundary) for _ in range(n)]
        for key in schema.get("x-kubernetes-list-map-keys") or ():
            for i, item in enumerate(items):  # list-map keys must be unique
                item[key] = f"{item.get(key) or 'k'}-{i}"
        return items

    # -------------------------------------------------------------------------------------------------- names
    def name(self, index: int, boundary: bool) -> str:
        token = f"q{index:05d}"
        alphabet = "abcdefghijklmnoprstuvwxyz0123456789"  # no q: the token is the only one
        if not boundary:
            return (
                "".join(self.rng.choice(alphabet[:25]) for _ in range(self.rng.randint(1, 6))) + "-" + token
            )
        shape = self.rng.choice(["long", "dots", "digit", "label"])
        if shape == "long":
            return "a" * (MAX_NAME - len(token) - 1) + "-" + token
        if shape == "dots":
            return f"a.b-{token}"
        if shape == "label":  # exactly 63 characters: the longest label value
            return "b" * (63 - len(token) - 1) + "-" + token
        return f"9{token}"

    # ---------------------------------------------------------------------------------------------- documents
    def document(self, kind: str, index: int, family: str) -> FuzzDoc:
        boundary = family == "boundary"
        spec = self.obj(self.schemas[kind], (), boundary)
        # A malformed document starts from one the operator's own validators accept (the CEL rules say the
        # same), so the one mutation is its only problem and the refusal has to name that field.
        while family == "malformed" and not _accepted(kind, spec):
            spec = self.obj(self.schemas[kind], (), boundary)
        name = self.name(index, boundary)
        mutation, field = "", None
        if family == "malformed":
            mutation, field = self.mutate(kind, spec)
        for path in ZERO_REPLICAS[kind]:
            if field != "spec." + ".".join(path):
                _zero(spec, path)
        body = {"apiVersion": API_VERSION, "kind": kind, "metadata": {"name": name}, "spec": spec}
        return FuzzDoc(kind, name, body, family, mutation, field)

    def mutate(self, kind: str, spec: dict[str, Any]) -> tuple[str, str]:
        rng = self.rng
        choice = rng.choice(
            ["wrong-type", "unknown-field", "out-of-range", "missing-required", "contradictory"]
        )
        if choice == "contradictory":
            return "contradictory", self.contradict(kind, spec)
        if choice == "missing-required":
            found = self.missing_required(kind, spec)
            if found:
                return "missing-required", found
            choice = "out-of-range"
        candidates = list(_leaves(self.schemas[kind], ()))
        if choice == "out-of-range":
            candidates = [(p, s) for p, s in candidates if _can_exceed(s)]
        path, schema = rng.choice(candidates)
        parent = _materialise(spec, path[:-1], self.schemas[kind])
        if choice == "unknown-field":
            target = parent if isinstance(parent, dict) else spec
            target[UNKNOWN_FIELD] = rng.choice([1, "x", True])
            return "unknown-field", ".".join(("spec", *path[:-1], UNKNOWN_FIELD))
        if choice == "wrong-type":
            parent[path[-1]] = _wrong_type(schema, rng)
        else:
            parent[path[-1]] = self.out_of_range(schema, path)
        return choice, ".".join(("spec", *path))

    def out_of_range(self, schema: dict[str, Any], path: tuple[str, ...]) -> Any:
        rng = self.rng
        if "enum" in schema:
            return "not-" + str(schema["enum"][0])
        t = schema.get("type")
        if t in ("integer", "number"):
            options = []
            if "minimum" in schema:
                options.append(schema["minimum"] - (0 if schema.get("exclusiveMinimum") else 1))
            if "maximum" in schema:
                options.append(schema["maximum"] + (0 if schema.get("exclusiveMaximum") else 1))
            x = rng.choice(options)
            return int(x) if t == "integer" else float(x)
        if t == "array":
            return [self.value(schema["items"], (*path, "[]"), False) for _ in range(schema["maxItems"] + 1)]
        if "pattern" in schema:
            bad = [s for s in NON_MATCHING if not re.fullmatch(schema["pattern"][1:-1], s)]
            return rng.choice(bad)
        if "maxLength" in schema and (rng.random() < 0.5 or not schema.get("minLength")):
            return "a" * (schema["maxLength"] + 1)
        return ""  # under minLength

    def missing_required(self, kind: str, spec: dict[str, Any]) -> str | None:
        options = []

        def walk(node: dict[str, Any], path: tuple[str, ...]) -> None:
            for key in node.get("required") or ():
                options.append((path, key))
            for key, child in (node.get("properties") or {}).items():
                walk(child, (*path, key))
            if isinstance(node.get("items"), dict):
                walk(node["items"], (*path, "0"))

        walk(self.schemas[kind], ())
        if not options:
            return None
        path, key = self.rng.choice(options)
        parent = _materialise(spec, path, self.schemas[kind])
        if not isinstance(parent, dict):
            return None
        full = self.obj(_schema_at(self.schemas[kind], path), path, False)
        parent.update({k: v for k, v in full.items() if k not in parent})
        parent.pop(key, None)
        return ".".join(("spec", *path, key))

    def contradict(self, kind: str, spec: dict[str, Any]) -> str:
        """One combination the cross-field rules forbid (CEL, list-map keys, or the operator's validators)."""
        rng = self.rng
        autoscaling = {"maxReplicas": 2, "targets": {"kvCacheUsage": 0.8}}
        combos = {
            "ModelDeployment": [
                ("spec.tensorParallelSize", {"tensorParallelSize": 3, "resources": {"gpus": 4}}),
                ("spec.model.quantization", {"model": {"quantization": "fp8"}, "resources": {"gpus": 0}}),
                ("spec.autoscaling.minReplicas",
                 {"autoscaling": {**autoscaling, "minReplicas": 3}}),
                ("spec.autoscaling.minReplicas", {"autoscaling": {**autoscaling, "minReplicas": 0}}),
                ("spec.autoscaling", {"autoscaling": autoscaling, "disaggregation": {}}),
                ("spec.autoscaling.targets", {"autoscaling": {"maxReplicas": 2, "targets": {}}}),
                ("spec.disaggregation.prefill.autoscaling.minReplicas",
                 {"disaggregation": {"prefill": {"autoscaling": {**autoscaling, "minReplicas": 0}}}}),
                ("spec.engine.speculative.draftModel", {"engine": {"speculative": {"method": "draft"}}}),
                ("spec.model.cacheClaim", {"model": {"source": "smollm2-135m-instruct", "cacheClaim": "models"}}),
            ],
            "CachePolicy": [
                ("spec.cpuOffload.sizeGiB", {"cpuOffload": {"enabled": True, "sizeGiB": 0}}),
            ],
            "RoutingPolicy": [
                ("spec.priorityClasses", {"priorityClasses": [{"name": "a", "priority": 1},
                                                              {"name": "a", "priority": 2}]}),
                ("spec.modelRoutes", {"modelRoutes": [{"model": "m", "backends": ["no-such-backend"]}]}),
                ("spec.modelRoutes", {"modelRoutes": [{"model": "a", "backends": [], "fallback": ["b"]},
                                                      {"model": "b", "backends": [], "fallback": ["a"]}]}),
                ("spec.modelRoutes", {"modelRoutes": [{"model": "m", "split": [{"backend": "x", "weight": 0}]}]}),
            ],
        }  # fmt: skip
        field, patch = rng.choice(combos[kind])
        if field == "spec.autoscaling.minReplicas":
            spec.pop("routingPolicyRef", None)  # what would make minReplicas 0 valid
        for key in ("autoscaling", "disaggregation", "resources", "tensorParallelSize"):
            if key in patch and kind == "ModelDeployment":
                spec.pop(key, None)
        spec.update(_merge(spec, copy.deepcopy(patch)))
        if field == "spec.model.quantization":
            spec.pop("tensorParallelSize", None)
        return field


def generate(count: int, seed: int, batch_size: int) -> list[FuzzDoc]:
    """`count` documents, kinds in turn, about 40% valid, 20% boundary, 40% malformed; same seed, same list.

    Documents are applied `batch_size` at a time, each batch in a namespace of its own: half of the
    ModelDeployments' policy references point at a policy of their batch (which may itself be invalid),
    the rest at names that do not exist there."""
    gen = Generator(seed)
    kinds = list(PLURALS)
    docs = []
    for i in range(count):
        roll = gen.rng.random()
        family = "valid" if roll < 0.4 else "boundary" if roll < 0.6 else "malformed"
        docs.append(gen.document(kinds[i % len(kinds)], i, family))
    for start in range(0, count, batch_size):
        batch = docs[start : start + batch_size]
        for doc in batch:
            spec = doc.body["spec"]
            for key, kind in (("cachePolicyRef", "CachePolicy"), ("routingPolicyRef", "RoutingPolicy")):
                if doc.kind != "ModelDeployment" or not isinstance(spec.get(key), str) or doc.leaf == key:
                    continue
                targets = [
                    d.name for d in batch if d.kind == kind and len(d.name) <= 63 and "." not in d.name
                ]
                if targets and gen.rng.random() < 0.5:
                    spec[key] = gen.rng.choice(targets)
    return docs


# ------------------------------------------------------------------------------------------------- helpers
def _accepted(kind: str, spec: dict[str, Any]) -> bool:
    try:
        PARSERS[kind](copy.deepcopy(spec))
    except ConfigError:
        return False
    return True


def _leaves(schema: dict[str, Any], path: tuple[str, ...]):
    """(path, schema) of every scalar or list property (list items: index 0)."""
    for key, child in (schema.get("properties") or {}).items():
        if child.get("type") == "object" and "properties" in child:
            yield from _leaves(child, (*path, key))
        else:
            yield (*path, key), child
        if child.get("type") == "array" and child["items"].get("type") == "object":
            yield from _leaves(child["items"], (*path, key, "0"))


def _schema_at(schema: dict[str, Any], path: tuple[str, ...]) -> dict[str, Any]:
    for key in path:
        schema = schema["items"] if key.isdigit() else schema["properties"][key]
    return schema


def _materialise(spec: dict[str, Any], path: tuple[str, ...], schema: dict[str, Any]) -> Any:
    """The container at `path` in `spec`, created (objects, one-item lists) where missing."""
    node: Any = spec
    for i, key in enumerate(path):
        sub = _schema_at(schema, path[: i + 1])
        if key.isdigit():
            while len(node) <= int(key):
                node.append({})
            if not isinstance(node[int(key)], dict):
                node[int(key)] = {}
            node = node[int(key)]
            continue
        if not isinstance(node.get(key), dict | list):
            node[key] = [] if sub.get("type") == "array" else {}
        node = node[key]
    return node


def _zero(spec: dict[str, Any], path: tuple[str, ...]) -> None:
    """Set a replica count to 0, creating the objects on the way (their defaults would say 1), but never
    the optional section it lives in (`disaggregation` absent stays absent)."""
    if len(path) > 2 and not isinstance(spec.get(path[0]), dict):
        return
    node = spec
    for key in path[:-1]:
        if not isinstance(node.get(key, {}), dict):
            return  # a mutated (wrong-type) parent: the document is rejected anyway
        node = node.setdefault(key, {})
    node[path[-1]] = 0


def _merge(base: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in patch.items():
        out[key] = (
            _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
        )
    return out


def _can_exceed(schema: dict[str, Any]) -> bool:
    return any(
        k in schema for k in ("enum", "minimum", "maximum", "maxLength", "minLength", "maxItems", "pattern")
    )


def _wrong_type(schema: dict[str, Any], rng: random.Random) -> Any:
    t = schema.get("type")
    options = {
        "string": [7, True, ["x"], {"a": 1}],
        "integer": ["seven", 1.5, [1], True],
        "number": ["fast", [1.0], {"x": 1}],
        "boolean": ["yes", 1, [True]],
        "array": ["a,b", 3, {"0": "x"}],
        "object": ["x", 5, [1, 2]],
    }[t]
    return rng.choice(options)
