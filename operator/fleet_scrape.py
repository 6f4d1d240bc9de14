"""What the autoscaler observes of a fleet each decision: which pods count, and what their `/metrics` say.

One observation (`observe`) per decision, turned into the policy's inputs (`PodSample`s and the requests the
routers hold):
- each runtime pod is classified (`pod_view`): Ready with an IP -> scraped; not Ready and never started (its
  startup probe has not passed, no restart) -> starting, capacity on the way; a started pod that is not
  Ready and whose /metrics says it sleeps (`engine_sleep_state` > 0) -> sleeping (warm_tier.py); anything
  else (a crash loop, a pod that went unready) -> unknown, which never lets the fleet shrink; terminating
  and finished pods do not count (they are leaving);
- every Ready runtime pod's `/metrics`, and the `/metrics` of the routers of its RoutingPolicy, are scraped
  all at once (aiohttp) with a bounded time and size, so one slow or runaway pod never holds a decision up;
  the routers' `tokenfleet:router_pending_requests{model}` gauge is the demand that brings a model back from
  zero (requests they hold because no endpoint can take them). The text is parsed in pod_metrics.py;
- a failed scrape (a status other than 200, a timeout, a refused connection, a page too large or malformed)
  makes that pod unknown, never idle: a pod that cannot be read must not pass for spare capacity. A router
  that cannot be read adds no demand and is counted (`Observation.router_failures`), for the log.

Recent scrapes of each pod are kept in a `ScrapeBook` (the autoscaler keeps one per object in its kopf memo):
rates and TTFT percentiles are differences over a window, so after an operator restart the first decisions
simply have no rate or TTFT figure yet.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from tokenfleet.operator.autoscaling_policy import AutoscalingSpec, PodSample, PodState
from tokenfleet.operator.autoscaling_status import from_rfc3339
from tokenfleet.operator.builders import RUNTIME_PORT
from tokenfleet.operator.pod_metrics import (
    MetricsParseError,
    PodMetrics,
    parse_metrics,
    pod_sample,
    router_pending,
)
from tokenfleet.operator.router_builders import ROUTER_PORT

# A scrape that takes longer than this counts as failed (the pod is unknown): a decision must not wait on
# one slow pod, and every pod is scraped at once.
SCRAPE_TIMEOUT_SECONDS = 2.0
# A page larger than this counts as failed too: a runaway exporter (a label explosion) must not cost the
# operator its memory.
MAX_METRICS_BYTES = 4 << 20
# The tokens/s rate is taken over the TTFT window when there is one, else over this.
RATE_WINDOW_SECONDS = 60.0


# ------------------------------------------------------------------------------------------------------ pods
@dataclass(frozen=True, slots=True)
class PodView:
    """A pod as the autoscaler counts it; `url` is its /metrics for a Ready pod."""

    name: str
    state: PodState
    url: str | None = None


def http_port(pod: Mapping[str, Any], default: int) -> int:
    """The pod's port named `http` (a container's), else `default`."""
    for container in (pod.get("spec") or {}).get("containers") or []:
        for port in container.get("ports") or []:
            if port.get("name") == "http" and port.get("containerPort"):
                return int(port["containerPort"])
    return default


def pod_view(pod: Mapping[str, Any], default_port: int = RUNTIME_PORT) -> PodView | None:
    """How a pod counts; None for a pod that is leaving (terminating, or finished for good)."""
    meta, status = pod["metadata"], pod.get("status") or {}
    if meta.get("deletionTimestamp") or status.get("phase") in ("Succeeded", "Failed"):
        return None
    name = meta["name"]
    ready = any(
        c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or []
    )
    ip = status.get("podIP")
    url = None
    if ip:
        host = f"[{ip}]" if ":" in ip else ip
        url = f"http://{host}:{http_port(pod, default_port)}/metrics"
    if ready and url:
        return PodView(name, PodState.READY, url)
    containers = status.get("containerStatuses") or []
    # `started` turns true when the startup probe passes (model loaded): before that and without a restart,
    # the pod is still cold-starting; after it, not being Ready means something is wrong — or that the pod
    # sleeps (sleep mode: /ready is 503 while asleep), which only its /metrics can tell, so it is scraped.
    if not ready and not any(c.get("started") or c.get("restartCount") for c in containers):
        return PodView(name, PodState.STARTING)
    return PodView(name, PodState.UNKNOWN, url)


def cold_start_seconds(pods: list[Mapping[str, Any]]) -> float | None:
    """Creation to Ready of the newest Ready pod: what a request held at zero replicas waits for (scheduling,
    image, model load, probes), measured on this fleet rather than guessed. None without a Ready pod."""
    newest: tuple[str, float] | None = None
    for pod in pods:
        meta, status = pod["metadata"], pod.get("status") or {}
        ready = next(
            (
                c
                for c in status.get("conditions") or []
                if c.get("type") == "Ready" and c.get("status") == "True"
            ),
            None,
        )
        created = meta.get("creationTimestamp")
        if ready is None or not created or not ready.get("lastTransitionTime"):
            continue
        seconds = from_rfc3339(ready["lastTransitionTime"]) - from_rfc3339(created)
        if newest is None or created > newest[0]:
            newest = (created, max(seconds, 0.0))
    return newest[1] if newest is not None else None


# --------------------------------------------------------------------------------------------------- scrapes
def scrape_session() -> aiohttp.ClientSession:
    """The session one decision's scrapes share, every request bounded by SCRAPE_TIMEOUT_SECONDS."""
    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=SCRAPE_TIMEOUT_SECONDS))


async def fetch_text(session: aiohttp.ClientSession, url: str) -> str | None:
    """The body of one /metrics scrape, or None when it failed (status, timeout, connection, size)."""
    body = bytearray()
    try:
        async with session.get(url) as response:
            if response.status != 200:
                return None
            # Chunk by chunk to the end (a single read may stop at whatever has arrived), bounded.
            async for chunk in response.content.iter_chunked(1 << 16):
                body += chunk
                if len(body) > MAX_METRICS_BYTES:
                    return None
    except (aiohttp.ClientError, TimeoutError, OSError):
        return None
    return body.decode("utf-8", errors="replace")


# ---------------------------------------------------------------------------------------------- observations
class ScrapeBook:
    """Recent scrapes of each pod, oldest first: enough to reach one scrape at least a window back."""

    def __init__(self) -> None:
        self._by_pod: dict[str, list[tuple[float, PodMetrics]]] = {}
        self._scopes: dict[str, ScrapeBook] = {}

    def add(self, pod: str, t: float, metrics: PodMetrics, window: float) -> list[tuple[float, PodMetrics]]:
        series = self._by_pod.setdefault(pod, [])
        series.append((t, metrics))
        # pod_sample differences the newest scrape against the newest one at least `window` older.
        base = max((i for i, (ti, _) in enumerate(series[:-1]) if t - ti >= window), default=0)
        del series[:base]
        return series

    def scoped(self, scope: str) -> ScrapeBook:
        """A book of its own for one part of the fleet (a role), whose decisions retain only its pods."""
        return self._scopes.setdefault(scope, ScrapeBook())

    def retain(self, pods: Iterable[str]) -> None:
        keep = set(pods)
        for name in [n for n in self._by_pod if n not in keep]:
            del self._by_pod[name]

    def __len__(self) -> int:
        return len(self._by_pod)


@dataclass(frozen=True, slots=True)
class Observation:
    samples: tuple[PodSample, ...]
    pending_requests: int
    router_failures: int  # router pods whose /metrics could not be read
    urls: Mapping[str, str] = field(default_factory=dict)  # pod -> its server's base URL (scraped pods)


async def observe(
    session: aiohttp.ClientSession,
    pods: list[Mapping[str, Any]],
    routers: list[Mapping[str, Any]],
    model: str,
    spec: AutoscalingSpec,
    book: ScrapeBook,
    now: float,
) -> Observation:
    """Classify and scrape the runtime pods and the routers (all scrapes at once) into the policy's inputs."""
    views = [v for v in (pod_view(p) for p in pods) if v is not None]
    router_urls = [
        v.url for v in (pod_view(p, ROUTER_PORT) for p in routers) if v is not None and v.url is not None
    ]
    scraped = [v for v in views if v.url is not None]
    texts = await asyncio.gather(
        *(fetch_text(session, v.url) for v in scraped),  # type: ignore[arg-type]
        *(fetch_text(session, url) for url in router_urls),
    )
    pod_texts = dict(zip((v.name for v in scraped), texts[: len(scraped)], strict=True))
    ttft = spec.targets.ttft
    window = ttft.window_seconds if ttft is not None else RATE_WINDOW_SECONDS
    quantile = ttft.percentile if ttft is not None else 0.9
    samples = []
    for view in views:
        text = pod_texts.get(view.name)
        try:
            metrics = parse_metrics(text) if text is not None else None
        except MetricsParseError:
            metrics = None
        if view.state is not PodState.READY:
            asleep = metrics is not None and metrics.gauge("engine_sleep_state") > 0
            samples.append(PodSample(view.name, PodState.SLEEPING if asleep else view.state))
            continue
        if metrics is None:
            samples.append(PodSample(view.name, PodState.UNKNOWN))  # never a reason to scale down
            continue
        samples.append(pod_sample(view.name, book.add(view.name, now, metrics, window), window, quantile))
    book.retain(v.name for v in views)
    pending, failures = 0.0, 0
    for text in texts[len(scraped) :]:
        try:
            pending += router_pending(text, model) if text is not None else 0.0
        except MetricsParseError:
            text = None
        failures += text is None
    urls = {v.name: v.url.removesuffix("/metrics") for v in scraped if v.url is not None}
    return Observation(tuple(samples), round(pending), failures, urls)
