"""`status.autoscaling` of a ModelDeployment: the autoscaler's decision as written, and its memory read back.

Pure functions. The policy's `History` lives in the resource's status rather than in the operator's memory,
so a restarted operator (or a second one after a failover) continues the same stabilisation windows and
cooldowns instead of starting blind. Times are RFC 3339 with microseconds (the policy's windows can be a few
seconds long); the policy itself works on epoch seconds.

Recommendations are stored with runs of equal values merged into their newest entry. That loses nothing:
the policy only asks "which values were recommended within the last W seconds", and a value is in such a
window exactly when the newest entry of its run is. It keeps the list short under steady load.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from typing import Any

from tokenfleet.operator.autoscaling_policy import Decision, History

# The CRD bounds the list (api.AutoscalingHistory); past it the oldest entries go first.
MAX_RECOMMENDATIONS = 256


def to_rfc3339(t: float) -> str:
    return dt.datetime.fromtimestamp(t, dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def from_rfc3339(text: str) -> float:
    return dt.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def _time(value: Any) -> float | None:
    if not isinstance(value, str) or not value:
        return None
    try:
        return from_rfc3339(value)
    except ValueError:
        return None  # edited by hand into something else: forget it rather than fail every decision


def merge_runs(recommendations: tuple[tuple[float, int], ...]) -> tuple[tuple[float, int], ...]:
    """Keep only the newest entry of each run of equal recommendations (oldest first, as the policy keeps them)."""
    out: list[tuple[float, int]] = []
    for t, r in recommendations:
        if out and out[-1][1] == r:
            out[-1] = (t, r)
        else:
            out.append((t, r))
    return tuple(out[-MAX_RECOMMENDATIONS:])


def history_from_status(autoscaling: Mapping[str, Any] | None) -> History:
    """The policy's memory from `status.autoscaling` (empty when there is none or it is unreadable)."""
    stored = (autoscaling or {}).get("history") or {}
    recs = []
    for item in stored.get("recommendations") or []:
        t = _time(item.get("time")) if isinstance(item, Mapping) else None
        if t is not None and isinstance(item.get("replicas"), int):
            recs.append((t, item["replicas"]))
    return History(
        recommendations=tuple(sorted(recs)),
        last_scale_up_time=_time(stored.get("lastScaleUpTime")),
        last_scale_down_time=_time(stored.get("lastScaleDownTime")),
        last_traffic_time=_time(stored.get("lastTrafficTime")),
    )


def history_to_status(history: History) -> dict[str, Any]:
    def stamp(t: float | None) -> str | None:
        return None if t is None else to_rfc3339(t)

    return {
        "recommendations": [
            {"time": to_rfc3339(t), "replicas": r} for t, r in merge_runs(history.recommendations)
        ],
        "lastScaleUpTime": stamp(history.last_scale_up_time),
        "lastScaleDownTime": stamp(history.last_scale_down_time),
        "lastTrafficTime": stamp(history.last_traffic_time),
    }


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part.title() for part in rest)


def autoscaling_status(
    decision: Decision,
    previous: Mapping[str, Any] | None,
    scaled: bool,
    now: float,
    observed: Mapping[str, float] | None = None,
    cold_start: float | None = None,
) -> dict[str, Any]:
    """`status.autoscaling` after a decision, as a merge patch over `previous` (signals that are gone since are
    set to null, so they are removed); `scaled`: the decision changed the replica count. `observed`: figures
    the caller saw besides the policy's own (which win on a clash), e.g. pending requests at zero replicas.
    `cold_start`: the newest Ready pod's creation-to-Ready seconds (kept from `previous` at zero pods)."""
    previous = previous or {}
    merged = {**(observed or {}), **decision.signals}
    signals: dict[str, float | None] = {_camel(k): float(v) for k, v in sorted(merged.items())}
    signals |= {k: None for k in previous.get("signals") or {} if k not in signals}
    return {
        "desiredReplicas": decision.replicas,
        "recommendation": decision.recommendation,
        "reason": decision.reason,
        "lastDecisionTime": to_rfc3339(now),
        "lastScaleTime": to_rfc3339(now) if scaled else previous.get("lastScaleTime"),
        "lastScaleReason": decision.reason if scaled else previous.get("lastScaleReason"),
        "signals": signals,
        "coldStartSeconds": round(cold_start, 1)
        if cold_start is not None
        else previous.get("coldStartSeconds"),
        "history": history_to_status(decision.history),
    }
