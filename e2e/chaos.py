"""Chaos under sustained load: what a user loses on a bad day.

A steady mixed load — streamed and whole, chat and completions, structured outputs, long prompts, and a
tenth of the streams dropped by their client after a few tokens — goes through two active-active routers
to a disaggregated ModelDeployment whose decode role is autoscaled, while a schedule injects faults one at
a time: a runtime pod or a router SIGKILLed, the operator killed and restarted, the API server restarted, a
node lost (its kubelet and pods stopped; NotReady, evicted, rescheduled, then back), a rolling update, an
autoscaler scale-down, a RoutingPolicy and a CachePolicy edit.

The clients (chaos_load.py) retry like the OpenAI SDK, before the first byte only, on whichever router the
router Service lists as ready then (what kube-proxy would pick). Each request ends as `ok`, `disconnected`
(the client's own choice) or an error of a kind, with the reason. Only one kind is
unresumable by design: `router_died`, a request whose router process was killed under it — a stream's
resume state lives in its router, and the client holds no token to continue it elsewhere. Every other
error is a defect.

`ChaosRun.report()` gives the table: requests sent / completed / disconnected / errors by kind / retried
before the first byte / resumed by the routers (their `router_resumes_total`), leaked KV blocks on every
surviving pod once the load stops, and per fault the seconds until the fleet was back to steady state
(every Deployment rolled out and Ready, no pod terminating, every router on the policy's generation, and a
request sent after the fault served).

`e2e/test_chaos.py` runs a short schedule in CI; `bench/chaos.py` the long one.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from chaos_load import Api, ChaosLoad, Record, RouterDirectory, metric, ready, scrape
from envtest import ControlPlane
from operator_process import OperatorProcess
from pod_network import PodNetwork

RP, CP, MD = "front", "chat-cache", "chat"
ROUTER_SERVICE = f"{RP}-router"
RUNTIME = f"app.kubernetes.io/component=runtime,serving.tokenfleet.dev/model-deployment={MD}"
ROUTER = f"app.kubernetes.io/instance={RP},app.kubernetes.io/component=router"
# The unresumable kinds, each with why. Anything else a client sees is a defect.
UNRESUMABLE = {
    "router_died": "its router was killed under it: a stream's resume state lives in the router that "
    "relays it, and the client holds no token to continue elsewhere",
}
# What `ChaosRun.inject` can do, each a method of the same name.
FAULTS = (
    "kill_prefill_pod",
    "kill_decode_pod",
    "kill_router",
    "restart_operator",
    "restart_apiserver",
    "edit_routing_policy",
    "edit_cache_policy",
    "rolling_update",
    "scale_down",
    "lose_node",
)


def fleet_manifest(decode_replicas: int = 2) -> list[dict[str, Any]]:
    """The fleet under test: two routers, a CachePolicy, one prefill pod and an autoscaled decode role."""
    group = "serving.tokenfleet.dev/v1alpha1"
    return [
        {
            "apiVersion": group,
            "kind": "RoutingPolicy",
            "metadata": {"name": RP},
            "spec": {"strategy": "prefix-affinity", "router": {"replicas": 2}, "queueTimeoutSeconds": 120},
        },
        {
            "apiVersion": group,
            "kind": "CachePolicy",
            "metadata": {"name": CP},
            "spec": {"cpuKVCacheGiB": 0.125, "prefixCaching": {"eviction": "lru"}},
        },
        {
            "apiVersion": group,
            "kind": "ModelDeployment",
            "metadata": {"name": MD},
            "spec": {
                "model": {"servedName": MD},
                "routingPolicyRef": RP,
                "cachePolicyRef": CP,
                # Every pod of the fleet fits on one node, so a lost node's pods can move to the other.
                "resources": {"cpu": "1", "memory": "3Gi"},
                "engine": {"maxNumSeqs": 8, "maxNumBatchedTokens": 1024},
                "disaggregation": {
                    "prefill": {"replicas": 1},
                    "decode": {
                        "autoscaling": {
                            "targets": {"waitingRequestsPerReplica": 4},
                            "minReplicas": decode_replicas,
                            "maxReplicas": decode_replicas,
                            "scaleDown": {
                                "stabilizationWindowSeconds": 5,
                                "maxStep": 1,
                                "cooldownSeconds": 0,
                            },
                        }
                    },
                },
            },
        },
    ]


# ------------------------------------------------------------------------------------------------- faults
@dataclass
class FaultResult:
    name: str
    at: float  # seconds into the run
    detail: str
    steady_s: float | None  # None: not steady within the budget


class ChaosRun:
    """The fleet in `namespace`, its load, and the faults injected so far."""

    def __init__(
        self,
        plane: ControlPlane,
        network: PodNetwork,
        operator: OperatorProcess,
        namespace: str,
        workers: int = 4,
        seed: int = 0,
    ):
        self.plane, self.network, self.operator, self.ns = plane, network, operator, namespace
        self.api = Api(plane)
        self.routers = RouterDirectory(self.api, namespace, ROUTER_SERVICE)
        self.load = ChaosLoad(self.routers, MD, workers=workers, seed=seed)
        self.rng = random.Random(seed)
        self.faults: list[FaultResult] = []
        self.router_deaths: list[tuple[str, float]] = []  # (router pod IP, when)
        self.started = time.monotonic()
        self.leaked: dict[str, int] = {}

    # ------------------------------------------------------------------------------------------------ setup
    def deploy(self, timeout: float = 420) -> None:
        import yaml

        self.plane.kubectl("apply", "-n", self.ns, "-f", "-", stdin=yaml.safe_dump_all(fleet_manifest()))
        deadline = time.monotonic() + timeout
        while not (self._converged() and len([p for p in self._pods(ROUTER) if ready(p)]) == 2):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the fleet was not Ready after {timeout}s: {self._state()}")
            time.sleep(1)
        self.routers.start()
        self.started = time.monotonic()
        self.load.start()

    # ------------------------------------------------------------------------------------------------ state
    def _pods(self, selector: str) -> list[dict[str, Any]]:
        return self.api.items(f"/api/v1/namespaces/{self.ns}/pods?labelSelector={selector}")

    def _state(self) -> dict[str, Any]:
        try:
            deps = self.api.items(f"/apis/apps/v1/namespaces/{self.ns}/deployments")
        except OSError as e:
            return {"api": repr(e)}
        return {
            d["metadata"]["name"]: {
                k: (d.get("status") or {}).get(k) for k in ("replicas", "readyReplicas", "updatedReplicas")
            }
            | {"spec": d["spec"]["replicas"]}
            for d in deps
        }

    def _converged(self) -> bool:
        """Every Deployment rolled out and Ready, no pod terminating, every router on the policy's generation."""
        try:
            deps = self.api.items(f"/apis/apps/v1/namespaces/{self.ns}/deployments")
            pods = self.api.items(f"/api/v1/namespaces/{self.ns}/pods")
            rp = self.api.get(
                f"/apis/serving.tokenfleet.dev/v1alpha1/namespaces/{self.ns}/routingpolicies/{RP}"
            )
        except (OSError, ValueError):
            return False
        if len(deps) < 3:
            return False
        for d in deps:
            st, want = d.get("status") or {}, d["spec"]["replicas"]
            if d["metadata"].get("generation") != st.get("observedGeneration"):
                return False
            if not (
                st.get("replicas", 0) == st.get("readyReplicas", 0) == st.get("updatedReplicas", 0) == want
            ):
                return False
        if any(p["metadata"].get("deletionTimestamp") for p in pods):
            return False
        gen = rp["metadata"]["generation"]
        routers = (rp.get("status") or {}).get("routers") or []
        return len(routers) == 2 and all(r.get("generation") == gen for r in routers)

    def _wait_steady(self, injected: float, settled: Callable[[], bool], budget: float) -> float | None:
        deadline = injected + budget
        while time.monotonic() < deadline:
            if settled() and self._converged() and self.load.served_since(injected):
                return time.monotonic() - injected
            time.sleep(1)
        return None

    # ----------------------------------------------------------------------------------------------- faults
    def _kill_pod_processes(self, pod: dict[str, Any]) -> int:
        """SIGKILL every process in the pod's network namespace (its containers), as an OOM kill would."""
        index = int(pod["status"]["podIP"].rsplit(".", 1)[1])
        out = subprocess.run(
            ["ip", "netns", "pids", self.network.netns(index)], capture_output=True, text=True, check=True
        ).stdout
        pids = [int(p) for p in out.split()]
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return len(pids)

    def _restarts(self, name: str) -> int:
        try:
            pod = self.api.get(f"/api/v1/namespaces/{self.ns}/pods/{name}")
        except (OSError, ValueError):
            return -1
        return sum(c.get("restartCount", 0) for c in (pod.get("status") or {}).get("containerStatuses") or [])

    def _pod_gone_or_restarted(self, name: str, before: int) -> Callable[[], bool]:
        def check() -> bool:
            try:
                self.api.get(f"/api/v1/namespaces/{self.ns}/pods/{name}")
            except urllib.error.HTTPError as e:
                return e.code == 404
            except (OSError, ValueError):
                return False
            return self._restarts(name) > before

        return check

    def kill_runtime_pod(self, role: str) -> tuple[str, Callable[[], bool]]:
        pods = [p for p in self._pods(f"{RUNTIME},serving.tokenfleet.dev/role={role}") if ready(p)]
        # The busiest one: the pod serving the most is the one whose loss a user would notice.
        pod = max(pods, key=lambda p: self._running(p))
        name = pod["metadata"]["name"]
        before = self._restarts(name)
        n = self._kill_pod_processes(pod)
        return f"{name} ({n} processes)", self._pod_gone_or_restarted(name, before)

    def kill_prefill_pod(self) -> tuple[str, Callable[[], bool]]:
        return self.kill_runtime_pod("prefill")

    def kill_decode_pod(self) -> tuple[str, Callable[[], bool]]:
        return self.kill_runtime_pod("decode")

    def _running(self, pod: dict[str, Any]) -> float:
        try:
            return metric(scrape(f"http://{pod['status']['podIP']}:8000"), "tokenfleet:num_requests_running")
        except OSError:
            return 0.0

    def routers_share_one_quota(self) -> bool:
        """Each ready router reads the other's rate-limit usage (and only the other: it skips itself)."""
        ids = {}
        for pod in [p for p in self._pods(ROUTER) if ready(p)]:
            try:
                url = f"http://{pod['status']['podIP']}:8080/v1/config"
                with urllib.request.urlopen(url, timeout=5) as resp:
                    quota = json.loads(resp.read())["quota_peers"]
            except (OSError, ValueError, KeyError):
                return False
            ids[quota["router"]] = set(quota["peers"].values())
        return len(ids) == 2 and all(peers == set(ids) - {me} for me, peers in ids.items())

    def kill_router(self) -> tuple[str, Callable[[], bool]]:
        pod = self.rng.choice([p for p in self._pods(ROUTER) if ready(p)])
        name, ip = pod["metadata"]["name"], pod["status"]["podIP"]
        before = self._restarts(name)
        self.router_deaths.append((ip, time.monotonic()))
        n = self._kill_pod_processes(pod)
        return f"{name} ({n} processes)", self._pod_gone_or_restarted(name, before)

    def restart_operator(self) -> tuple[str, Callable[[], bool]]:
        self.operator.kill()
        time.sleep(2)
        self.operator.start()
        return "SIGKILL, restarted after 2 s", self.operator.alive

    def restart_apiserver(self) -> tuple[str, Callable[[], bool]]:
        down = self.plane.restart_apiserver()
        return f"ready again after {down:.1f} s", lambda: True

    def _patch(self, kind: str, name: str, patch: dict[str, Any]) -> None:
        self.plane.kubectl("patch", kind, name, "-n", self.ns, "--type=merge", "-p", json.dumps(patch))

    def edit_routing_policy(self) -> tuple[str, Callable[[], bool]]:
        rp = self.api.get(f"/apis/serving.tokenfleet.dev/v1alpha1/namespaces/{self.ns}/routingpolicies/{RP}")
        strategy = "least-load" if rp["spec"]["strategy"] == "prefix-affinity" else "prefix-affinity"
        self._patch("rp", RP, {"spec": {"strategy": strategy}})
        return f"strategy -> {strategy}", lambda: True

    def edit_cache_policy(self) -> tuple[str, Callable[[], bool]]:
        cp = self.api.get(f"/apis/serving.tokenfleet.dev/v1alpha1/namespaces/{self.ns}/cachepolicies/{CP}")
        eviction = "s3fifo" if cp["spec"]["prefixCaching"]["eviction"] == "lru" else "lru"
        self._patch("cp", CP, {"spec": {"prefixCaching": {"eviction": eviction}}})
        return f"eviction -> {eviction}", lambda: True

    def rolling_update(self) -> tuple[str, Callable[[], bool]]:
        md = self.api.get(f"/apis/serving.tokenfleet.dev/v1alpha1/namespaces/{self.ns}/modeldeployments/{MD}")
        tokens = 1280 if md["spec"]["engine"]["maxNumBatchedTokens"] == 1024 else 1024
        self._patch("md", MD, {"spec": {"engine": {"maxNumBatchedTokens": tokens}}})
        before = (md.get("status") or {}).get("configHash")

        def rolled() -> bool:
            st = self.api.get(
                f"/apis/serving.tokenfleet.dev/v1alpha1/namespaces/{self.ns}/modeldeployments/{MD}"
            )
            return (st.get("status") or {}).get("configHash") != before

        return f"maxNumBatchedTokens -> {tokens} (every runtime pod replaced)", rolled

    def scale_down(self) -> tuple[str, Callable[[], bool]]:
        self._patch(
            "md",
            MD,
            {"spec": {"disaggregation": {"decode": {"autoscaling": {"minReplicas": 1, "maxReplicas": 1}}}}},
        )

        def one() -> bool:
            return len(self._pods(f"{RUNTIME},serving.tokenfleet.dev/role=decode")) == 1

        return "decode autoscaling bounds 2 -> 1: the autoscaler removes a serving pod", one

    def lose_node(self) -> tuple[str, Callable[[], bool]]:
        """The node holding the most of the fleet's pods crashes (its kubelet and pods stop); once its pods
        are evicted and Ready elsewhere, it comes back."""
        pods = [p for p in self.api.items(f"/api/v1/namespaces/{self.ns}/pods") if ready(p)]
        node = Counter(p["spec"]["nodeName"] for p in pods).most_common(1)[0][0]
        kubelet = self.plane.kubelets[node]
        on_node = [p for p in pods if p["spec"]["nodeName"] == node]
        now = time.monotonic()
        for p in on_node:  # the routers die with the node, and the streams they relay with them
            if p["metadata"]["labels"].get("app.kubernetes.io/component") == "router":
                self.router_deaths.append((p["status"]["podIP"], now))
        kubelet.stop()
        lost = {p["metadata"]["name"] for p in on_node}
        state = {"back": False}

        def moved() -> bool:
            if state["back"]:
                return True
            live = [p for p in self.api.items(f"/api/v1/namespaces/{self.ns}/pods") if ready(p)]
            if any(p["metadata"]["name"] in lost for p in live) or not self._fleet_ready(live):
                return False
            kubelet.start()  # the node comes back: it deletes the evicted pods it no longer runs
            state["back"] = True
            return True

        return f"{node} lost with {len(lost)} pods", moved

    def _fleet_ready(self, live: list[dict[str, Any]]) -> bool:
        deps = self.api.items(f"/apis/apps/v1/namespaces/{self.ns}/deployments")
        want = sum(d["spec"]["replicas"] for d in deps)
        return len(live) >= want

    def inject(self, name: str, budget: float = 300) -> FaultResult:
        injected = time.monotonic()
        if name not in FAULTS:
            raise ValueError(f"unknown fault {name!r}: one of {', '.join(FAULTS)}")
        detail, settled = getattr(self, name)()
        steady = self._wait_steady(injected, settled, budget)
        result = FaultResult(name, injected - self.started, detail, steady)
        self.faults.append(result)
        return result

    # ------------------------------------------------------------------------------------------------ ending
    def finish(self, leak_wait: float = 60) -> None:
        """Stops the load, then waits for every surviving runtime pod's KV blocks to be free again (a prefill
        pod's holds expire on their own); what is still taken then is leaked."""
        self.load.stop()
        self.routers.stop()
        deadline = time.monotonic() + leak_wait
        while True:
            taken = {}
            for pod in self._pods(RUNTIME):
                if not ready(pod):
                    continue
                try:
                    text = scrape(f"http://{pod['status']['podIP']}:8000")
                except OSError:
                    continue
                total = metric(text, "tokenfleet:num_kv_blocks_total")
                free = metric(text, "tokenfleet:num_kv_blocks_free")
                taken[pod["metadata"]["name"]] = int(total - free)
            if not any(taken.values()) or time.monotonic() > deadline:
                self.leaked = taken
                return
            time.sleep(1)

    def _router_died_under(self, r: Record) -> bool:
        return any(ip == r.router and r.started <= at <= (r.ended or at) for ip, at in self.router_deaths)

    def errors(self) -> Counter:
        """Errors by kind; a request whose router was killed under it counts as `router_died`."""
        out = Counter()
        for r in self.load.records:
            if r.outcome == "error":
                out[
                    "router_died"
                    if self._router_died_under(r) and r.error in ("broken_stream", "connect")
                    else r.error
                ] += 1
        return out

    def defects(self) -> list[Record]:
        """The client-visible errors that were resumable: every one is a defect."""
        return [
            r
            for r in self.load.records
            if r.outcome == "error"
            and not (self._router_died_under(r) and r.error in ("broken_stream", "connect"))
        ]

    def report(self) -> str:
        records = [r for r in self.load.records if r.outcome]
        counts = self.routers.counts()
        outcomes = Counter(r.outcome for r in records)
        by_kind = Counter(r.kind for r in records)
        lines = [
            f"chaos run: {time.monotonic() - self.started:.0f} s of load, {self.load.workers} clients",
            f"requests sent {len(self.load.records)}, completed {outcomes['ok']}, "
            f"disconnected by their client {outcomes['disconnected']}, errors {outcomes['error']}",
            "by kind: " + ", ".join(f"{k} {v}" for k, v in sorted(by_kind.items())),
            f"retried before the first byte: {sum(1 for r in records if r.retries)} requests "
            f"({sum(r.retries for r in records)} retries)",
            f"resumed by the routers: {counts['resumes']}; resume failures: "
            + (", ".join(f"{k[8:]} {v}" for k, v in counts.items() if k.startswith("failure:")) or "none"),
        ]
        errors = self.errors()
        lines.append("client-visible errors by kind:" + ("" if errors else " none"))
        for kind, n in errors.most_common():
            why = UNRESUMABLE.get(kind)
            lines.append(f"  {kind}: {n}" + (f" (unresumable: {why})" if why else " (resumable: a defect)"))
        for r in self.defects()[:10]:
            lines.append(
                f"    {r.kind} via {r.router} at {r.started - self.started:.1f} s: {r.error} {r.detail}"
            )
        lines.append(
            "KV blocks still taken after the load: "
            + (", ".join(f"{k} {v}" for k, v in sorted(self.leaked.items())) or "no pod to read")
        )
        lines.append("| fault | at (s) | what | back to steady (s) |")
        lines.append("|---|---:|---|---:|")
        for f in self.faults:
            steady = f"{f.steady_s:.1f}" if f.steady_s is not None else "not within budget"
            lines.append(f"| {f.name} | {f.at:.0f} | {f.detail} | {steady} |")
        return "\n".join(lines)
