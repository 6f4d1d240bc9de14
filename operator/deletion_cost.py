"""Which pods a scale-down removes: the idlest, through the ReplicaSet's pod-deletion-cost annotation.

When a ReplicaSet shrinks it deletes unscheduled, then pending, then not-ready pods first; among Ready
pods, the one with the lowest `controller.kubernetes.io/pod-deletion-cost` goes first. Without the
annotation the choice ignores load, so a scale-down may remove the pod with the most streams in flight
(each then drains, or is handed back and resumed on another pod: latency and recomputed prompts). Before
the autoscaler lowers the count it sets each Ready pod's cost to its in-flight requests (running +
waiting, from the scrape the decision was made from), so the idlest pods go.

Pure: `deletion_costs` from the policy's samples, `cost_annotations` the writes still needed (a pod whose
annotation already holds its cost is not written again).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from tokenfleet.operator.autoscaling_policy import PodSample, PodState

POD_DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
# The annotation is an int32; a pod never has anywhere near this many requests in flight.
MAX_COST = 2**31 - 1


def deletion_costs(samples: Sequence[PodSample]) -> dict[str, int]:
    """Each Ready pod's deletion cost: its requests in flight (running + waiting), rounded.

    Pods without figures (starting, unknown) get none: the ReplicaSet removes not-ready pods first anyway,
    and a scale-down is never decided while a Ready pod's figures are unknown.
    """
    return {
        s.pod: min(MAX_COST, round(s.num_running + s.num_waiting))
        for s in samples
        if s.state is PodState.READY
    }


def cost_annotations(pods: Iterable[Mapping[str, Any]], costs: Mapping[str, int]) -> dict[str, str]:
    """{pod name: cost} to write: the pods of `costs` whose annotation does not hold their cost yet."""
    out = {}
    for pod in pods:
        meta = pod["metadata"]
        name = meta["name"]
        if name not in costs:
            continue
        value = str(costs[name])
        if (meta.get("annotations") or {}).get(POD_DELETION_COST) != value:
            out[name] = value
    return out
