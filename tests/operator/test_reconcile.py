"""Reconcile logic over an in-memory cluster: the calls of `Kube` (get, list by label, apply, patch_status,
delete) backed by a dict, and `Watched` built from the same dict the way kopf's indexes are. No apiserver
here; the e2e suite runs the same code against a real one."""

from __future__ import annotations

import copy
import json
import logging
from typing import Any

import kopf
import pytest
import yaml
from kubernetes.client.exceptions import ApiException
from tokenfleet.operator.builders import RUNTIME_PORT
from tokenfleet.operator.inference_pool import PoolSupport
from tokenfleet.operator.kube import KINDS, NamespaceTerminating, NotServed, _namespace_terminating
from tokenfleet.operator.reconcile import (
    OperatorContext,
    Watched,
    policy_refs,
    reconcile_cache_policy,
    reconcile_dependents,
    reconcile_model_deployment,
    reconcile_routers,
    reconcile_routing_policy,
    refresh_cache_policies,
)

NS = "team"
API = "serving.tokenfleet.dev/v1alpha1"
LOG = logging.getLogger("test-reconcile")


def merge_patch(target: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    """RFC 7386, as the API server applies `application/merge-patch+json` (null removes a key)."""
    out = dict(target)
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge_patch(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


class FakeKube:
    """The `Kube` interface over a dict; server-side apply keeps what others wrote (status, uid)."""

    def __init__(self, served: set[str] | None = None):
        self.served = set(KINDS) - {"InferencePool"} if served is None else served
        self.objects: dict[tuple[str, str, str], dict[str, Any]] = {}
        self.terminating: set[str] = set()  # namespaces being deleted: no new objects there
        self.refused: set[str] = set()  # kinds whose writes the API server rejects as invalid (422)
        self.calls: list[tuple[str, str, str]] = []
        self._uid = 0

    def _key(self, kind: str, namespace: str, name: str) -> tuple[str, str, str]:
        return (kind, namespace, name)

    def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        self.calls.append(("get", kind, name))
        obj = self.objects.get(self._key(kind, namespace, name))
        return copy.deepcopy(obj)

    def list(self, kind: str, namespace: str, label_selector: str) -> list[dict[str, Any]]:
        self.calls.append(("list", kind, label_selector))
        wanted = dict(pair.split("=", 1) for pair in label_selector.split(","))
        return [
            copy.deepcopy(o)
            for (k, ns, _), o in sorted(self.objects.items())
            if k == kind and ns == namespace and wanted.items() <= (o["metadata"].get("labels") or {}).items()
        ]

    def apply(self, obj: dict[str, Any]) -> dict[str, Any]:
        meta = obj["metadata"]
        self.calls.append(("apply", obj["kind"], meta["name"]))
        if obj["kind"] not in self.served:
            raise NotServed(obj["kind"])
        if obj["kind"] in self.refused:
            raise ApiException(status=422, reason="Unprocessable Entity")
        key = self._key(obj["kind"], meta["namespace"], meta["name"])
        stored = copy.deepcopy(obj)
        before = self.objects.get(key)
        if before is None and meta["namespace"] in self.terminating:
            raise NamespaceTerminating(meta["namespace"])
        if before is None:
            self._uid += 1
            stored["metadata"].update(uid=f"uid-{self._uid}", generation=1)
        else:
            stored["metadata"].update(
                uid=before["metadata"]["uid"], generation=before["metadata"]["generation"]
            )
            if "status" in before:
                stored["status"] = before["status"]
        self.objects[key] = stored
        return copy.deepcopy(stored)

    def create_if_absent(self, obj: dict[str, Any]) -> bool:
        meta = obj["metadata"]
        self.calls.append(("create", obj["kind"], meta["name"]))
        key = self._key(obj["kind"], meta["namespace"], meta["name"])
        if key in self.objects:
            return False  # the API server's 409: nothing is written
        if meta["namespace"] in self.terminating:
            raise NamespaceTerminating(meta["namespace"])
        self._uid += 1
        self.objects[key] = copy.deepcopy(obj)
        self.objects[key]["metadata"]["uid"] = f"uid-{self._uid}"
        return True

    def patch_status(self, kind: str, namespace: str, name: str, status: dict[str, Any]) -> None:
        self.calls.append(("patch_status", kind, name))
        obj = self.objects[self._key(kind, namespace, name)]
        obj["status"] = merge_patch(obj.get("status") or {}, status)

    def delete(self, kind: str, namespace: str, name: str) -> bool:
        self.calls.append(("delete", kind, name))
        return self.objects.pop(self._key(kind, namespace, name), None) is not None

    # ---- what a user (kubectl) does, and what kopf's indexes would hold
    def create(self, kind: str, name: str, spec: dict[str, Any]) -> None:
        self._uid += 1
        self.objects[(kind, NS, name)] = {
            "apiVersion": API,
            "kind": kind,
            "metadata": {"name": name, "namespace": NS, "uid": f"uid-{self._uid}", "generation": 1},
            "spec": copy.deepcopy(spec),
        }

    def edit(self, kind: str, name: str, spec: dict[str, Any]) -> None:
        obj = self.objects[(kind, NS, name)]
        obj["spec"] = copy.deepcopy(spec)
        obj["metadata"]["generation"] += 1

    def remove(self, kind: str, name: str) -> None:
        """A user's delete with garbage collection: the object and everything it owns."""
        uid = self.objects.pop((kind, NS, name))["metadata"]["uid"]
        for key, obj in list(self.objects.items()):
            if any(ref["uid"] == uid for ref in obj["metadata"].get("ownerReferences", [])):
                del self.objects[key]

    def watched(self) -> Watched:
        def index(kind: str) -> dict[str, list[tuple[str, dict]]]:
            out: dict[str, list[tuple[str, dict]]] = {}
            for (k, ns, name), obj in self.objects.items():
                if k == kind:
                    out.setdefault(ns, []).append((name, copy.deepcopy(obj["spec"])))
            return out

        return Watched(index("ModelDeployment"), index("CachePolicy"), index("RoutingPolicy"))

    def names(self, kind: str) -> list[str]:
        return sorted(name for (k, _, name) in self.objects if k == kind)

    def obj(self, kind: str, name: str) -> dict[str, Any]:
        return self.objects[(kind, NS, name)]

    def count(self, verb: str, kind: str) -> int:
        return sum(1 for v, k, _ in self.calls if (v, k) == (verb, kind))


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def events() -> list[tuple[str, str, str, str]]:
    return []


def _ctx(kube: FakeKube, events: list, clock: Clock) -> OperatorContext:
    return OperatorContext(
        kube=kube,  # type: ignore[arg-type]
        resync_seconds=60,
        now=lambda: "2026-01-01T00:00:00Z",
        event=lambda owner, type_, reason, message: events.append(
            (owner["metadata"]["name"], type_, reason, message)
        ),
        pools=PoolSupport(recheck_seconds=60, clock=clock),
    )


def _reconcile(ctx: OperatorContext, kube: FakeKube, name: str) -> None:
    reconcile_model_deployment(ctx, kube.watched(), NS, name, LOG)


def _ready(kube: FakeKube, name: str, replicas: int) -> None:
    """Play the Deployment controller: every replica is up on the current template."""
    dep = kube.obj("Deployment", name)
    dep["status"] = {
        "observedGeneration": dep["metadata"]["generation"],
        "replicas": replicas,
        "updatedReplicas": replicas,
        "readyReplicas": replicas,
        "availableReplicas": replicas,
    }


def test_model_deployment_gets_its_children_and_becomes_ready(clock, events):
    kube = FakeKube()
    ctx = _ctx(kube, events, clock)
    kube.create("ModelDeployment", "chat", {"replicas": 2})
    _reconcile(ctx, kube, "chat")

    assert kube.names("Deployment") == ["chat"]
    assert kube.names("Service") == ["chat"]
    assert kube.names("ConfigMap") == ["chat-runtime"]
    assert kube.names("PodDisruptionBudget") == ["chat"]
    budget = kube.obj("PodDisruptionBudget", "chat")["spec"]
    assert budget == {"maxUnavailable": 1, "selector": kube.obj("Deployment", "chat")["spec"]["selector"]}
    owner_uid = kube.obj("ModelDeployment", "chat")["metadata"]["uid"]
    for kind, name in (
        ("Deployment", "chat"),
        ("Service", "chat"),
        ("ConfigMap", "chat-runtime"),
        ("PodDisruptionBudget", "chat"),
    ):
        assert [ref["uid"] for ref in kube.obj(kind, name)["metadata"]["ownerReferences"]] == [owner_uid]
    status = kube.obj("ModelDeployment", "chat")["status"]
    assert status["phase"] == "Progressing"
    assert events[-1][:3] == ("chat", "Normal", "Progressing")

    _ready(kube, "chat", 2)
    _reconcile(ctx, kube, "chat")
    status = kube.obj("ModelDeployment", "chat")["status"]
    assert (status["phase"], status["readyReplicas"]) == ("Ready", 2)
    assert events[-1][:3] == ("chat", "Normal", "Ready")

    # Level-based and quiet: nothing changed, so nothing is written and no Event is posted.
    writes, posted = kube.count("patch_status", "ModelDeployment"), len(events)
    _reconcile(ctx, kube, "chat")
    assert kube.count("patch_status", "ModelDeployment") == writes and len(events) == posted


def test_invalid_spec_fails_with_a_condition_and_a_warning(clock, events):
    kube = FakeKube()
    ctx = _ctx(kube, events, clock)
    kube.create("ModelDeployment", "bad", {"tensorParallelSize": 2, "resources": {"gpus": 3}})
    with pytest.raises(kopf.PermanentError, match="tensorParallelSize"):
        _reconcile(ctx, kube, "bad")
    status = kube.obj("ModelDeployment", "bad")["status"]
    assert status["phase"] == "Failed"
    assert {c["type"]: c["status"] for c in status["conditions"]}["ConfigValid"] == "False"
    assert events[-1][1] == "Warning"
    assert kube.names("Deployment") == []


@pytest.mark.parametrize("name", ["m" * 56, "a.b", "9lives"])
def test_a_name_its_services_cannot_take_is_reported_not_applied(clock, events, name):
    """A custom resource may be named by any DNS-1123 subdomain, a Service only by a 63-character DNS-1035
    label: the children cannot exist, so the status and an Event say so instead of a refused apply."""
    kube = FakeKube()
    ctx = _ctx(kube, events, clock)
    kube.create("ModelDeployment", name, {"routingPolicyRef": "front"})
    kube.create("RoutingPolicy", "r" * 57, {})
    kube.create("RoutingPolicy", "front", {})
    with pytest.raises(kopf.PermanentError, match=r"metadata\.name"):
        _reconcile(ctx, kube, name)
    status = kube.obj("ModelDeployment", name)["status"]
    assert status["phase"] == "Failed" and "metadata.name" in status["conditions"][0]["message"]
    assert events[-1][:2] == (name, "Warning")
    with pytest.raises(kopf.PermanentError, match=r"metadata\.name"):
        reconcile_routing_policy(ctx, kube.watched(), NS, "r" * 57, LOG)
    assert kube.obj("RoutingPolicy", "r" * 57)["status"]["conditions"][0]["status"] == "False"
    reconcile_routing_policy(ctx, kube.watched(), NS, "front", LOG)
    # The router leaves the unnameable ModelDeployment out; nothing else was applied for either.
    assert yaml.safe_load(kube.obj("ConfigMap", "front-router")["data"]["router.yaml"])["backends"] == []
    assert kube.names("Deployment") == ["front-router"]
    _reconcile(ctx, kube, "m" * 55)  # the longest name that fits: not even created, so nothing to do


def test_missing_cache_policy_waits_then_its_creation_unblocks_the_dependent(clock, events):
    kube = FakeKube()
    ctx = _ctx(kube, events, clock)
    kube.create("ModelDeployment", "a", {"cachePolicyRef": "shared"})
    with pytest.raises(kopf.TemporaryError, match="CachePolicy/shared"):
        _reconcile(ctx, kube, "a")
    assert kube.obj("ModelDeployment", "a")["status"]["phase"] == "Pending"
    assert kube.names("Deployment") == []

    kube.create("CachePolicy", "shared", {"blockSize": 32, "prefixCaching": {"eviction": "s3fifo"}})
    reconcile_cache_policy(ctx, kube.watched(), NS, "shared", LOG)
    runtime = yaml.safe_load(kube.obj("ConfigMap", "a-runtime")["data"]["runtime.yaml"])
    assert (runtime["cache"]["block_size"], runtime["cache"]["eviction"]) == (32, "s3fifo")
    assert kube.obj("CachePolicy", "shared")["status"]["usedBy"] == ["a"]


def test_policy_edit_reaches_only_its_dependents(clock, events):
    kube = FakeKube()
    ctx = _ctx(kube, events, clock)
    kube.create("CachePolicy", "p", {"blockSize": 16})
    kube.create("ModelDeployment", "uses", {"cachePolicyRef": "p"})
    kube.create("ModelDeployment", "other", {})
    for name in ("uses", "other"):
        _reconcile(ctx, kube, name)
    other_before = kube.obj("ConfigMap", "other-runtime")["data"]

    kube.edit("CachePolicy", "p", {"blockSize": 64})
    names = reconcile_dependents(ctx, kube.watched(), NS, "cachePolicyRef", "p", LOG)
    assert names == ["uses"]
    assert (
        yaml.safe_load(kube.obj("ConfigMap", "uses-runtime")["data"]["runtime.yaml"])["cache"]["block_size"]
        == 64
    )
    assert kube.obj("ConfigMap", "other-runtime")["data"] == other_before


def test_router_follows_the_model_deployments_that_reference_it(clock, events):
    kube = FakeKube()
    ctx = _ctx(kube, events, clock)
    kube.create("RoutingPolicy", "front", {"strategy": "least-load"})
    kube.create("ModelDeployment", "a", {"routingPolicyRef": "front", "model": {"servedName": "m"}})
    kube.create("ModelDeployment", "b", {})
    reconcile_routers(ctx, kube.watched(), NS, LOG)

    def backends() -> list[str]:
        config = yaml.safe_load(kube.obj("ConfigMap", "front-router")["data"]["router.yaml"])
        return sorted(b["name"] for b in config["backends"])

    assert backends() == ["a"]
    assert kube.obj("RoutingPolicy", "front")["status"]["usedBy"] == ["a"]

    kube.edit("ModelDeployment", "b", {"routingPolicyRef": "front"})
    reconcile_routers(ctx, kube.watched(), NS, LOG)
    assert backends() == ["a", "b"]
    assert kube.obj("RoutingPolicy", "front")["status"]["usedBy"] == ["a", "b"]


def test_a_model_deployment_change_reconciles_only_the_policies_it_names_before_and_after(clock, events):
    kube = FakeKube()
    ctx = _ctx(kube, events, clock)
    for rp in ("front", "back", "other"):
        kube.create("RoutingPolicy", rp, {"strategy": "least-load"})
    kube.create("ModelDeployment", "a", {"routingPolicyRef": "front", "model": {"servedName": "m"}})
    reconcile_routers(ctx, kube.watched(), NS, LOG)
    before = copy.deepcopy(kube.obj("ModelDeployment", "a"))

    # a moves from front to back: both routers change, "other" is not read or written.
    kube.edit("ModelDeployment", "a", {"routingPolicyRef": "back", "model": {"servedName": "m"}})
    after = kube.obj("ModelDeployment", "a")
    names = policy_refs("routingPolicyRef", before, after)
    assert names == {"front", "back"}
    kube.calls.clear()
    reconcile_routers(ctx, kube.watched(), NS, LOG, names)
    touched = {name for _, _, name in kube.calls}
    assert "other" not in touched and not any(n.startswith("other-") for n in touched), touched
    assert kube.obj("RoutingPolicy", "front")["status"]["usedBy"] == []
    assert kube.obj("RoutingPolicy", "back")["status"]["usedBy"] == ["a"]

    # A reference to a policy that does not exist (yet) is skipped; none at all reconciles nothing.
    kube.calls.clear()
    reconcile_routers(
        ctx, kube.watched(), NS, LOG, policy_refs("routingPolicyRef", {"spec": {"routingPolicyRef": "nope"}})
    )
    reconcile_routers(ctx, kube.watched(), NS, LOG, policy_refs("routingPolicyRef", None, {"spec": {}}))
    assert kube.calls == []

    # The same for cache policies: only the one it names gets its usedBy refreshed.
    kube.create("CachePolicy", "c1", {})
    kube.create("CachePolicy", "c2", {})
    kube.edit("ModelDeployment", "a", {"routingPolicyRef": "back", "cachePolicyRef": "c1"})
    refresh_cache_policies(ctx, kube.watched(), NS, LOG, policy_refs("cachePolicyRef", after))
    assert kube.obj("CachePolicy", "c1")["status"]["usedBy"] == ["a"]
    assert "status" not in kube.obj("CachePolicy", "c2")


def test_inference_pool_selects_the_runtime_pods_on_their_port(clock, events):
    kube = FakeKube(served=set(KINDS))
    ctx = _ctx(kube, events, clock)
    kube.create("ModelDeployment", "chat", {})
    _reconcile(ctx, kube, "chat")

    pool = kube.obj("InferencePool", "chat")
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    pod_labels = kube.obj("Deployment", "chat")["spec"]["template"]["metadata"]["labels"]
    selector = pool["spec"]["selector"]["matchLabels"]
    assert selector.items() <= pod_labels.items()
    # Exactly the runtime pods of `chat`: nothing the Service `chat` does not select.
    assert selector == {
        "serving.tokenfleet.dev/model-deployment": "chat",
        "app.kubernetes.io/component": "runtime",
    }
    assert kube.obj("Service", "chat")["spec"]["selector"].items() <= pod_labels.items()
    container = kube.obj("Deployment", "chat")["spec"]["template"]["spec"]["containers"][0]
    assert pool["spec"]["targetPorts"] == [{"number": container["ports"][0]["containerPort"]}]
    assert pool["spec"]["targetPorts"] == [{"number": RUNTIME_PORT}]
    assert pool["spec"]["endpointPickerRef"] == {
        "group": "",
        "kind": "Service",
        "name": "chat-epp",
        "port": {"number": 9002},
        "failureMode": "FailClose",
    }
    assert (
        pool["metadata"]["ownerReferences"][0]["uid"]
        == kube.obj("ModelDeployment", "chat")["metadata"]["uid"]
    )

    # Kept in sync with the spec: another picker, then off (the pool goes), then on again.
    kube.edit(
        "ModelDeployment",
        "chat",
        {
            "inferencePool": {
                "endpointPicker": {"name": "shared-epp", "port": 9010, "failureMode": "FailOpen"}
            }
        },
    )
    _reconcile(ctx, kube, "chat")
    ref = kube.obj("InferencePool", "chat")["spec"]["endpointPickerRef"]
    assert (ref["name"], ref["port"], ref["failureMode"]) == ("shared-epp", {"number": 9010}, "FailOpen")
    kube.edit("ModelDeployment", "chat", {"inferencePool": {"enabled": False}})
    _reconcile(ctx, kube, "chat")
    assert kube.names("InferencePool") == []
    kube.edit("ModelDeployment", "chat", {})
    _reconcile(ctx, kube, "chat")
    assert kube.names("InferencePool") == ["chat"]

    # Deleting the ModelDeployment takes the pool with it (owner reference).
    kube.remove("ModelDeployment", "chat")
    assert kube.names("InferencePool") == []


def test_the_inference_pool_of_a_disaggregated_deployment_selects_the_pods_of_both_roles(clock, events):
    kube = FakeKube(served=set(KINDS))
    ctx = _ctx(kube, events, clock)
    kube.create("ModelDeployment", "chat", {"disaggregation": {"prefill": {}, "decode": {"replicas": 2}}})
    _reconcile(ctx, kube, "chat")
    selector = kube.obj("InferencePool", "chat")["spec"]["selector"]["matchLabels"]
    # Every pod either role's Deployment makes is in the pool, and the role label tells a P/D-aware picker
    # which is which; nothing of another deployment is.
    roles = {}
    for role in ("prefill", "decode"):
        labels = kube.obj("Deployment", f"chat-{role}")["spec"]["template"]["metadata"]["labels"]
        assert selector.items() <= labels.items(), role
        roles[role] = labels["serving.tokenfleet.dev/role"]
    assert roles == {"prefill": "prefill", "decode": "decode"}
    kube.create("ModelDeployment", "other", {})
    _reconcile(ctx, kube, "other")
    other_pods = kube.obj("Deployment", "other")["spec"]["template"]["metadata"]["labels"]
    assert not selector.items() <= other_pods.items()
    # Back to aggregated: while the new pods start, the roles' pods (still serving) stay in the pool with them.
    kube.edit("ModelDeployment", "chat", {})
    with pytest.raises(kopf.TemporaryError, match="waiting for Deployment chat"):
        _reconcile(ctx, kube, "chat")
    selector = kube.obj("InferencePool", "chat")["spec"]["selector"]["matchLabels"]
    for dep in ("chat", "chat-decode", "chat-prefill"):
        labels = kube.obj("Deployment", dep)["spec"]["template"]["metadata"]["labels"]
        assert selector.items() <= labels.items(), dep


def test_without_the_inference_pool_crd_everything_else_reconciles_and_it_is_said_once(clock, events, caplog):
    kube = FakeKube()  # InferencePool not served
    ctx = _ctx(kube, events, clock)
    for name in ("a", "b"):
        kube.create("ModelDeployment", name, {})
    with caplog.at_level(logging.INFO, logger=LOG.name):
        for _ in range(3):
            for name in ("a", "b"):
                _reconcile(ctx, kube, name)
    assert kube.names("Deployment") == ["a", "b"] and kube.names("Service") == ["a", "b"]
    assert kube.names("InferencePool") == []
    assert sum("InferencePool CRD" in r.getMessage() for r in caplog.records) == 1
    # One probe per recheck period, not one per reconcile.
    assert kube.count("apply", "InferencePool") == 1

    # The CRD is installed later: the next reconcile after the recheck period writes the pools.
    kube.served.add("InferencePool")
    clock.now += 61
    for name in ("a", "b"):
        _reconcile(ctx, kube, name)
    assert kube.names("InferencePool") == ["a", "b"]


def test_a_namespace_being_deleted_stops_the_reconcile_quietly(clock, events, caplog):
    """Its objects go with it; a create refused there is no error (and no 403 in the log)."""
    kube = FakeKube(served=set(KINDS))
    ctx = _ctx(kube, events, clock)
    kube.create("ModelDeployment", "late", {})
    kube.terminating.add(NS)
    with caplog.at_level(logging.DEBUG, logger=LOG.name):
        _reconcile(ctx, kube, "late")
    assert kube.names("Deployment") == [] and "status" not in kube.obj("ModelDeployment", "late")
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_only_the_namespace_lifecycle_refusal_counts_as_terminating():
    refusal = {
        "kind": "Status",
        "code": 403,
        "reason": "Forbidden",
        "details": {"causes": [{"reason": "NamespaceTerminating", "field": "metadata.namespace"}]},
    }
    rbac = {"kind": "Status", "code": 403, "reason": "Forbidden", "details": {"kind": "deployments"}}
    assert _namespace_terminating(json.dumps(refusal))
    assert not _namespace_terminating(json.dumps(rbac)) and not _namespace_terminating("not json")


def test_a_refused_inference_pool_does_not_hold_back_the_model_deployment(clock, events, caplog):
    """An InferencePool CRD whose schema rejects our pool (another version) costs a log line, not the rest."""
    kube = FakeKube(served=set(KINDS))
    kube.refused.add("InferencePool")
    ctx = _ctx(kube, events, clock)
    kube.create("ModelDeployment", "chat", {})
    with caplog.at_level(logging.WARNING, logger=LOG.name):
        _reconcile(ctx, kube, "chat")
    assert kube.names("Deployment") == ["chat"] and kube.names("InferencePool") == []
    assert kube.obj("ModelDeployment", "chat")["status"]["phase"] == "Progressing"
    assert any("InferencePool chat refused" in r.getMessage() for r in caplog.records)


def test_a_routing_policy_whose_fallbacks_form_a_cycle_is_reported_with_the_path_then_fixed(clock, events):
    kube = FakeKube()
    ctx = _ctx(kube, events, clock)
    kube.create("ModelDeployment", "a", {"routingPolicyRef": "front", "model": {"servedName": "llama"}})
    routes = [
        {"model": "chat", "backends": ["a"], "fallback": ["help"]},
        {"model": "help", "fallback": ["chat"]},
    ]
    kube.create("RoutingPolicy", "front", {"modelRoutes": routes})
    with pytest.raises(kopf.PermanentError, match="closes a cycle"):
        reconcile_routing_policy(ctx, kube.watched(), NS, "front", LOG)
    condition = kube.obj("RoutingPolicy", "front")["status"]["conditions"][0]
    assert condition["status"] == "False"
    assert (
        "modelRoutes[help].fallback[0]: 'chat' closes a cycle (chat -> help -> chat)" in condition["message"]
    )
    assert events[-1][1:3] == ("Warning", "InvalidSpec")
    assert kube.names("Deployment") == []  # no router for a policy that cannot route
    # A fallback naming a model nothing serves: the same, naming that field.
    kube.obj("RoutingPolicy", "front")["spec"] = {"modelRoutes": [{"model": "chat", "fallback": ["ghost"]}]}
    with pytest.raises(kopf.PermanentError, match="ghost"):
        reconcile_routing_policy(ctx, kube.watched(), NS, "front", LOG)
    message = kube.obj("RoutingPolicy", "front")["status"]["conditions"][0]["message"]
    assert "modelRoutes[chat].fallback[0]: no backend or route serves 'ghost'" in message
    # Fixed: a canary split with a fallback routes.
    split = [{"backend": "a", "weight": 95}]
    kube.obj("RoutingPolicy", "front")["spec"] = {
        "modelRoutes": [{"model": "chat", "split": split, "fallback": ["llama"]}]
    }
    reconcile_routing_policy(ctx, kube.watched(), NS, "front", LOG)
    assert kube.obj("RoutingPolicy", "front")["status"]["conditions"][0]["status"] == "True"
    config = yaml.safe_load(kube.obj("ConfigMap", "front-router")["data"]["router.yaml"])
    assert config["routing"]["modelRoutes"][0]["split"] == [{"backend": "a", "weight": 95.0}]


def test_a_queue_timeout_shorter_than_a_measured_cold_start_is_warned_on_the_routing_policy(clock, events):
    kube = FakeKube()
    ctx = _ctx(kube, events, clock)
    autoscaling = {"minReplicas": 0, "maxReplicas": 2, "targets": {"waitingRequestsPerReplica": 1}}
    kube.create("ModelDeployment", "a", {"routingPolicyRef": "front", "autoscaling": autoscaling})
    kube.create("RoutingPolicy", "front", {"queueTimeoutSeconds": 30})

    def condition():
        conds = kube.obj("RoutingPolicy", "front")["status"]["conditions"]
        return next(c for c in conds if c["type"] == "QueueTimeoutCoversColdStart")

    reconcile_routing_policy(ctx, kube.watched(), NS, "front", LOG)
    assert (condition()["status"], condition()["reason"]) == ("Unknown", "NotMeasured")
    kube.obj("ModelDeployment", "a")["status"] = {"autoscaling": {"coldStartSeconds": 45.2}}
    reconcile_routing_policy(ctx, kube.watched(), NS, "front", LOG)
    assert condition()["status"] == "False" and "a 45s" in condition()["message"]
    assert events[-1][1:3] == ("Warning", "QueueTimeoutBelowColdStart")
    warned = len(events)
    reconcile_routing_policy(ctx, kube.watched(), NS, "front", LOG)  # a resync: no second Event
    assert len(events) == warned
    kube.obj("RoutingPolicy", "front")["spec"] = {"queueTimeoutSeconds": 120}
    reconcile_routing_policy(ctx, kube.watched(), NS, "front", LOG)
    assert (condition()["status"], condition()["reason"]) == ("True", "Covered")
