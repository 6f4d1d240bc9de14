"""How far each starting pod of a ModelDeployment is: the download, then the load, as `status.loading` says.

A runtime pod's cold start has two processes, and both answer `GET /ready` on the pod's HTTP port with 503
and a JSON body that says how far they are: the `fetch-model` init container (an hf:// source:
`{"status": "fetching", "progress": {"phase": "download", "bytes": ..., "total": ..., "percent": ...}}`),
then the server while it loads (`{"status": "loading", "progress": {"weights": {"done", "total",
"percent"}, "seconds": ...}}`). The operator asks every pod that is not Ready and reports one entry per pod,
so `kubectl get md NAME -o yaml` shows a 40 GB download at 37 % instead of a pod that is merely not Ready.

Pure: which pods to ask (`loading_targets`) and what their answers mean (`loading_entry`); the asking is in
loading_report.py.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tokenfleet.operator.fleet_scrape import http_port

# At most this many pods are asked and reported (a large scale-up shows its first pods; the rest are alike).
MAX_REPORTED_PODS = 8
# The /ready answer that is read: a progress body is a few hundred bytes.
MAX_BODY_BYTES = 64 << 10
# Fields of a fetch's progress that the status carries: its name there (camelCase) and its type (a value of
# another type is dropped: the CRD's schema would refuse the whole status write).
_FETCH_FIELDS: dict[str, tuple[str, type]] = {
    "bytes": ("bytes", int),
    "total": ("totalBytes", int),
    "percent": ("percent", float),
    "attempt": ("attempt", int),
    "file": ("file", str),
    "reason": ("message", str),
    "cache": ("cache", str),
}


def pod_ready(pod: Mapping[str, Any]) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def _started(pod: Mapping[str, Any]) -> bool:
    """Its startup probe passed (the model is loaded): not Ready now for another reason — asleep, draining,
    failing — which the autoscaler's status and the conditions tell, not this one."""
    statuses = (pod.get("status") or {}).get("containerStatuses") or []
    return bool(statuses) and all(cs.get("started") for cs in statuses)


def loading_targets(pods: list[Mapping[str, Any]], default_port: int) -> list[tuple[str, str]]:
    """(pod name, its /ready URL) for each pod on its way to Ready: not Ready, not leaving, not finished, with
    an IP (the fetch and the server are only reachable once the pod has one). By name, at most
    MAX_REPORTED_PODS."""
    out = []
    for pod in sorted(pods, key=lambda p: p["metadata"]["name"]):
        status = pod.get("status") or {}
        if pod["metadata"].get("deletionTimestamp") or status.get("phase") in ("Succeeded", "Failed"):
            continue
        ip = status.get("podIP")
        if not ip or pod_ready(pod) or _started(pod):
            continue
        host = f"[{ip}]" if ":" in ip else ip
        out.append((pod["metadata"]["name"], f"http://{host}:{http_port(pod, default_port)}/ready"))
    return out[:MAX_REPORTED_PODS]


def loading_entry(pod: str, body: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """One pod's `status.loading` entry from its /ready answer (`body` None: no answer — a pod whose process
    has not opened its port yet, or one too busy to answer); None when the answer says it is past loading."""
    if not isinstance(body, Mapping):
        return {"pod": pod, "stage": "starting"}
    progress = body.get("progress")
    progress = progress if isinstance(progress, Mapping) else {}
    state = body.get("status")
    if state == "fetching":
        entry: dict[str, Any] = {"pod": pod, "stage": str(progress.get("phase") or "download")}
        for key, (name, kind) in _FETCH_FIELDS.items():
            value = progress.get(key)
            if kind is str:
                if isinstance(value, str) and value:
                    entry[name] = value[:300]
            elif isinstance(value, (int, float)) and not isinstance(value, bool):
                entry[name] = round(float(value), 1) if kind is float else int(value)
        return entry
    if state == "loading":
        entry = {"pod": pod, "stage": "load"}
        weights = progress.get("weights")
        if isinstance(weights, Mapping):
            for key, name in (("done", "weightsLoaded"), ("total", "weightsTotal")):
                if isinstance(weights.get(key), int):
                    entry[name] = weights[key]
            if isinstance(weights.get("percent"), (int, float)):
                entry["percent"] = round(float(weights["percent"]), 1)
        return entry
    # Another answer (ready by now, asleep, draining): past loading, so not reported here.
    return None


def loading_status(entries: list[dict[str, Any] | None]) -> list[dict[str, Any]] | None:
    """`status.loading`: the entries, or None (the field removed) when no pod is on its way."""
    return [e for e in entries if e is not None] or None
