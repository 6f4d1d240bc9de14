"""Which router pods run which RoutingPolicy generation: read from the routers themselves.

A RoutingPolicy edit reaches the routers without a rollout: the operator rewrites the ConfigMap (with the
policy's `metadata.generation` in it), the kubelet swaps the mounted file (up to a minute later), and each
router applies it live and exports `tokenfleet:router_config_generation`. Reconciling the policy (on every
change and on the resync timer) reads that gauge from each ready router pod and reports
`status.routers: [{pod, generation}]` (generation null when a pod could not be read), so
`kubectl get rp -o yaml` shows whether every router has the edit.
"""

from __future__ import annotations

import re
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from tokenfleet.operator.router_builders import ROUTER_PORT

GENERATION_METRIC = "tokenfleet:router_config_generation"
_GENERATION = re.compile(rf"^{re.escape(GENERATION_METRIC)} (\S+)$", re.M)
SCRAPE_TIMEOUT_S = 1.0


def applied_generation(metrics_text: str | None) -> int | None:
    """The generation a router's /metrics reports; None when unknown (unread, absent, or -1: none given)."""
    if metrics_text is None:
        return None
    m = _GENERATION.search(metrics_text)
    if m is None:
        return None
    try:
        value = int(float(m.group(1)))
    except ValueError:
        return None
    return value if value >= 0 else None


def metrics_url(pod: Mapping[str, Any]) -> str | None:
    """The /metrics URL of a ready, not terminating router pod; None otherwise."""
    meta, status = pod["metadata"], pod.get("status") or {}
    if meta.get("deletionTimestamp"):
        return None
    ready = any(
        c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or []
    )
    ip = status.get("podIP")
    if not (ready and ip):
        return None
    host = f"[{ip}]" if ":" in ip else ip
    return f"http://{host}:{ROUTER_PORT}/metrics"


def routers_status(
    pods: Iterable[Mapping[str, Any]], fetch: Callable[[str], str | None]
) -> list[dict[str, Any]]:
    """`[{pod, generation}]` for the ready router pods, sorted by name; `fetch(url)` reads one /metrics."""
    ready = sorted(
        ((p["metadata"]["name"], url) for p in pods if (url := metrics_url(p)) is not None),
    )
    if not ready:
        return []
    with ThreadPoolExecutor(max_workers=min(len(ready), 8)) as pool:
        texts = list(pool.map(fetch, [url for _, url in ready]))
    return [
        {"pod": name, "generation": applied_generation(t)} for (name, _), t in zip(ready, texts, strict=True)
    ]


def fetch_metrics(url: str) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=SCRAPE_TIMEOUT_S) as r:
            return r.read(1 << 20).decode("utf-8", "replace") if r.status == 200 else None
    except (OSError, urllib.error.URLError, ValueError):
        return None
