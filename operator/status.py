"""Pure status computation: (what the reconcile found, the Deployment as stored) -> ModelDeployment status.

Phase: Failed (the spec can never work as written), Pending (waiting for a referenced policy), Progressing
(pods are being created or rolled), Ready (every desired replica ready on the current template), Degraded
(some but not all replicas ready and the rollout is not moving, or the rollout missed its deadline).
Conditions Ready / ConfigValid / PoliciesResolved follow the Kubernetes conventions: a reason in
CamelCase, a human message, and lastTransitionTime that only moves when the status flips (so a status
written again with the same content is byte-identical and not written at all).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class ReconcileOutcome:
    """What the reconcile learned before looking at the pods."""

    config_error: str | None = None  # the spec is invalid (schema could not catch it)
    missing_policies: tuple[str, ...] = ()  # e.g. ("CachePolicy/fast",)
    desired_replicas: int = 0
    selector: str | None = None
    endpoint: str | None = None
    config_hash: str | None = None


def _condition(
    ctype: str, ok: bool, reason: str, message: str, generation: int, previous: list[dict[str, Any]], now: str
) -> dict[str, Any]:
    status = "True" if ok else "False"
    before = next((c for c in previous if c.get("type") == ctype), None)
    since = before.get("lastTransitionTime") if before and before.get("status") == status else None
    return {
        "type": ctype,
        "status": status,
        "reason": reason,
        "message": message,
        "lastTransitionTime": since or now,
        "observedGeneration": generation,
    }


def rollout_state(deployment: dict[str, Any] | None, desired: int) -> tuple[str, int, int, str]:
    """(phase, replicas, readyReplicas, message) from a Deployment as the API server stores it."""
    if deployment is None:
        return "Progressing", 0, 0, "waiting for the Deployment to be created"
    status = deployment.get("status") or {}
    replicas = int(status.get("replicas") or 0)
    ready = int(status.get("readyReplicas") or 0)
    updated = int(status.get("updatedReplicas") or 0)
    seen = int(status.get("observedGeneration") or 0) >= int(deployment["metadata"].get("generation") or 0)
    conditions = {c.get("type"): c for c in status.get("conditions") or []}
    deadline = conditions.get("Progressing", {}).get("reason") == "ProgressDeadlineExceeded"
    if desired == 0:
        return "Ready", replicas, ready, "scaled to zero"
    if seen and ready >= desired and updated >= desired:
        return "Ready", replicas, ready, f"{ready}/{desired} replicas ready"
    if deadline:
        phase = "Degraded" if ready else "Failed"
        return phase, replicas, ready, f"rollout exceeded its progress deadline ({ready}/{desired} ready)"
    if ready and seen and updated >= desired:
        return "Degraded", replicas, ready, f"only {ready}/{desired} replicas ready"
    return "Progressing", replicas, ready, f"{ready}/{desired} replicas ready, rollout in progress"


# Container states that keep a pod from ever becoming ready on its own: worth naming in the status.
_STUCK = frozenset({"CrashLoopBackOff", "CreateContainerConfigError", "CreateContainerError", "RunContainerError",
                    "ErrImagePull", "ImagePullBackOff", "InvalidImageName"})  # fmt: skip
_MESSAGE_CHARS = 600


def pod_trouble(pods: list[dict[str, Any]]) -> tuple[str, str] | None:
    """(reason, message) for the first pod (by name) that is stuck: a container in CrashLoopBackOff or
    another stuck state (with its last termination message), or a pod the scheduler cannot place (with the
    scheduler's reason). None when every pod is merely on its way."""
    for pod in sorted(pods, key=lambda p: p["metadata"]["name"]):
        if pod["metadata"].get("deletionTimestamp"):
            continue
        name, status = pod["metadata"]["name"], pod.get("status") or {}
        for cs in [*(status.get("initContainerStatuses") or []), *(status.get("containerStatuses") or [])]:
            waiting = (cs.get("state") or {}).get("waiting") or {}
            if waiting.get("reason") in _STUCK:
                last = (cs.get("lastState") or {}).get("terminated") or {}
                said = (last.get("message") or waiting.get("message") or "").strip()[-_MESSAGE_CHARS:]
                code = f" (exit code {last['exitCode']})" if "exitCode" in last else ""
                return waiting[
                    "reason"
                ], f"pod {name}: container {cs['name']} {waiting['reason']}{code}: {said}"
        for cond in status.get("conditions") or []:
            if cond.get("type") == "PodScheduled" and cond.get("status") == "False":
                return cond.get("reason") or "Unschedulable", f"pod {name}: {cond.get('message', '')}"
    return None


def model_deployment_status(
    outcome: ReconcileOutcome,
    deployment: dict[str, Any] | None,
    generation: int,
    previous: dict[str, Any] | None,
    now: str,
    pods: list[dict[str, Any]] = (),  # type: ignore[assignment]
) -> dict[str, Any]:
    """The whole `status` (camelCase) to write; equal inputs give an equal dict."""
    prev_conditions = list((previous or {}).get("conditions") or [])

    def cond(ctype: str, ok: bool, reason: str, message: str) -> dict[str, Any]:
        return _condition(ctype, ok, reason, message, generation, prev_conditions, now)

    base = {
        "observedGeneration": generation,
        "selector": outcome.selector,
        "endpoint": outcome.endpoint,
        "configHash": outcome.config_hash,
    }
    if outcome.config_error is not None:
        return {
            **base,
            "phase": "Failed",
            "replicas": 0,
            "readyReplicas": 0,
            "conditions": [
                cond("Ready", False, "InvalidSpec", outcome.config_error),
                cond("ConfigValid", False, "InvalidSpec", outcome.config_error),
                cond("PoliciesResolved", False, "InvalidSpec", "not checked: the spec is invalid"),
            ],
        }
    if outcome.missing_policies:
        message = "referenced policies not found: " + ", ".join(outcome.missing_policies)
        return {
            **base,
            "phase": "Pending",
            "replicas": 0,
            "readyReplicas": 0,
            "conditions": [
                cond("Ready", False, "PolicyNotFound", message),
                cond("ConfigValid", True, "Valid", "the spec is valid"),
                cond("PoliciesResolved", False, "PolicyNotFound", message),
            ],
        }
    phase, replicas, ready, message = rollout_state(deployment, outcome.desired_replicas)
    reason = {"Ready": "ReplicasReady", "Progressing": "RollingOut", "Degraded": "ReplicasUnavailable"}
    # Not ready because a pod is stuck: say why (the container's last words, the scheduler's reason).
    trouble = pod_trouble(list(pods)) if phase != "Ready" else None
    if trouble is not None:
        reason = {phase: trouble[0]}
        message = f"{message}; {trouble[1]}"
    return {
        **base,
        "phase": phase,
        "replicas": replicas,
        "readyReplicas": ready,
        "conditions": [
            cond("Ready", phase == "Ready", reason.get(phase, "RolloutFailed"), message),
            cond("ConfigValid", True, "Valid", "the spec is valid"),
            cond("PoliciesResolved", True, "Resolved", "every referenced policy exists"),
        ],
    }


def status_changed(previous: dict[str, Any] | None, new: dict[str, Any]) -> bool:
    """True when writing `new` would change what is stored (unset keys count as None)."""
    previous = previous or {}
    return any(previous.get(key) != value for key, value in new.items())


COLD_START_COVERED = "QueueTimeoutCoversColdStart"


def cold_start_coverage(queue_timeout: float, cold_starts: dict[str, float | None]) -> dict[str, str] | None:
    """A RoutingPolicy's condition on its ModelDeployments that may scale to zero: does a request held while
    one wakes outlast the cold start measured on it (`status.autoscaling.coldStartSeconds`)? None when
    no deployment behind the policy may scale to zero."""
    if not cold_starts:
        return None
    short = {md: c for md, c in sorted(cold_starts.items()) if c is not None and c >= queue_timeout}
    if short:
        worst = ", ".join(f"{md} {c:.0f}s" for md, c in short.items())
        return {
            "type": COLD_START_COVERED,
            "status": "False",
            "reason": "QueueTimeoutBelowColdStart",
            "message": f"queueTimeoutSeconds {queue_timeout:g} is not longer than the measured cold start of "
            f"{worst} (plus up to one autoscaler interval): a request that wakes it from zero times out (503) "
            "before a pod is ready; raise queueTimeoutSeconds or keep minReplicas >= 1",
        }
    unknown = sorted(md for md, c in cold_starts.items() if c is None)
    if unknown:
        return {
            "type": COLD_START_COVERED,
            "status": "Unknown",
            "reason": "NotMeasured",
            "message": f"no cold start measured yet for {', '.join(unknown)}",
        }
    return {
        "type": COLD_START_COVERED,
        "status": "True",
        "reason": "Covered",
        "message": f"queueTimeoutSeconds {queue_timeout:g} covers every measured cold start",
    }


def policy_status(
    generation: int,
    used_by: list[str],
    endpoint: str | None,
    error: str | None,
    routers: list[dict[str, Any]] | None = None,
    covered: dict[str, str] | None = None,
) -> dict[str, Any]:
    extra = {} if routers is None else {"routers": routers}  # RoutingPolicy: generation per router pod
    conditions = [
        {
            "type": "ConfigValid",
            "status": "False" if error else "True",
            "reason": "InvalidSpec" if error else "Valid",
            "message": error or "the spec is valid",
            "observedGeneration": generation,
        }
    ]
    if covered is not None:
        conditions.append({**covered, "observedGeneration": generation})
    return {
        **extra,
        "observedGeneration": generation,
        "usedBy": sorted(used_by),
        "endpoint": endpoint,
        "conditions": conditions,
    }
