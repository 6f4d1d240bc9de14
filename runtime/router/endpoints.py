"""Endpoints: the pods behind each backend, from a static list or the backend Service's EndpointSlices.

`Endpoint` is the router's live view of one pod (health, last load report, in-flight count); it is touched
only from the event loop. Discovery produces, per backend, the set of pod base URLs; `EndpointSet.sync`
diffs it against what is known and reports additions/removals so the app starts/stops the pod's monitor.

Kubernetes: the router watches `discovery.k8s.io/v1` EndpointSlices labelled
`kubernetes.io/service-name=<service>` (the client's watch runs in a thread; updates hop to the loop).
`ready_urls` is the pure mapping from slices to URLs: ready (or serving and not terminating) addresses only.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from tokenfleet.runtime.router.config import Backend, Discovery
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
    block_size: int | None = None

    @property
    def id(self) -> str:
        return self.url

    @property
    def load(self) -> int:
        return max(self.num_running + self.num_waiting, self.in_flight)


@dataclass(slots=True)
class EndpointSet:
    policy: Discovery
    by_id: dict[str, Endpoint] = field(default_factory=dict)

    def sync(self, backend: Backend, urls: Iterable[str]) -> tuple[list[Endpoint], list[Endpoint]]:
        """Make `backend`'s endpoints exactly `urls`; returns (added, removed)."""
        wanted = {u.rstrip("/") for u in urls}
        current = {e.url for e in self.by_id.values() if e.backend == backend.name}
        added = [
            Endpoint(u, backend.name, backend.model, HealthState(self.policy), block_size=None)
            for u in sorted(wanted - current)
        ]
        removed = [self.by_id.pop(u) for u in sorted(current - wanted)]
        for e in added:
            self.by_id[e.id] = e
        return added, removed

    def of_backends(self, names: Iterable[str]) -> list[Endpoint]:
        wanted = set(names)
        return [e for e in self.by_id.values() if e.backend in wanted]


def ready_urls(slices: Iterable[Mapping], port: int, scheme: str = "http") -> list[str]:
    """Base URLs of ready addresses in EndpointSlices (dicts in the API's camelCase shape)."""
    urls: set[str] = set()
    for s in slices:
        ports = [p.get("port") for p in (s.get("ports") or []) if p.get("port")]
        # The Service's target port when the slice names one (a named port maps there), else the URL's port.
        slice_port = port if port in ports or not ports else ports[0]
        for ep in s.get("endpoints") or []:
            cond = ep.get("conditions") or {}
            ready = cond.get("ready")
            serving = cond.get("serving", ready)
            if ready is False or (ready is None and not serving) or cond.get("terminating"):
                continue
            for addr in ep.get("addresses") or []:
                host = f"[{addr}]" if ":" in addr else addr
                urls.add(f"{scheme}://{host}:{slice_port}")
    return sorted(urls)


def static_urls(backend: Backend) -> list[str]:
    return [backend.url.rstrip("/")]


class EndpointSliceWatch:
    """Watches one backend Service's EndpointSlices; calls `on_change(backend, urls)` on the event loop."""

    def __init__(
        self,
        backend: Backend,
        default_namespace: str | None,
        on_change: Callable[[Backend, list[str]], None],
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        self.backend = backend
        service, namespace, port = backend.service
        self._service = service
        self._namespace = namespace or default_namespace or "default"
        self._port = port
        self._scheme = "https" if backend.url.startswith("https") else "http"
        self._on_change = on_change
        self._loop = loop
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"eps-{self._service}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        from kubernetes import client, config, watch

        try:
            config.load_incluster_config()
        except config.ConfigException:
            config.load_kube_config()
        api = client.DiscoveryV1Api()
        selector = f"kubernetes.io/service-name={self._service}"
        slices: dict[str, dict] = {}
        while not self._stop.is_set():
            try:
                listing = api.list_namespaced_endpoint_slice(self._namespace, label_selector=selector)
                slices = {
                    s.metadata.name: api.api_client.sanitize_for_serialization(s) for s in listing.items
                }
                self._publish(slices)
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
                    if ev["type"] == "DELETED":
                        slices.pop(name, None)
                    else:
                        slices[name] = obj
                    self._publish(slices)
            except Exception as e:  # the watch must survive API hiccups; relist after a pause
                log.warning("EndpointSlice watch for %s/%s failed: %s", self._namespace, self._service, e)
                self._stop.wait(2.0)

    def _publish(self, slices: dict[str, dict]) -> None:
        urls = ready_urls(slices.values(), self._port, self._scheme)
        self._loop.call_soon_threadsafe(self._on_change, self.backend, urls)
