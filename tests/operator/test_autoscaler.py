"""The autoscaler loop over an in-memory cluster and real HTTP: every runtime pod is an aiohttp server on
127.0.0.1 rendering its /metrics with the runtime's own `ServerMetrics` (engine figures set by the test), the
router pod renders the router's own `RouterMetrics`, and the autoscaler scrapes and parses them for real.

The cluster is a dict behind the five `Kube` calls the autoscaler makes (get, list, patch_status and scale
as JSON merge patches, patch as a JSON patch, each as the API server applies it); the test plays the
ReplicaSet controller and the kubelet by adding and removing pods, and can make the API server fail a call.
Time is passed in, so windows and cooldowns are exact.
"""

from __future__ import annotations

import asyncio
import base64
import copy
import json
import logging
import math
import random
from dataclasses import replace
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from kubernetes.client.exceptions import ApiException
from tokenfleet.operator.api import parse_model_deployment
from tokenfleet.operator.autoscaler import (
    RouterDemand,
    _demand_watched,
    autoscale,
    autoscale_roles,
    autoscaling_changed,
    router_demand,
    scale_targets,
)
from tokenfleet.operator.autoscaling_policy import History, PodSample, PodState, decide
from tokenfleet.operator.autoscaling_status import (
    from_rfc3339,
    history_from_status,
    history_to_status,
    merge_runs,
)
from tokenfleet.operator.builders import (
    PRE_STOP_SECONDS,
    build_deployment,
    build_runtime_config,
    common_labels,
    selector_string,
)
from tokenfleet.operator.crdgen import build_crd
from tokenfleet.operator.fleet_scrape import ScrapeBook, scrape_session
from tokenfleet.operator.reconcile import OperatorContext
from tokenfleet.operator.router_builders import router_labels
from tokenfleet.runtime.engine.outputs import EngineStats
from tokenfleet.runtime.errors import ConfigError
from tokenfleet.runtime.router.metrics import RouterMetrics
from tokenfleet.runtime.server.metrics import ServerMetrics

NS = "team"
MODEL = "smollm2-135m-instruct"
LOG = logging.getLogger("test-autoscaler")


# ------------------------------------------------------------------------------------------- the fake cluster
def merge_patch(target: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    """RFC 7386, as the API server applies `application/merge-patch+json`."""
    out = dict(target)
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge_patch(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


class Cluster:
    """The `Kube` calls the autoscaler uses, over a dict of objects."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str], dict[str, Any]] = {}
        self.failing: set[str] = set()  # calls the API server answers with a 500: "scale", a pod selector
        self.writes: list[str] = []  # the write calls that applied, in order

    def _maybe_fail(self, call: str) -> None:
        if call in self.failing:
            raise ApiException(status=500, reason="Internal Server Error")

    def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        return copy.deepcopy(self.objects.get((kind, name)))

    def list(self, kind: str, namespace: str, label_selector: str) -> list[dict[str, Any]]:
        self._maybe_fail(label_selector)
        wanted = dict(term.split("=", 1) for term in label_selector.split(","))
        return [
            copy.deepcopy(obj)
            for (k, _), obj in sorted(self.objects.items())
            if k == kind and wanted.items() <= obj["metadata"].get("labels", {}).items()
        ]

    def patch_status(self, kind: str, namespace: str, name: str, status: dict[str, Any]) -> None:
        obj = self.objects[(kind, name)]
        obj["status"] = merge_patch(obj.get("status") or {}, status)
        self.writes.append("patch_status")

    def delete(self, kind: str, namespace: str, name: str) -> bool:
        self.writes.append(f"delete {name}")
        return self.objects.pop((kind, name), None) is not None

    def annotate(self, kind: str, namespace: str, name: str, annotations: dict[str, str]) -> None:
        self._maybe_fail(f"annotate {name}")
        if (kind, name) not in self.objects:
            raise ApiException(status=404, reason="Not Found")
        meta = self.objects[(kind, name)]["metadata"]
        meta["annotations"] = merge_patch(meta.get("annotations") or {}, annotations)
        self.writes.append(f"annotate {name}")

    def scale(self, kind: str, namespace: str, name: str, replicas: int) -> None:
        self._maybe_fail("scale")
        self.objects[(kind, name)]["spec"]["replicas"] = replicas
        self.writes.append("scale")

    def patch(self, kind: str, namespace: str, name: str, ops: list[dict[str, Any]]) -> None:
        """JSON patch (test, replace) as the API server applies it: a failed test changes nothing (422)."""
        obj = copy.deepcopy(self.objects[(kind, name)])
        for op in ops:
            *parents, leaf = op["path"].strip("/").split("/")
            node = obj
            for key in parents:
                node = node.get(key) if isinstance(node, dict) else None
            if not isinstance(node, dict) or (op["op"] == "test" and node.get(leaf) != op["value"]):
                raise ApiException(status=422, reason=f"JSON patch {op} does not apply")
            if op["op"] == "replace":
                node[leaf] = op["value"]
        self.objects[(kind, name)] = obj
        self.writes.append("patch")

    # ---- what users, controllers and kubelets do
    def create_md(self, name: str, spec: dict[str, Any]) -> None:
        parse_model_deployment(spec)  # what the CRD's schema and CEL rules admit
        self.objects[("ModelDeployment", name)] = {
            "apiVersion": "serving.tokenfleet.dev/v1alpha1",
            "kind": "ModelDeployment",
            "metadata": {"name": name, "namespace": NS, "uid": f"uid-{name}"},
            "spec": copy.deepcopy(spec),
        }

    def md(self, name: str) -> dict[str, Any]:
        return self.objects[("ModelDeployment", name)]

    def add_pod(
        self, name: str, labels: dict[str, str], port: int | None, ready: bool = True, **status: Any
    ) -> None:
        containers = [{"name": "runtime", "ports": [{"name": "http", "containerPort": port or 1}]}]
        pod_status: dict[str, Any] = {"phase": "Running" if port else "Pending"}
        if port:
            pod_status |= {
                "podIP": "127.0.0.1",
                "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
                "containerStatuses": [
                    {"name": "runtime", "started": ready, "restartCount": 0, "ready": ready}
                ],
            }
        self.objects[("Pod", name)] = {
            "metadata": {"name": name, "namespace": NS, "labels": labels},
            "spec": {"containers": containers},
            "status": merge_patch(pod_status, status),
        }

    def remove_pod(self, name: str) -> None:
        del self.objects[("Pod", name)]


class FakePod:
    """A pod's HTTP server: /metrics from the runtime's ServerMetrics over engine figures the test sets."""

    def __init__(self, naming: str = "tokenfleet") -> None:
        self.stats = EngineStats()
        self.metrics = ServerMetrics(MODEL, lambda: self.stats, naming)
        self.failing = False
        self.malformed = False
        self.padding = 0  # bytes of other series before ours, sent in small pieces
        self.port = 0
        self._runner: web.AppRunner | None = None

    def load(self, waiting: int = 0, running: int = 0, kv: float = 0.0) -> None:
        self.stats = replace(self.stats, num_waiting=waiting, num_running=running, kv_cache_usage=kv)

    async def _metrics(self, request: web.Request) -> web.Response:
        if self.failing:
            return web.Response(status=500, text="engine gone")
        if self.malformed:
            return web.Response(text="tokenfleet:num_requests_waiting{model_name= 3\n")
        if self.padding:
            other = "".join(f'other_series{{i="{i}"}} 1\n' for i in range(self.padding // 20))
            body = (other + "# EOF-less exposition goes on\n").encode() + self.metrics.render()
            response = web.StreamResponse(headers={"Content-Type": "text/plain"})
            await response.prepare(request)
            for start in range(0, len(body), 4096):
                await response.write(body[start : start + 4096])
                await asyncio.sleep(0.001)
            await response.write_eof()
            return response
        return web.Response(body=self.metrics.render(), content_type="text/plain")

    async def start(self) -> FakePod:
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        self.routes(app)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = self._runner.addresses[0][1]
        return self

    def routes(self, app: web.Application) -> None:
        """More endpoints (a subclass's)."""

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None


class FakeRouter(FakePod):
    def __init__(self) -> None:
        super().__init__()
        self.router_metrics = RouterMetrics()

    def hold(self, model: str, n: int) -> None:
        self.router_metrics.pending.labels(model).set(n)

    def queued_in_pods(self, model: str, n: int) -> None:
        self.router_metrics.pod_waiting.labels(model).set(n)

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self.router_metrics.render(), content_type="text/plain")


@pytest.fixture
async def servers():
    started: list[FakePod] = []

    async def start(pod: FakePod) -> FakePod:
        started.append(await pod.start())
        return pod

    yield start
    for pod in started:
        await pod.stop()


@pytest.fixture
async def session():
    async with scrape_session() as s:
        yield s


class Loop:
    """One ModelDeployment's autoscaler: what the kopf timer does each period, with the time given."""

    def __init__(self, cluster: Cluster, session: aiohttp.ClientSession, name: str = "chat") -> None:
        self.cluster, self.session, self.name = cluster, session, name
        self.events: list[tuple[str, str, str]] = []
        self.ctx = OperatorContext(
            kube=cluster,  # type: ignore[arg-type]
            event=lambda owner, type_, reason, message: self.events.append((type_, reason, message)),
        )
        self.book = ScrapeBook()

    async def tick(self, now: float):
        return await autoscale(self.ctx, NS, self.name, self.book, self.session, now, LOG)

    @property
    def replicas(self) -> int:
        return self.cluster.md(self.name)["spec"]["replicas"]

    @property
    def status(self) -> dict[str, Any]:
        return self.cluster.md(self.name)["status"]["autoscaling"]

    def reasons(self) -> list[str]:
        return [reason for _, reason, _ in self.events]


def autoscaling(**overrides: Any) -> dict[str, Any]:
    spec = {
        "minReplicas": 1,
        "maxReplicas": 3,
        "targets": {"waitingRequestsPerReplica": 2},
        "scaleUp": {"stabilizationWindowSeconds": 10, "maxStep": 4, "cooldownSeconds": 0},
        "scaleDown": {"stabilizationWindowSeconds": 30, "maxStep": 1, "cooldownSeconds": 0},
    }
    return spec | overrides


# ---------------------------------------------------------------------------------------------------- the loop
async def test_step_load_scales_up_within_the_window_then_back_to_min(servers, session):
    cluster = Cluster()
    cluster.create_md("chat", {"replicas": 1, "autoscaling": autoscaling()})
    labels = common_labels("chat")
    a = await servers(FakePod())
    cluster.add_pod("chat-a", labels, a.port)
    loop = Loop(cluster, session)

    a.load(running=1)
    d = await loop.tick(0.0)
    assert (d.replicas, loop.replicas) == (1, 1) and loop.events == []

    # A step: 3 queued on one replica against a target of 2 per replica -> 2 replicas, once it has lasted
    # the 10 s scale-up window (a single spike does not order capacity).
    a.load(waiting=3, running=4)
    d = await loop.tick(5.0)
    assert loop.replicas == 1 and "not stable" in d.reason
    d = await loop.tick(15.0)
    assert loop.replicas == 2 and d.reason.startswith("scale up 1->2: waiting_requests_per_replica 3")
    assert loop.events[-1][:2] == ("Normal", "ScaledUp")

    # The new pod is cold-starting: it counts as capacity on the way, so nothing more is ordered.
    cluster.add_pod("chat-b", labels, None)
    d = await loop.tick(20.0)
    assert loop.replicas == 2 and loop.status["signals"]["starting"] == 1

    # It comes up; the load stops. Down to min only after the 30 s scale-down window, one step.
    b = await servers(FakePod())
    cluster.remove_pod("chat-b")
    cluster.add_pod("chat-b", labels, b.port)
    a.load()
    d = await loop.tick(25.0)
    assert loop.replicas == 2 and "scale-down not stable" in d.reason
    d = await loop.tick(49.0)  # 2 was still recommended at t=20
    assert loop.replicas == 2
    d = await loop.tick(50.0)
    assert loop.replicas == 1 and d.reason.startswith("scale down 2->1")
    assert loop.reasons() == ["ScaledUp", "ScaledDown"]


async def test_min_zero_scales_to_zero_when_idle_and_back_on_router_demand(servers, session):
    cluster = Cluster()
    cluster.create_md(
        "chat",
        {
            "replicas": 1,
            "routingPolicyRef": "front",
            "autoscaling": autoscaling(minReplicas=0, scaleToZeroAfterSeconds=20),
        },
    )
    a = await servers(FakePod())
    router = await servers(FakeRouter())
    cluster.add_pod("chat-a", common_labels("chat"), a.port)
    cluster.add_pod("front-router-x", router_labels("front"), router.port)
    router.hold("another-model", 5)  # demand for someone else's model is not ours
    loop = Loop(cluster, session)

    await loop.tick(0.0)
    d = await loop.tick(15.0)
    assert loop.replicas == 1 and d.reason.startswith("steady")
    d = await loop.tick(21.0)
    assert loop.replicas == 0 and d.reason == "scale down 1->0: no traffic for 21s"
    cluster.remove_pod("chat-a")
    d = await loop.tick(40.0)
    assert loop.replicas == 0 and d.reason == "scaled to zero: no demand"

    # A request arrives: the router holds it (no endpoint) and says so; 0 -> 1 at once, no window.
    router.hold(MODEL, 1)
    d = await loop.tick(45.0)
    assert loop.replicas == 1 and d.reason == "scale 0->1: 1 requests pending"
    assert loop.reasons() == ["ScaledDown", "ScaledUp"]
    assert loop.status["signals"]["pending"] == 1.0


async def test_the_routers_demand_is_read_for_this_model_only(servers, session):
    cluster = Cluster()
    spec = {"replicas": 0, "routingPolicyRef": "front", "autoscaling": autoscaling(minReplicas=0)}
    cluster.create_md("chat", spec)
    ctx = Loop(cluster, session).ctx
    assert await router_demand(ctx, NS, "chat", session) is None  # no router pod yet
    one, two = await servers(FakeRouter()), await servers(FakeRouter())
    cluster.add_pod("front-router-x", router_labels("front"), one.port)
    cluster.add_pod("front-router-y", router_labels("front"), two.port)
    one.hold("another-model", 5)
    one.queued_in_pods("another-model", 9)
    demand, _ = await router_demand(ctx, NS, "chat", session)
    assert demand == RouterDemand(awake=0, held=0, waiting=0)
    one.hold(MODEL, 1)
    two.hold(MODEL, 2)  # each router holds its own requests: they add up
    one.queued_in_pods(MODEL, 6)
    two.queued_in_pods(MODEL, 5)  # the same pods seen by both: the larger figure counts
    demand, policy = await router_demand(ctx, NS, "chat", session)
    assert demand == RouterDemand(awake=0, held=3, waiting=6)
    assert policy.max_replicas == 3
    # Awake: what the last decision saw (serving + starting); the count written when it has not decided yet.
    cluster.md("chat")["spec"]["replicas"] = 2
    cluster.md("chat")["status"] = {"autoscaling": {"awakeReplicas": 1, "startingReplicas": 1}}
    assert (await router_demand(ctx, NS, "chat", session))[0].awake == 2
    cluster.md("chat")["status"] = {}
    assert (await router_demand(ctx, NS, "chat", session))[0].awake == 2
    assert _demand_watched(cluster.md("chat")["spec"])
    assert not _demand_watched({**cluster.md("chat")["spec"], "routingPolicyRef": None})
    assert not _demand_watched({"replicas": 1, "routingPolicyRef": "front"})


async def test_unknown_pods_never_cause_a_scale_down(servers, session):
    cluster = Cluster()
    cluster.create_md(
        "chat",
        {"replicas": 3, "autoscaling": autoscaling(scaleDown={"stabilizationWindowSeconds": 0})},
    )
    labels = common_labels("chat")
    a, b = await servers(FakePod()), await servers(FakePod())
    cluster.add_pod("chat-a", labels, a.port)
    cluster.add_pod("chat-b", labels, b.port)
    # A crash-looping pod: not Ready, restarted: unknown, not "starting".
    cluster.add_pod(
        "chat-c",
        labels,
        a.port,
        ready=False,
        containerStatuses=[{"name": "runtime", "started": False, "restartCount": 4, "ready": False}],
    )
    loop = Loop(cluster, session)

    d = await loop.tick(0.0)  # idle, but one pod is unknown
    assert loop.replicas == 3 and "1 pods with unknown figures" in d.reason
    cluster.remove_pod("chat-c")
    d = await loop.tick(5.0)  # a pod the Deployment should have and nobody reported: unknown too
    assert loop.replicas == 3 and "1 pods with unknown figures" in d.reason
    c = await servers(FakePod())
    cluster.add_pod("chat-c", labels, c.port)

    for how, t in (("failing", 10.0), ("malformed", 20.0)):
        setattr(b, how, True)
        d = await loop.tick(t)
        assert loop.replicas == 3 and "1 pods with unknown figures" in d.reason, how
        setattr(b, how, False)

    await b.stop()  # connection refused
    d = await loop.tick(30.0)
    assert loop.replicas == 3 and d.signals["unknown"] == 1

    # Every pod answers again: now the idle fleet may shrink, one step at a time.
    await b.start()
    cluster.remove_pod("chat-b")
    cluster.add_pod("chat-b", labels, b.port)
    d = await loop.tick(40.0)
    assert loop.replicas == 2 and d.reason.startswith("scale down 3->2")
    assert loop.events == [("Normal", "ScaledDown", d.reason)]


async def test_status_is_rendered_and_a_restarted_operator_keeps_the_windows(servers, session):
    cluster = Cluster()
    cluster.create_md("chat", {"replicas": 1, "autoscaling": autoscaling()})
    a = await servers(FakePod())
    cluster.add_pod("chat-a", common_labels("chat"), a.port)
    loop = Loop(cluster, session)
    a.load(waiting=6, running=4, kv=0.5)
    d = await loop.tick(100.0)
    assert loop.replicas == 1 and "not stable" in d.reason

    status = loop.status
    assert status["desiredReplicas"] == 1 and status["recommendation"] == 3
    assert status["reason"] == d.reason
    assert status["signals"] == {
        "pending": 0.0,
        "ready": 1.0,
        "starting": 0.0,
        "unknown": 0.0,
        "waitingPerReplica": 6.0,
    }
    assert status["lastScaleTime"] is None
    assert from_rfc3339(status["lastDecisionTime"]) == 100.0
    assert [r["replicas"] for r in status["history"]["recommendations"]] == [1, 3]

    # The operator restarts (no memory at all): the window started at t=100 still holds at t=105 and is
    # over at t=111, exactly as without a restart.
    loop = Loop(cluster, session)
    d = await loop.tick(105.0)
    assert loop.replicas == 1 and "not stable" in d.reason
    d = await loop.tick(111.0)
    assert loop.replicas == 3 and d.reason.startswith("scale up 1->3")
    status = loop.status
    assert from_rfc3339(status["lastScaleTime"]) == 111.0 and status["lastScaleReason"] == d.reason
    assert from_rfc3339(status["history"]["lastScaleUpTime"]) == 111.0


async def test_a_manual_scale_is_undone_with_an_event(servers, session):
    cluster = Cluster()
    cluster.create_md("chat", {"replicas": 1, "autoscaling": autoscaling()})
    a = await servers(FakePod())
    cluster.add_pod("chat-a", common_labels("chat"), a.port)
    loop = Loop(cluster, session)
    await loop.tick(0.0)

    cluster.scale("ModelDeployment", NS, "chat", 3)  # kubectl scale md/chat --replicas=3
    d = await loop.tick(15.0)
    assert loop.replicas == 1 and d.replicas == 1
    type_, reason, message = loop.events[-1]
    assert (type_, reason) == ("Normal", "ManualScaleOverridden")
    assert message.startswith("replicas were set to 3 outside the autoscaler") and "now 1" in message
    d = await loop.tick(30.0)
    assert loop.replicas == 1 and len(loop.events) == 1

    # Autoscaling removed: replicas are the user's again, the old decision goes, the loop stops touching it.
    spec = cluster.md("chat")["spec"]
    del spec["autoscaling"]
    md = cluster.md("chat")
    assert autoscaling_changed(loop.ctx, NS, "chat", None, md["status"])
    assert "autoscaling" not in cluster.md("chat")["status"]
    cluster.scale("ModelDeployment", NS, "chat", 3)
    assert await loop.tick(45.0) is None and loop.replicas == 3


async def test_vllm_metric_names_are_read_the_same(servers, session):
    cluster = Cluster()
    cluster.create_md(
        "chat",
        {
            "replicas": 1,
            "metrics": {"naming": "vllm"},
            "autoscaling": autoscaling(targets={"kvCacheUsage": 0.5}),
        },
    )
    a = await servers(FakePod(naming="vllm"))
    assert b"vllm:kv_cache_usage_perc" in a.metrics.render()
    cluster.add_pod("chat-a", common_labels("chat"), a.port)
    loop = Loop(cluster, session)
    a.load(running=8, kv=0.9)
    d = await loop.tick(0.0)
    assert d.signals["kv_cache_usage"] == pytest.approx(0.9) and d.recommendation == 2


async def test_a_large_metrics_page_arriving_in_pieces_is_read_whole(servers, session):
    cluster = Cluster()
    cluster.create_md(
        "chat", {"replicas": 1, "autoscaling": autoscaling(scaleUp={"stabilizationWindowSeconds": 0})}
    )
    a = await servers(FakePod())
    a.padding = 300_000  # our series come last, after ~75 pieces
    cluster.add_pod("chat-a", common_labels("chat"), a.port)
    a.load(waiting=4, running=1)
    d = await Loop(cluster, session).tick(0.0)
    assert d.signals["waiting_per_replica"] == 4 and d.replicas == 2  # target 2 per replica


async def test_without_autoscaling_nothing_is_touched(session):
    cluster = Cluster()
    cluster.create_md("chat", {"replicas": 2})
    loop = Loop(cluster, session)
    assert await loop.tick(0.0) is None
    assert loop.replicas == 2 and "status" not in cluster.md("chat") and loop.events == []


# ------------------------------------------------------------------------------------------------- the pieces
def test_stored_history_decides_exactly_like_the_full_one():
    """Merging runs (and the RFC 3339 round trip) never changes a decision: replay a noisy load through the
    policy twice, once carrying its History as is, once through status and back every period."""
    spec = parse_model_deployment({"autoscaling": autoscaling(maxReplicas=8)}).autoscaling
    rng = random.Random(7)
    full, stored = History(), history_from_status(None)
    current_full = current_stored = 2
    t = 1_700_000_000.0
    for _ in range(300):
        t += rng.choice((3.0, 5.0, 7.5))
        waiting = rng.choice((0, 0, 1, 2, 3, 5, 9))
        samples = [PodSample(f"p{i}", PodState.READY, num_waiting=waiting) for i in range(current_full)]
        d_full = decide(current_full, samples, spec, full, t)
        d_stored = decide(current_stored, samples, spec, stored, t)
        assert (d_stored.replicas, d_stored.reason) == (d_full.replicas, d_full.reason)
        full, current_full = d_full.history, d_full.replicas
        stored = history_from_status({"history": history_to_status(d_stored.history)})
        current_stored = d_stored.replicas
    assert len(merge_runs(full.recommendations)) <= len(full.recommendations)


def test_scale_down_defaults_survive_the_crd():
    """The API server fills an omitted scaleDown from the schema's field defaults: they must be the
    policy's own (a 5-minute window, one replica at a time), not the scale-up ones."""
    crd = build_crd("ModelDeployment")
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    down = spec["properties"]["autoscaling"]["properties"]["scaleDown"]["properties"]
    defaults = {k: v["default"] for k, v in down.items()}
    parsed = parse_model_deployment({"autoscaling": autoscaling(scaleDown={})}).autoscaling.scale_down
    assert defaults == {"stabilizationWindowSeconds": 300.0, "maxStep": 1, "cooldownSeconds": 60.0}
    assert parsed.model_dump(by_alias=True) == defaults


@pytest.mark.parametrize(
    ("autoscaling_spec", "message"),
    [
        ({"minReplicas": 4, "maxReplicas": 3, "targets": {"kvCacheUsage": 0.8}}, "must be <= maxReplicas"),
        ({"maxReplicas": 3, "targets": {}}, "set at least one of"),
        ({"maxReplicas": 3000, "targets": {"kvCacheUsage": 0.8}}, "maxReplicas must be <= 1000"),
        ({"minReplicas": 0, "maxReplicas": 3, "targets": {"kvCacheUsage": 0.8}}, "needs routingPolicyRef"),
        (
            {"maxReplicas": 3, "targets": {"ttft": {"seconds": 1, "windowSeconds": 7200}}},
            "windowSeconds must be <= 3600",
        ),
        ({"maxReplicas": 3, "targets": {"kvCacheUsage": 0.8}, "scaleUp": {"cooldownSeconds": 9999}}, "3600"),
        ({"maxReplicas": 3, "targets": {"kvCacheUsage": 0.8}, "warmPoolSize": 2}, "need idle: sleep"),
        ({"maxReplicas": 3, "targets": {"kvCacheUsage": 0.8}, "idle": "nap"}, "idle"),
        (
            {"maxReplicas": 3, "targets": {"kvCacheUsage": 0.8}, "idle": "sleep", "sleepLevel": 3},
            "sleepLevel",
        ),
    ],
)
def test_invalid_autoscaling_is_rejected_with_a_clear_message(autoscaling_spec, message):
    with pytest.raises(ConfigError, match=message):
        parse_model_deployment({"autoscaling": autoscaling_spec})


def test_the_crd_carries_the_same_rules_as_cel():
    spec = build_crd("ModelDeployment")["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"][
        "spec"
    ]
    a = spec["properties"]["autoscaling"]
    rules = [r["rule"] for r in a["x-kubernetes-validations"]]
    assert "!has(self.minReplicas) || self.minReplicas <= self.maxReplicas" in rules
    assert any("has(self.ttft)" in r["rule"] for r in a["properties"]["targets"]["x-kubernetes-validations"])
    assert any("routingPolicyRef" in r["rule"] for r in spec["x-kubernetes-validations"])
    assert a["required"] == ["maxReplicas", "targets"]
    # The API server validates defaults against the rules: an empty default `targets` would fail "set at
    # least one" and the whole CRD would be rejected. A required field has no default.
    assert "default" not in a["properties"]["targets"]
    # Status is never defaulted: a cleared status.autoscaling must stay cleared.
    status = build_crd("ModelDeployment")["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"][
        "status"
    ]
    assert "default" not in json.dumps(status)


def test_a_removed_pod_stops_taking_requests_before_sigterm_and_drains():
    spec = parse_model_deployment({})
    config = build_runtime_config(spec, None)
    pod = build_deployment("chat", spec, config)["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["lifecycle"]["preStop"] == {"sleep": {"seconds": PRE_STOP_SECONDS}}
    # The grace period runs from deletion: it must cover the preStop sleep and then the whole drain.
    assert pod["terminationGracePeriodSeconds"] > PRE_STOP_SECONDS + math.ceil(config.server.drain_seconds)


# ------------------------------------------------------------------------------------- disaggregated, per role
def role_labels(role: str) -> dict[str, str]:
    return common_labels(f"chat-{role}") | {"serving.tokenfleet.dev/role": role}


def disaggregated(prefill: dict | None, decode: dict | None, **extra: Any) -> dict[str, Any]:
    roles: dict[str, Any] = {"prefill": {"replicas": 1}, "decode": {"replicas": 1}}
    if prefill is not None:
        roles["prefill"]["autoscaling"] = prefill
    if decode is not None:
        roles["decode"]["autoscaling"] = decode
    return {"disaggregation": roles, **extra}


class RoleLoop(Loop):
    async def tick(self, now: float):  # type: ignore[override]
        return await autoscale_roles(self.ctx, NS, self.name, self.book, self.session, now, LOG)

    def role_replicas(self, role: str) -> int:
        return self.cluster.md(self.name)["spec"]["disaggregation"][role]["replicas"]

    def role_status(self, role: str) -> dict[str, Any]:
        return self.cluster.md(self.name)["status"]["roles"][role]["autoscaling"]


async def _two_role_deployment(servers) -> tuple[Cluster, FakePod, FakePod]:
    """MD `chat`, disaggregated: prefill sized by its queue, decode by KV usage, both free to scale up at
    once (1..4); one pod per role. Returns the cluster and the prefill and decode pods."""
    cluster = Cluster()
    now_up = {"stabilizationWindowSeconds": 0, "maxStep": 4, "cooldownSeconds": 0}
    cluster.create_md(
        "chat",
        disaggregated(
            autoscaling(targets={"waitingRequestsPerReplica": 2}, scaleUp=now_up, maxReplicas=4),
            autoscaling(targets={"kvCacheUsage": 0.5}, scaleUp=now_up, maxReplicas=4),
        ),
    )
    p, d = await servers(FakePod()), await servers(FakePod())
    cluster.add_pod("chat-prefill-a", role_labels("prefill"), p.port)
    cluster.add_pod("chat-decode-a", role_labels("decode"), d.port)
    return cluster, p, d


async def test_each_role_is_sized_from_its_own_pods_only(servers, session):
    cluster, p, d = await _two_role_deployment(servers)
    loop = RoleLoop(cluster, session)

    # A long-prompt burst queues on the prefill pod; the decode pod's KV is light: only prefill grows.
    # The decode pod's own queue (requests waiting for KV) is no prefill signal.
    p.load(waiting=6, running=1, kv=0.1)
    d.load(waiting=9, running=4, kv=0.3)
    decisions = await loop.tick(0.0)
    assert decisions["prefill"].replicas == 3 and decisions["decode"].replicas == 1
    assert (loop.role_replicas("prefill"), loop.role_replicas("decode")) == (3, 1)
    assert loop.role_status("prefill")["desiredReplicas"] == 3
    assert loop.role_status("prefill")["signals"]["waitingPerReplica"] == 6
    assert loop.role_status("decode")["signals"]["kvCacheUsage"] == pytest.approx(0.3)
    assert loop.events == [("Normal", "ScaledUp", "prefill: " + decisions["prefill"].reason)]
    assert "autoscaling" not in (cluster.md("chat").get("status") or {})  # the fleet-wide field stays unset

    # Long generations fill the decode pod's KV: now decode grows; prefill (idle queue, its new pods not
    # created yet) keeps its 3.
    p.load()
    d.load(running=20, kv=0.9)
    decisions = await loop.tick(10.0)
    assert decisions["decode"].replicas == 2 and loop.role_replicas("decode") == 2
    assert loop.role_replicas("prefill") == 3 and decisions["prefill"].replicas == 3
    assert [r for r in loop.reasons()] == ["ScaledUp", "ScaledUp"]

    # The aggregated entry point leaves a disaggregated deployment alone.
    assert await Loop(cluster, session).tick(20.0) is None


async def test_router_demand_counts_for_decode_and_a_manual_role_scale_is_undone(servers, session):
    cluster = Cluster()
    now_up = {"stabilizationWindowSeconds": 0, "maxStep": 4, "cooldownSeconds": 0}
    cluster.create_md(
        "chat",
        disaggregated(
            autoscaling(targets={"waitingRequestsPerReplica": 2}, scaleUp=now_up),
            autoscaling(targets={"waitingRequestsPerReplica": 2}, scaleUp=now_up),
            routingPolicyRef="front",
        ),
    )
    p, d, router = await servers(FakePod()), await servers(FakePod()), await servers(FakeRouter())
    cluster.add_pod("chat-prefill-a", role_labels("prefill"), p.port)
    cluster.add_pod("chat-decode-a", role_labels("decode"), d.port)
    cluster.add_pod("front-router-x", router_labels("front"), router.port)
    loop = RoleLoop(cluster, session)

    router.hold(MODEL, 5)  # every endpoint at its in-flight limit: the router holds 5
    decisions = await loop.tick(0.0)
    assert decisions["decode"].replicas == 3 and decisions["prefill"].replicas == 1
    assert loop.role_status("decode")["signals"]["pending"] == 5
    assert loop.role_status("prefill")["signals"]["pending"] == 0

    router.hold(MODEL, 0)
    cluster.md("chat")["spec"]["disaggregation"]["prefill"]["replicas"] = 4  # a manual edit
    await loop.tick(15.0)
    assert loop.role_replicas("prefill") == 1
    _, reason, message = loop.events[-1]
    assert reason == "ManualScaleOverridden"
    assert message.startswith("disaggregation.prefill.replicas were set to 4 outside the autoscaler")

    # The prefill role's autoscaling is removed: its decision goes, decode's stays, and the loop lets the
    # prefill count be the user's again.
    del cluster.md("chat")["spec"]["disaggregation"]["prefill"]["autoscaling"]
    md = cluster.md("chat")
    assert autoscaling_changed(loop.ctx, NS, "chat", None, md["status"], role="prefill")
    assert "autoscaling" not in cluster.md("chat")["status"]["roles"]["prefill"]
    assert "autoscaling" in cluster.md("chat")["status"]["roles"]["decode"]
    cluster.md("chat")["spec"]["disaggregation"]["prefill"]["replicas"] = 2
    decisions = await loop.tick(30.0)
    assert set(decisions) == {"decode"} and loop.role_replicas("prefill") == 2


@pytest.mark.parametrize(
    ("decode_autoscaling", "load"),
    [
        (
            autoscaling(
                targets={"kvCacheUsage": 0.5}, scaleUp={"stabilizationWindowSeconds": 0, "maxStep": 4}
            ),
            0.95,
        ),
        (autoscaling(minReplicas=1, maxReplicas=1, targets={"kvCacheUsage": 0.5}), 0.1),
    ],
    ids=["a-new-count", "the-same-count"],
)
async def test_a_late_role_decision_writes_nothing_on_a_spec_switched_to_aggregated(
    servers, session, decode_autoscaling, load
):
    cluster = Cluster()
    cluster.create_md("chat", disaggregated(None, decode_autoscaling))
    d = await servers(FakePod())
    cluster.add_pod("chat-decode-a", role_labels("decode"), d.port)
    d.load(running=9, kv=load)
    loop = RoleLoop(cluster, session)
    read = cluster.get  # the autoscaler reads the spec, then the user switches to aggregated serving

    def get_then_switch(kind: str, namespace: str, name: str):
        body = read(kind, namespace, name)
        cluster.md("chat")["spec"].pop("disaggregation")
        return body

    cluster.get = get_then_switch  # type: ignore[method-assign]
    # The conditional patch is refused: no `disaggregation` comes back, and no status records a decision
    # that was never applied (the switch's handlers have cleared the roles' status by now).
    assert await loop.tick(0.0) == {}
    md = cluster.md("chat")
    assert "disaggregation" not in md["spec"]
    assert "roles" not in (md.get("status") or {}) and cluster.writes == []
    assert loop.events == []


async def test_one_roles_failure_leaves_the_other_roles_decision_standing(servers, session, caplog):
    cluster, p, d = await _two_role_deployment(servers)
    p.load(waiting=6, running=1)
    d.load(running=20, kv=0.9)
    loop = RoleLoop(cluster, session)

    # Listing the prefill pods fails: prefill gets no decision this period; decode still scales, its count
    # written before the status that records it.
    cluster.failing.add(selector_string("chat-prefill"))
    with caplog.at_level(logging.WARNING, logger=LOG.name):
        decisions = await loop.tick(0.0)
    assert set(decisions) == {"decode"} and loop.role_replicas("decode") == 2
    assert loop.role_replicas("prefill") == 1 and "prefill" not in cluster.md("chat")["status"]["roles"]
    assert cluster.writes == ["patch", "patch_status"]
    assert any("prefill: no decision this period" in r.getMessage() for r in caplog.records)

    cluster.failing.clear()
    decisions = await loop.tick(10.0)
    assert decisions["prefill"].replicas == 3 and loop.role_replicas("prefill") == 3


async def test_the_count_is_written_before_the_status_that_records_it(servers, session):
    cluster = Cluster()
    now_up = {"stabilizationWindowSeconds": 0, "maxStep": 4, "cooldownSeconds": 0}
    cluster.create_md("chat", {"replicas": 1, "autoscaling": autoscaling(scaleUp=now_up)})
    a = await servers(FakePod())
    cluster.add_pod("chat-a", common_labels("chat"), a.port)
    a.load(waiting=6, running=1)
    loop = Loop(cluster, session)

    cluster.failing.add("scale")  # the API server fails the write of the new count
    assert await loop.tick(0.0) is None
    assert loop.replicas == 1 and "status" not in cluster.md("chat") and loop.events == []

    cluster.failing.clear()
    d = await loop.tick(15.0)
    assert loop.replicas == 3 and loop.status["desiredReplicas"] == 3 == d.replicas
    assert cluster.writes == ["scale", "patch_status"]
    assert loop.reasons() == ["ScaledUp"]


def test_scale_targets_name_each_roles_pods():
    spec = parse_model_deployment(
        disaggregated(None, autoscaling(targets={"kvCacheUsage": 0.8}), routingPolicyRef="front")
    )
    [target] = scale_targets("chat", spec, {})
    assert target.role == "decode" and target.routers and target.replicas == 1
    assert target.selector == "app.kubernetes.io/instance=chat-decode,app.kubernetes.io/component=runtime"
    assert scale_targets("chat", parse_model_deployment({"replicas": 2}), {}) == []


# ----------------------------------------------------------------------------------- which pods a scale-down removes
COST = "controller.kubernetes.io/pod-deletion-cost"


def _cost(cluster: Cluster, pod: str) -> str | None:
    return (cluster.objects[("Pod", pod)]["metadata"].get("annotations") or {}).get(COST)


async def test_before_a_scale_down_each_ready_pod_is_marked_with_its_requests_in_flight(servers, session):
    cluster = Cluster()
    now_down = {"stabilizationWindowSeconds": 0, "maxStep": 2, "cooldownSeconds": 0}
    cluster.create_md(
        "chat", {"replicas": 3, "autoscaling": autoscaling(scaleDown=now_down, scaleUp=now_down)}
    )
    labels = common_labels("chat")
    busy, idle, mid = [await servers(FakePod()) for _ in range(3)]
    for name, pod in (("chat-a", busy), ("chat-b", idle), ("chat-c", mid)):
        cluster.add_pod(name, labels, pod.port)
    cluster.add_pod("chat-d", labels, None)  # starting: no figures, no cost (not-ready pods go first anyway)
    loop = Loop(cluster, session)

    # Light load on three pods against 2 waiting per replica: 3 -> 2. One pod has 5 streams running, one
    # none, one 1 running and 1 queued.
    busy.load(running=5, kv=0.4)
    mid.load(running=1, waiting=1)
    d = await loop.tick(0.0)
    assert d.replicas < 3 and loop.replicas == d.replicas
    assert [_cost(cluster, p) for p in ("chat-a", "chat-b", "chat-c", "chat-d")] == ["5", "0", "2", None]
    # The costs are in place before the count drops (the ReplicaSet reads them when it picks).
    assert cluster.writes.index("scale") > max(
        i for i, w in enumerate(cluster.writes) if w.startswith("annotate")
    )

    # A decision that does not lower the count (here back up to a raised minimum) writes no cost.
    cluster.writes.clear()
    cluster.md("chat")["spec"]["autoscaling"]["minReplicas"] = 2
    busy.load(running=7)
    d = await loop.tick(1.0)
    assert loop.replicas == 2 and cluster.writes[0] == "scale"
    assert not any(w.startswith("annotate") for w in cluster.writes) and _cost(cluster, "chat-a") == "5"


async def test_a_pod_that_cannot_be_marked_does_not_stop_the_scale_down(servers, session):
    cluster = Cluster()
    now_down = {"stabilizationWindowSeconds": 0, "maxStep": 1, "cooldownSeconds": 0}
    cluster.create_md("chat", {"replicas": 2, "autoscaling": autoscaling(scaleDown=now_down)})
    a, b = await servers(FakePod()), await servers(FakePod())
    cluster.add_pod("chat-a", common_labels("chat"), a.port)
    cluster.add_pod("chat-b", common_labels("chat"), b.port)
    cluster.failing.add("annotate chat-a")  # e.g. the pod was deleted between the list and the patch
    b.load(running=3)
    d = await Loop(cluster, session).tick(0.0)
    assert d.replicas == 1 and cluster.md("chat")["spec"]["replicas"] == 1
    assert (_cost(cluster, "chat-a"), _cost(cluster, "chat-b")) == (None, "3")


async def test_a_role_scale_down_marks_that_roles_pods_only(servers, session):
    cluster, p, d = await _two_role_deployment(servers)
    cluster.md("chat")["spec"]["disaggregation"]["decode"]["replicas"] = 2
    now_down = {"stabilizationWindowSeconds": 0, "maxStep": 1, "cooldownSeconds": 0}
    cluster.md("chat")["spec"]["disaggregation"]["decode"]["autoscaling"]["scaleDown"] = now_down
    d2 = await servers(FakePod())
    cluster.add_pod("chat-decode-b", role_labels("decode"), d2.port)
    d.load(running=4, kv=0.2)
    p.load(waiting=2, running=1)
    decisions = await RoleLoop(cluster, session).tick(0.0)
    assert decisions["decode"].replicas == 1
    assert (_cost(cluster, "chat-decode-a"), _cost(cluster, "chat-decode-b")) == ("4", "0")
    assert _cost(cluster, "chat-prefill-a") is None  # its role did not shrink


# ---------------------------------------------------------------------------------------------- the warm tier
class SleepyPod(FakePod):
    """A pod in sleep mode: /sleep and /wake_up change what its /metrics says, and each call is recorded
    with the credential it came with (only the deployment's internal key opens them on a real pod)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, str | None]] = []
        self.wake_fails = False

    async def _sleep(self, request: web.Request) -> web.Response:
        self.calls.append((request.path_qs, request.headers.get("Authorization")))
        self.metrics.set_sleep_state(int(request.query["level"]))
        return web.json_response({"is_sleeping": True})

    async def _wake(self, request: web.Request) -> web.Response:
        self.calls.append((request.path_qs, request.headers.get("Authorization")))
        if self.wake_fails:  # as the server answers when the weights cannot come back onto the device
            return web.json_response({"error": {"message": "wake failed: out of memory"}}, status=500)
        self.metrics.set_sleep_state(0)
        return web.json_response({"is_sleeping": False})

    async def start(self) -> SleepyPod:
        await super().start()
        return self

    def routes(self, app: web.Application) -> None:
        app.router.add_post("/sleep", self._sleep)
        app.router.add_post("/wake_up", self._wake)


def _sleeping(cluster: Cluster, pod: str, asleep: bool) -> None:
    """What the kubelet reports of a pod whose /ready turned 503 (asleep) or 200 again: started either way."""
    status = cluster.objects[("Pod", pod)]["status"]
    status["conditions"] = [{"type": "Ready", "status": "False" if asleep else "True"}]
    status["containerStatuses"][0] |= {"started": True, "ready": not asleep}


async def test_idle_sleep_puts_surplus_pods_to_sleep_keeps_the_pool_and_wakes_one_on_demand(servers, session):
    cluster = Cluster()
    spec = autoscaling(minReplicas=0, scaleToZeroAfterSeconds=40, idle="sleep")
    cluster.create_md("chat", {"replicas": 2, "routingPolicyRef": "front", "autoscaling": spec})
    key = "internal-secret"
    cluster.objects[("Secret", "chat-internal-key")] = {
        "data": {"key": base64.b64encode(key.encode()).decode()}
    }
    labels = common_labels("chat")
    a, b = await servers(SleepyPod()), await servers(SleepyPod())
    cluster.add_pod("chat-a", labels, a.port)
    cluster.add_pod("chat-b", labels, b.port)
    router = await servers(FakeRouter())
    cluster.add_pod("front-router-x", router_labels("front"), router.port)
    loop = Loop(cluster, session)

    a.load(running=1)
    await loop.tick(0.0)
    a.load()
    # Idle past the 30 s scale-down window: one pod is no longer needed. It sleeps (the pool has room)
    # rather than leaving; the count stays, so nothing is removed.
    d = await loop.tick(31.0)
    assert d.replicas == 1 and loop.replicas == 2 and loop.status["scaledReplicas"] == 2
    assert a.calls == [("/sleep?level=1&timeout=5", f"Bearer {key}")] and b.calls == []
    assert loop.reasons()[-2:] == ["ScaledDown", "PodsAsleep"]
    _sleeping(cluster, "chat-a", True)
    d = await loop.tick(35.0)
    assert (loop.status["awakeReplicas"], loop.status["sleepingReplicas"]) == (1, 1)
    assert d.replicas == 1 and loop.replicas == 2 and len(a.calls) == 1  # a sleeping pod is not asked again

    # No traffic for 40 s: zero awake. The pool (1) is full, so the count drops; the ReplicaSet removes the
    # not-Ready pod first (the sleeper); the next decision puts the last awake pod to sleep.
    d = await loop.tick(45.0)
    assert d.replicas == 0 and loop.replicas == 1 and b.calls == []
    cluster.remove_pod("chat-a")
    d = await loop.tick(50.0)
    assert loop.replicas == 1 and [c for c, _ in b.calls] == ["/sleep?level=1&timeout=5"]
    _sleeping(cluster, "chat-b", True)
    d = await loop.tick(60.0)
    assert (d.replicas, loop.replicas, loop.status["sleepingReplicas"]) == (0, 1, 1)
    assert d.reason == "scaled to zero: no demand"

    # Demand: the router holds a request. The sleeping pod is woken; no new pod is created.
    router.hold(MODEL, 1)
    d = await loop.tick(65.0)
    assert d.replicas == 1 and loop.replicas == 1
    assert [c for c, _ in b.calls][-1] == "/wake_up" and b.calls[-1][1] == f"Bearer {key}"
    assert loop.reasons()[-1] == "PodsWoken"


async def test_a_pod_the_router_woke_counts_as_awake_and_is_not_put_back_to_sleep_while_busy(
    servers, session
):
    cluster = Cluster()
    spec = autoscaling(minReplicas=0, scaleToZeroAfterSeconds=40, idle="sleep")
    cluster.create_md("chat", {"replicas": 1, "routingPolicyRef": "front", "autoscaling": spec})
    cluster.objects[("Secret", "chat-internal-key")] = {"data": {"key": base64.b64encode(b"k").decode()}}
    a = await servers(SleepyPod())
    cluster.add_pod("chat-a", common_labels("chat"), a.port)
    a.metrics.set_sleep_state(1)
    _sleeping(cluster, "chat-a", True)
    loop = Loop(cluster, session)
    d = await loop.tick(0.0)
    assert (d.replicas, loop.replicas, a.calls) == (0, 1, [])

    # The router woke it for a request (its own call): it is awake and busy, and stays awake.
    a.metrics.set_sleep_state(0)
    _sleeping(cluster, "chat-a", False)
    a.load(running=1)
    for t in (5.0, 30.0, 44.0):
        d = await loop.tick(t)
        assert (d.replicas, loop.replicas, a.calls) == (1, 1, [])
    a.load()
    d = await loop.tick(90.0)  # idle for 46 s now
    assert d.replicas == 0 and [c for c, _ in a.calls] == ["/sleep?level=1&timeout=5"]


async def test_a_pod_that_cannot_wake_is_deleted_for_its_replicaset_to_replace(servers, session):
    cluster = Cluster()
    spec = autoscaling(minReplicas=0, idle="sleep")
    cluster.create_md("chat", {"replicas": 2, "routingPolicyRef": "front", "autoscaling": spec})
    cluster.objects[("Secret", "chat-internal-key")] = {"data": {"key": base64.b64encode(b"k").decode()}}
    a, b = await servers(SleepyPod()), await servers(SleepyPod())
    cluster.add_pod("chat-a", common_labels("chat"), a.port)
    cluster.add_pod("chat-b", common_labels("chat"), b.port)
    for pod, name in ((a, "chat-a"), (b, "chat-b")):
        pod.metrics.set_sleep_state(1)
        _sleeping(cluster, name, True)
    a.wake_fails = True
    router = await servers(FakeRouter())
    cluster.add_pod("front-router-x", router_labels("front"), router.port)
    router.hold(MODEL, 1)
    loop = Loop(cluster, session)
    d = await loop.tick(0.0)
    assert d.replicas == 1 and [c for c, _ in a.calls] == ["/wake_up"]
    # A 500 from the wake: the pod is deleted (its ReplicaSet makes a new one); the count is not touched.
    assert ("Pod", "chat-a") not in cluster.objects and "delete chat-a" in cluster.writes
    assert loop.events[-1][:2] == ("Warning", "WakeFailed") and "out of memory" in loop.events[-1][2]
    assert loop.replicas == 2 and b.calls == []


async def test_with_idle_zero_nothing_is_put_to_sleep(servers, session):
    cluster = Cluster()
    cluster.create_md("chat", {"replicas": 2, "autoscaling": autoscaling()})
    a, b = await servers(SleepyPod()), await servers(SleepyPod())
    cluster.add_pod("chat-a", common_labels("chat"), a.port)
    cluster.add_pod("chat-b", common_labels("chat"), b.port)
    loop = Loop(cluster, session)
    await loop.tick(0.0)
    d = await loop.tick(31.0)
    assert d.replicas == 1 and loop.replicas == 1 and a.calls == b.calls == []
