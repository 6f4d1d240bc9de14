"""Endpoints: the pods behind each backend, from a static list or the backend Service's EndpointSlices.

`Endpoint` is the router's live view of one pod (health, last load report, in-flight count, role); it is
touched only from the event loop. Discovery produces, per backend, the pod base URLs (with each one's role
where known); `EndpointSet.sync` diffs it against what is known and reports additions/removals so the app
starts/stops the pod's monitor.

Kubernetes: the router watches `discovery.k8s.io/v1` EndpointSlices labelled
`kubernetes.io/service-name=<service>` (the client's watch runs in a thread; updates hop to the loop).
`slice_endpoints` is the pure mapping from slices to URLs, each with its prefill/decode role when one is
known. A backend's watch keeps every address that is not terminating, ready or not: the kubelet's
readiness is not what puts a pod in rotation here, the router's own probe of its `/ready` is (monitor.py;
an endpoint starts out of rotation). So the router knows the pods that are asleep (a sleeping pod's
`/ready` is 503, so Kubernetes marks it not ready) and can wake one when requests wait for it (wake.py),
and a starting pod joins as soon as the router's probe (every `probeIntervalSeconds`, 0.5 s by default)
sees it ready, not after the kubelet's readiness period plus the EndpointSlice's propagation. Terminating
addresses are dropped at once: the pod is going away. Other watchers (the router's peers, quota_peers.py)
take the ready addresses only (`ready_only`): they have no probe of their own.

Roles: a backend configured as `prefill` or `decode` gives every endpoint that role. A backend of role
`both` takes each endpoint's from the `ROLE_LABEL` label: the pod's own (the slice endpoint's `targetRef`
names the pod; a second watch follows the labelled pods of the namespace, needing `pods` get/list/watch),
else the slice's (the endpoint-slice controller copies the Service's labels onto its slices, so a
per-role Service labels all its endpoints). So one Service selecting both roles' pods is enough for the
router to run a model disaggregated. `of_backends` takes `backend#role` to mean that backend's endpoints of
one role (disaggregation.py narrows a request's targets that way).
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from tokenfleet.runtime.router.config import ROLE_LABEL, Backend, Discovery
from tokenfleet.runtime.router.health import HealthState

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Endpoint:
    url: str
    backend: str
    model: str
    health: HealthState
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    in_flight: int = 0
    # This router's requests started minus ended here since the last /load report. The report is one poll
    # old: a stream that ended here a moment ago would still count until the next poll, and a client that
    # sends its next request at once would see this pod as busy as one that is. The report plus this delta
    # is what the pod runs now, as far as this router knows; the next report replaces the estimate.
    since_report: int = 0
    block_size: int | None = None
    role: str = "both"  # prefill | decode | both (serves whole requests)
    tokenizer_digest: str | None = None  # what its /load reports (pod_tokenizers.py follows it)
    sleep_level: int | None = None  # what its /ready said while it slept (1: weights kept in host memory)
    # LoRA adapters its /load reports loaded: name -> the key their blocks are hashed with (kv_wire.py).
    lora_adapters: dict[str, str] = field(default_factory=dict)
    lora_room: int | None = None  # adapters it could load now (its /load's lora_room); None: not reported
    # Adapters with requests in flight there (its /load's lora_active, plus those this router sent since)
    # and how many step at once (lora_slots; None: not reported): adapter_placement.py counts slots.
    lora_active: frozenset[str] = frozenset()
    lora_slots: int | None = None

    @property
    def id(self) -> str:
        return self.url

    def load_report(self, num_running: int, num_waiting: int, kv_cache_usage: float) -> None:
        """The pod's /load figures, read now."""
        self.num_running, self.num_waiting, self.kv_cache_usage = num_running, num_waiting, kv_cache_usage
        self.since_report = 0

    @property
    def reported_load(self) -> int:
        """The last report's running + waiting, brought up to date with this router's own starts and ends."""
        n = self.num_running + self.num_waiting + self.since_report
        return n if n > 0 else 0

    @property
    def load(self) -> int:
        return max(self.reported_load, self.in_flight)


ROLE_SEP = "#"
_ROLES = frozenset({"prefill", "decode", "both"})


def role_ref(backend: str, role: str) -> str:
    """The name `of_backends` reads as "the endpoints of `backend` whose role is `role`"."""
    return f"{backend}{ROLE_SEP}{role}"


@dataclass(slots=True)
class EndpointSet:
    policy: Discovery
    by_id: dict[str, Endpoint] = field(default_factory=dict)

    def sync(
        self, backend: Backend, urls: Iterable[str] | Mapping[str, str | None]
    ) -> tuple[list[Endpoint], list[Endpoint]]:
        """Make `backend`'s endpoints exactly `urls` (a mapping gives each one's role label, None = none);
        returns (added, removed). A known endpoint whose role changed (a relabelled pod) takes the new one."""
        labelled = dict(urls) if isinstance(urls, Mapping) else dict.fromkeys(urls)
        wanted = {u.rstrip("/"): endpoint_role(backend, r) for u, r in labelled.items()}
        current = {e.url for e in self.by_id.values() if e.backend == backend.name}
        added = [
            Endpoint(
                u, backend.name, backend.model, HealthState(self.policy), block_size=None, role=wanted[u]
            )
            for u in sorted(wanted.keys() - current)
        ]
        removed = [self.by_id.pop(u) for u in sorted(current - wanted.keys())]
        for u in current & wanted.keys():
            self.by_id[u].role = wanted[u]
        for e in added:
            self.by_id[e.id] = e
        return added, removed

    def of_backends(self, names: Iterable[str]) -> list[Endpoint]:
        """The endpoints of the named backends; `backend#role` names those of one role only."""
        whole: set[str] = set()
        by_role: set[tuple[str, str]] = set()
        for name in names:
            backend, sep, role = name.partition(ROLE_SEP)
            if sep:
                by_role.add((backend, role))
            else:
                whole.add(name)
        return [e for e in self.by_id.values() if e.backend in whole or (e.backend, e.role) in by_role]


def endpoint_role(backend: Backend, label: str | None) -> str:
    """An endpoint's role: the backend's when configured, else its label's (when it is a role)."""
    if backend.role != "both":
        return backend.role
    return label if label in _ROLES else "both"


def slice_endpoints(
    slices: Iterable[Mapping],
    port: int,
    scheme: str = "http",
    pod_roles: Mapping[str, str] | None = None,
    ready_only: bool = False,
) -> dict[str, str | None]:
    """Base URL -> role label (None: unlabelled) of the addresses in EndpointSlices (dicts in the API's
    camelCase shape) that are not terminating; with `ready_only`, of the ready (or serving) ones only.
    `pod_roles`: pod name -> its role label, which wins over the slice's."""
    pod_roles = pod_roles or {}
    out: dict[str, str | None] = {}
    for s in slices:
        ports = [p.get("port") for p in (s.get("ports") or []) if p.get("port")]
        # The Service's target port when the slice names one (a named port maps there), else the URL's port.
        slice_port = port if port in ports or not ports else ports[0]
        slice_role = ((s.get("metadata") or {}).get("labels") or {}).get(ROLE_LABEL)
        for ep in s.get("endpoints") or []:
            cond = ep.get("conditions") or {}
            ready = cond.get("ready")
            serving = cond.get("serving", ready)
            if cond.get("terminating"):
                continue
            if ready_only and (ready is False or (ready is None and not serving)):
                continue
            ref = ep.get("targetRef") or {}
            role = pod_roles.get(ref.get("name", "")) if ref.get("kind", "Pod") == "Pod" else None
            for addr in ep.get("addresses") or []:
                host = f"[{addr}]" if ":" in addr else addr
                out[f"{scheme}://{host}:{slice_port}"] = role or slice_role
    return dict(sorted(out.items()))


def ready_endpoints(
    slices: Iterable[Mapping], port: int, scheme: str = "http", pod_roles: Mapping[str, str] | None = None
) -> dict[str, str | None]:
    """`slice_endpoints` of the ready addresses only."""
    return slice_endpoints(slices, port, scheme, pod_roles, ready_only=True)


def ready_urls(slices: Iterable[Mapping], port: int, scheme: str = "http") -> list[str]:
    """Base URLs of ready addresses in EndpointSlices (dicts in the API's camelCase shape)."""
    return list(ready_endpoints(slices, port, scheme))


def static_urls(backend: Backend) -> list[str]:
    return [backend.url.rstrip("/")]


class EndpointSliceWatch:
    """Watches one backend Service's EndpointSlices; calls `on_change(backend, urls)` on the event loop.

    `on_change` gets every address that is not terminating, ready or not (the router's probes decide when
    one takes traffic); `ready_only` for a watcher that has no probes of its own."""

    def __init__(
        self,
        backend: Backend,
        default_namespace: str | None,
        on_change: Callable[[Backend, list[str]], None],
        loop: asyncio.AbstractEventLoop,
        read_roles: bool = True,
        ready_only: bool = False,
    ) -> None:
        self.backend = backend
        self._ready_only = ready_only
        self._read_roles = read_roles and backend.role == "both"
        service, namespace, port = backend.service
        self._service = service
        self._namespace = namespace or default_namespace or "default"
        self._port = port
        self._scheme = "https" if backend.url.startswith("https") else "http"
        self._on_change = on_change
        self._loop = loop
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # the two watch threads share what they saw
        self._slices: dict[str, dict] = {}
        self._pod_roles: dict[str, str] = {}

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"eps-{self._service}", daemon=True)
        self._thread.start()
        if self._read_roles:  # its Service may select pods of both roles: read their labels
            threading.Thread(target=self._run_pods, name=f"roles-{self._service}", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()

    @staticmethod
    def _api():
        from kubernetes import client, config

        try:
            config.load_incluster_config()
        except config.ConfigException:
            # KUBECONFIG as it is now: the kubernetes package reads its default path once, at import.
            config.load_kube_config(config_file=os.environ.get("KUBECONFIG"))
        return client

    def _run(self) -> None:
        from kubernetes import watch

        api = self._api().DiscoveryV1Api()
        selector = f"kubernetes.io/service-name={self._service}"
        while not self._stop.is_set():
            try:
                listing = api.list_namespaced_endpoint_slice(self._namespace, label_selector=selector)
                with self._lock:
                    self._slices = {
                        s.metadata.name: api.api_client.sanitize_for_serialization(s) for s in listing.items
                    }
                self._publish()
                w = watch.Watch()
                for ev in w.stream(
                    api.list_namespaced_endpoint_slice,
                    self._namespace,
                    label_selector=selector,
                    resource_version=listing.metadata.resource_version,
                    timeout_seconds=60,
                ):
                    if self._stop.is_set():
                        w.stop()
                        break
                    obj = api.api_client.sanitize_for_serialization(ev["object"])
                    name = obj["metadata"]["name"]
                    with self._lock:
                        if ev["type"] == "DELETED":
                            self._slices.pop(name, None)
                        else:
                            self._slices[name] = obj
                    self._publish()
            except Exception as e:  # the watch must survive API hiccups; relist after a pause
                log.warning("EndpointSlice watch for %s/%s failed: %s", self._namespace, self._service, e)
                self._stop.wait(2.0)

    def _run_pods(self) -> None:
        """The role labels of the namespace's labelled pods (name -> role), kept current."""
        from kubernetes import watch
        from kubernetes.client.exceptions import ApiException

        api = self._api().CoreV1Api()
        warned = False
        while not self._stop.is_set():
            try:
                listing = api.list_namespaced_pod(self._namespace, label_selector=ROLE_LABEL)
                with self._lock:
                    self._pod_roles = {p.metadata.name: p.metadata.labels[ROLE_LABEL] for p in listing.items}
                self._publish()
                w = watch.Watch()
                for ev in w.stream(
                    api.list_namespaced_pod,
                    self._namespace,
                    label_selector=ROLE_LABEL,
                    resource_version=listing.metadata.resource_version,
                    timeout_seconds=60,
                ):
                    if self._stop.is_set():
                        w.stop()
                        break
                    pod = ev["object"]
                    with self._lock:
                        if ev["type"] == "DELETED":
                            self._pod_roles.pop(pod.metadata.name, None)
                        else:
                            self._pod_roles[pod.metadata.name] = (pod.metadata.labels or {}).get(
                                ROLE_LABEL, ""
                            )
                    self._publish()
            except ApiException as e:
                if e.status == 403 and not warned:  # not granted: the slices' own labels still give roles
                    log.warning(
                        "cannot read pods in %s (%s): endpoint roles come from EndpointSlice labels only",
                        self._namespace,
                        e.reason,
                    )
                    warned = True
                self._stop.wait(30.0 if e.status == 403 else 2.0)
            except Exception as e:
                log.warning("pod role watch in %s failed: %s", self._namespace, e)
                self._stop.wait(2.0)

    def _publish(self) -> None:
        # Scheduled under the lock: the two watch threads then queue their snapshots in the order they took
        # them, and the loop runs callbacks in the order they were queued, so the newest snapshot is always
        # applied last. Queued after the lock, an older snapshot could land behind a newer one and leave
        # endpoints or roles stale until the next event. Queueing does not wait on the loop.
        with self._lock:
            urls = slice_endpoints(
                self._slices.values(), self._port, self._scheme, self._pod_roles, self._ready_only
            )
            self._loop.call_soon_threadsafe(self._on_change, self.backend, urls)
