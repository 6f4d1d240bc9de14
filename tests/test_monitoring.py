"""manifests/monitoring/ only queries what tokenfleet really exports.

Every PromQL expression of the Grafana dashboard and of the PrometheusRule is checked, in both metric namings
(`metrics.naming: tokenfleet | vllm`), against the series the code defines: the runtime's and the router's
metrics registries are instantiated and exercised (one child per labelled metric) and their samples read
back; the ModelDeployment replica series are those the kube-state-metrics config derives from fields that
must exist in the ModelDeployment CRD the operator generates. Label matchers must name labels the series
carry (their own or those the PodMonitors attach) and `le` matchers real bucket bounds.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry
from prometheus_client.metrics import MetricWrapperBase
from tokenfleet.runtime.engine.kv_cache.cache_metrics import KVCacheMetrics
from tokenfleet.runtime.engine.outputs import EngineStats
from tokenfleet.runtime.router.metrics import RouterMetrics
from tokenfleet.runtime.server.kv_transfer import KVTransferMetrics
from tokenfleet.runtime.server.metrics import NAMINGS, ServerMetrics

ROOT = Path(__file__).resolve().parents[1]
MONITORING = ROOT / "manifests" / "monitoring"
CRD = ROOT / "crds" / "serving.tokenfleet.dev_modeldeployments.yaml"
NAMING_VALUES = tuple(NAMINGS)  # the dashboard's `naming` variable takes exactly these
# Labels Prometheus (Operator) itself attaches to every scraped series of a PodMonitor target.
SCRAPE_LABELS = frozenset({"namespace", "pod", "container", "endpoint", "job", "instance"})
KSM_LABELS = frozenset({"customresource_group", "customresource_kind", "customresource_version"})


@dataclass
class Series:
    labels: set[str] = field(default_factory=set)
    buckets: set[str] = field(default_factory=set)  # `le` values of a _bucket series


# ---- what the code exports -------------------------------------------------------------------------------


def _exercise(owner: object) -> None:
    """One child per labelled metric of `owner`, so its samples (and so its label names) appear on scrape."""
    for value in vars(owner).values():
        # prometheus_client keeps a metric's label names only in _labelnames; a child (already `.labels()`)
        # has its values in _labelvalues.
        if isinstance(value, MetricWrapperBase) and value._labelnames and not value._labelvalues:
            value.labels(*["x"] * len(value._labelnames))


def _series(registry: CollectorRegistry, extra_labels: frozenset[str]) -> dict[str, Series]:
    out: dict[str, Series] = {}
    for family in registry.collect():
        for sample in family.samples:
            series = out.setdefault(sample.name, Series(labels=set(extra_labels)))
            series.labels.update(sample.labels)
            if sample.name.endswith("_bucket"):
                series.buckets.add(sample.labels["le"])
    return out


def _podmonitor_labels() -> dict[str, frozenset[str]]:
    """component (runtime | router) -> the labels its PodMonitor attaches to every series."""
    out = {}
    for doc in yaml.safe_load_all((MONITORING / "podmonitors.yaml").read_text()):
        component = doc["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"]
        relabeled = {
            r["targetLabel"] for ep in doc["spec"]["podMetricsEndpoints"] for r in ep.get("relabelings", ())
        }
        out[component] = SCRAPE_LABELS | relabeled
    return out


def runtime_series(naming: str) -> dict[str, Series]:
    stats = EngineStats(kv_metrics=KVCacheMetrics(*[0] * len(KVCacheMetrics.__dataclass_fields__)))
    metrics = ServerMetrics("model", lambda: stats, naming)
    _exercise(metrics)
    _exercise(KVTransferMetrics(metrics.registry))  # the server registers these on the same registry
    return _series(metrics.registry, _podmonitor_labels()["runtime"])


def router_series() -> dict[str, Series]:
    metrics = RouterMetrics()
    _exercise(metrics)
    return _series(metrics.registry, _podmonitor_labels()["router"])


def _schema_type(path: list[str]) -> str:
    """The CRD's type of the field at `path` (spec/status, camelCase as in the resource)."""
    crd = yaml.safe_load(CRD.read_text())
    node = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    for part in path:
        props = node.get("properties", {})
        assert part in props, f"ModelDeployment has no field {'.'.join(path)}"
        node = props[part]
        if "anyOf" in node:  # optional fields: one of the alternatives is null
            node = next(alt for alt in node["anyOf"] if alt.get("type") != "null")
    return node.get("type")


def state_metrics_series() -> dict[str, Series]:
    """kube-state-metrics' series for ModelDeployments, each checked to read a numeric CRD field."""
    config = yaml.safe_load((MONITORING / "modeldeployment-state-metrics.yaml").read_text())
    out = {}
    for resource in config["spec"]["resources"]:
        gvk = resource["groupVersionKind"]
        crd = yaml.safe_load(CRD.read_text())
        assert (gvk["group"], gvk["kind"]) == (crd["spec"]["group"], crd["spec"]["names"]["kind"])
        assert gvk["version"] in [v["name"] for v in crd["spec"]["versions"]]
        labels = set(resource["labelsFromPath"]) | KSM_LABELS | {"job", "instance"}
        for metric in resource["metrics"]:
            path = metric["each"]["gauge"]["path"]
            assert _schema_type(path) in ("integer", "number"), path
            out[f"{resource['metricNamePrefix']}_{metric['name']}"] = Series(labels=set(labels))
    return out


def exported(naming: str) -> dict[str, Series]:
    return {**runtime_series(naming), **router_series(), **state_metrics_series()}


# ---- PromQL: the selectors of an expression --------------------------------------------------------------

_TOKEN = re.compile(
    r"""(?P<string>"(?:[^"\\]|\\.)*")
      |(?P<braces>\{[^{}]*\})
      |(?P<range>\[[^\]]*\])
      |(?P<ident>[A-Za-z_:][A-Za-z0-9_:]*)
      |(?P<number>\d+(?:\.\d+)?[smhdwy]?)
      |(?P<paren>[()])
      |(?P<other>[^\s])""",
    re.X,
)
_MATCHER = re.compile(r'\s*([A-Za-z_][A-Za-z0-9_]*)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"\s*,?')
_GROUPING = {"by", "without", "on", "ignoring", "group_left", "group_right"}
_KEYWORDS = {"and", "or", "unless", "bool", "offset", "inf", "nan"}
_AGGREGATIONS = {
    "sum",
    "min",
    "max",
    "avg",
    "count",
    "stddev",
    "stdvar",
    "topk",
    "bottomk",
    "quantile",
    "group",
}


@dataclass(frozen=True)
class Selector:
    names: tuple[str, ...]  # one metric name, or the alternatives of a {__name__=~"a|b"} selector
    matchers: tuple[tuple[str, str, str], ...]  # (label, op, value), __name__ excluded


def _matchers(braces: str) -> list[tuple[str, str, str]]:
    body = braces[1:-1].strip()
    found = _MATCHER.findall(body)
    assert "".join(m.group(0) for m in _MATCHER.finditer(body)).strip() == body, f"bad matchers {braces}"
    return found


def selectors(expr: str) -> list[Selector]:
    tokens = [(m.lastgroup, m.group()) for m in _TOKEN.finditer(expr)]
    assert sum(1 for k, t in tokens if t == "(") == sum(1 for k, t in tokens if t == ")"), expr
    out, i = [], 0
    while i < len(tokens):
        kind, text = tokens[i]
        following = tokens[i + 1][1] if i + 1 < len(tokens) else ""
        if kind == "ident" and text in _GROUPING and following == "(":
            i = next(j for j in range(i, len(tokens)) if tokens[j][1] == ")") + 1  # a label list
            continue
        if kind == "ident" and (following == "(" or text in _KEYWORDS | _AGGREGATIONS):
            i += 1
            continue
        if kind in ("ident", "braces"):
            name = text if kind == "ident" else None
            matchers = []
            if kind == "braces":
                matchers = _matchers(text)
            elif following.startswith("{"):
                matchers = _matchers(following)
                i += 1
            names = [name] if name else []
            for label, op, value in matchers:
                if label == "__name__":
                    assert op in ("=", "=~") and re.fullmatch(r"[A-Za-z0-9_:|]+", value), value
                    names = value.split("|")
            assert names, f"selector without a metric name in {expr!r}"
            out.append(Selector(tuple(names), tuple(m for m in matchers if m[0] != "__name__")))
        i += 1
    return out


def _substitute(expr: str, naming: str) -> str:
    return expr.replace("${naming}", naming).replace("$naming", naming).replace("$__rate_interval", "5m")


def problems(expr: str, available: dict[str, dict[str, Series]], naming: str) -> list[str]:
    """Why `expr` (with the dashboard variable `naming` set) would find no data; [] when it would."""
    found = []
    everywhere = {name for series in available.values() for name in series}
    for sel in selectors(_substitute(expr, naming)):
        here = [n for n in sel.names if n in available[naming]]
        found += [f"{n} is exported in no naming" for n in sel.names if n not in everywhere]
        if not here:
            found.append(f"{'|'.join(sel.names)} is not exported with metrics.naming={naming}")
        for name in here:
            series = available[naming][name]
            for label, _, value in sel.matchers:
                if label not in series.labels:
                    found.append(f"{name} has no label {label!r} (has {sorted(series.labels)})")
                elif label == "le" and value not in series.buckets:
                    found.append(f"{name} has no bucket le={value!r}")
    return found


# ---- the manifests ----------------------------------------------------------------------------------------


def _dashboard() -> dict:
    return json.loads((MONITORING / "tokenfleet-dashboard.json").read_text())


def dashboard_exprs() -> list[str]:
    return [t["expr"] for p in _dashboard()["panels"] for t in p["targets"]]


def rule_exprs() -> list[str]:
    rule = yaml.safe_load((MONITORING / "prometheusrule.yaml").read_text())
    return [r["expr"] for group in rule["spec"]["groups"] for r in group["rules"]]


def _label_values_queries() -> list[tuple[str, str]]:
    """(selector, label) of each `label_values(selector, label)` template variable."""
    out = []
    for var in _dashboard()["templating"]["list"]:
        if var["type"] != "query":
            continue
        match = re.fullmatch(r"label_values\((.*),\s*([A-Za-z_]+)\)", var["query"]["query"])
        assert match, var["query"]
        out.append((match.group(1), match.group(2)))
    return out


@pytest.fixture(scope="module")
def available() -> dict[str, dict[str, Series]]:
    return {naming: exported(naming) for naming in NAMING_VALUES}


def test_the_naming_variable_offers_exactly_the_runtime_namings():
    variable = next(v for v in _dashboard()["templating"]["list"] if v["name"] == "naming")
    assert [o["value"] for o in variable["options"]] == list(NAMING_VALUES)
    assert variable["query"].split(",") == list(NAMING_VALUES)


@pytest.mark.parametrize("naming", NAMING_VALUES)
def test_every_dashboard_query_finds_exported_series(available, naming):
    exprs = dashboard_exprs()
    assert len(exprs) >= 12
    assert all("${naming}" in e or "tokenfleet:" in e or "tokenfleet_" in e for e in exprs)
    report = {e: p for e in exprs if (p := problems(e, available, naming))}
    assert not report, json.dumps(report, indent=1)
    for selector, label in _label_values_queries():
        assert not problems(selector, available, naming), selector
        for sel in selectors(selector):
            assert label in available[naming][sel.names[0]].labels, (selector, label)


@pytest.mark.parametrize("naming", NAMING_VALUES)
def test_every_alert_holds_in_both_namings(available, naming):
    exprs = rule_exprs()
    report = {e: p for e in exprs if (p := problems(e, available, naming))}
    assert not report, json.dumps(report, indent=1)


def test_the_dashboard_covers_each_signal(available):
    """The panels an operator looks for are there (by the series they read, whatever their titles)."""
    used = {n for e in dashboard_exprs() for s in selectors(_substitute(e, "tokenfleet")) for n in s.names}
    for name in (
        "tokenfleet:time_to_first_token_seconds_bucket",
        "tokenfleet:inter_token_latency_seconds_bucket",
        "tokenfleet:generation_tokens_total",
        "tokenfleet:num_requests_waiting",
        "tokenfleet:kv_cache_usage_perc",
        "tokenfleet:prefix_cache_hits_total",
        "tokenfleet:num_preemptions_total",
        "tokenfleet_modeldeployment_spec_replicas",
        "tokenfleet_modeldeployment_status_ready_replicas",
        "tokenfleet:router_pending_requests",
        "tokenfleet:router_pod_waiting_requests",
        "tokenfleet:router_resumes_total",
        "tokenfleet:router_queue_wait_seconds_sum",
        "tokenfleet:request_queue_time_seconds_sum",
        "tokenfleet:request_prefill_time_seconds_sum",
    ):
        assert name in used, name
    alerts = {
        r["alert"]
        for g in yaml.safe_load((MONITORING / "prometheusrule.yaml").read_text())["spec"]["groups"]
        for r in g["rules"]
    }
    assert {
        "TokenfleetKVCacheNearlyFull",
        "TokenfleetQueueGrowing",
        "TokenfleetTTFTBudgetBurnFast",
        "TokenfleetPodsNotReady",
        "TokenfleetResumeFailures",
    } <= alerts


def test_the_checker_catches_what_would_show_no_data(available):
    """Not vacuous: a name only one naming exports, a misspelt name, a label or bucket that does not exist."""
    assert not problems("${naming}:num_kv_blocks_total", available, "tokenfleet")
    # vLLM has no such metric, so it stays tokenfleet:num_kv_blocks_total in the vllm naming too.
    assert problems("${naming}:num_kv_blocks_total", available, "vllm") == [
        "vllm:num_kv_blocks_total is exported in no naming",
        "vllm:num_kv_blocks_total is not exported with metrics.naming=vllm",
    ]
    assert problems("sum(tokenfleet:num_request_waiting)", available, "tokenfleet")
    assert problems(
        '{__name__=~"tokenfleet:num_requests_waiting|vllm:num_request_waiting"}', available, "vllm"
    )
    assert problems('tokenfleet:router_resumes_total{model_deployment="a"}', available, "tokenfleet")
    assert problems('vllm:num_requests_waiting{model="m"}', available, "vllm")
    bucket = 'tokenfleet:time_to_first_token_seconds_bucket{le="%s"}'
    assert not problems(bucket % "2.5", available, "tokenfleet")
    assert problems(bucket % "3.0", available, "tokenfleet")
    assert problems("tokenfleet_modeldeployment_spec_replicas", available, "vllm") == []


def test_kustomization_lists_every_manifest():
    kustomization = yaml.safe_load((MONITORING / "kustomization.yaml").read_text())
    listed = set(kustomization["resources"]) | {
        f for gen in kustomization["configMapGenerator"] for f in gen["files"]
    }
    assert listed == {p.name for p in MONITORING.iterdir()} - {"kustomization.yaml"}
    for name in kustomization["resources"]:
        assert all(
            doc["apiVersion"] and doc["kind"] for doc in yaml.safe_load_all((MONITORING / name).read_text())
        )


def _meta_label(label: str) -> str:
    """Prometheus' service-discovery name of a pod label (every non-alphanumeric character -> `_`)."""
    return "__meta_kubernetes_pod_label_" + re.sub(r"[^A-Za-z0-9_]", "_", label)


def test_podmonitors_select_and_read_the_labels_the_operator_puts_on_pods():
    from tokenfleet.operator.builders import common_labels
    from tokenfleet.operator.disaggregation import ROLE_LABEL
    from tokenfleet.operator.router_builders import router_labels

    pod_labels = {
        "runtime": {**common_labels("md"), ROLE_LABEL: "decode"},
        "router": router_labels("policy"),
    }
    for doc in yaml.safe_load_all((MONITORING / "podmonitors.yaml").read_text()):
        selector = doc["spec"]["selector"]["matchLabels"]
        component = selector["app.kubernetes.io/component"]
        labels = pod_labels[component]
        assert selector.items() <= labels.items(), component
        readable = {_meta_label(k) for k in labels}
        for endpoint in doc["spec"]["podMetricsEndpoints"]:
            assert endpoint["port"] == "http"
            for relabel in endpoint.get("relabelings", ()):
                assert set(relabel["sourceLabels"]) <= readable, relabel
