"""`status.adapters` of a ModelDeployment with LoRA adapters: which listed adapter each Ready pod has loaded.

Each runtime pod's `GET /load` (open to the operator: no key) lists the adapters it has loaded
(`lora_adapters`, kv_wire.py). A pod loads an edited list within seconds of the ConfigMap's change, and a
bad adapter is refused by the pod (its log says why) while the others load: this status is where a user
sees that. Pure: which pods to ask and what their answers mean; the asking is in adapter_report.py.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from tokenfleet.operator.fleet_scrape import http_port
from tokenfleet.operator.model_loading import pod_ready

# At most this many Ready pods are asked per tick (a large fleet's first pods, by name: they load alike).
MAX_ASKED_PODS = 16


def adapter_targets(pods: Sequence[Mapping[str, Any]], default_port: int) -> list[tuple[str, str]]:
    """(pod name, its /load URL) of each Ready runtime pod with an IP that is not leaving, by name."""
    out = []
    for pod in sorted(pods, key=lambda p: p["metadata"]["name"]):
        status = pod.get("status") or {}
        ip = status.get("podIP")
        if pod["metadata"].get("deletionTimestamp") or not ip or not pod_ready(pod):
            continue
        host = f"[{ip}]" if ":" in ip else ip
        out.append((pod["metadata"]["name"], f"http://{host}:{http_port(pod, default_port)}/load"))
    return out[:MAX_ASKED_PODS]


def loaded_adapters(body: Mapping[str, Any] | None) -> frozenset[str]:
    """The adapter names a pod's /load answer lists (none for no answer or a malformed one)."""
    adapters = body.get("lora_adapters") if isinstance(body, Mapping) else None
    if not isinstance(adapters, Mapping):
        return frozenset()
    return frozenset(name for name in adapters if isinstance(name, str))


def pinned_adapters(body: Mapping[str, Any] | None) -> frozenset[str]:
    """The adapter names a pod's /load answer says are pinned there (its share of minimum copies)."""
    pinned = body.get("lora_pinned") if isinstance(body, Mapping) else None
    if not isinstance(pinned, list):
        return frozenset()
    return frozenset(name for name in pinned if isinstance(name, str))


def adapter_status(
    listed: Sequence[str], answers: Sequence[Mapping[str, Any] | None]
) -> tuple[list[dict[str, Any]] | None, str | None]:
    """(`status.adapters`, `status.adaptersReady`) from the listed names and the Ready pods' /load answers.

    A pod that does not answer counts as not holding any: an adapter is ready only when every Ready pod
    asked reports it. Nothing listed: both fields go (None)."""
    if not listed:
        return None, None
    held = [loaded_adapters(a) for a in answers]
    pinned = [pinned_adapters(a) for a in answers]
    entries = []
    for name in listed:
        count = sum(name in h for h in held)
        entry = {"name": name, "loadedPods": count, "ready": bool(held) and count == len(held)}
        entries.append({**entry, "pinnedPods": sum(name in p for p in pinned)})
    ready = sum(e["ready"] for e in entries)
    return entries, f"{ready}/{len(listed)}"
