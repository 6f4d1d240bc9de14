"""The pod-deletion-cost of each pod before a scale-down: its requests in flight (pure)."""

from __future__ import annotations

from tokenfleet.operator.autoscaling_policy import PodSample, PodState
from tokenfleet.operator.deletion_cost import POD_DELETION_COST, cost_annotations, deletion_costs


def test_the_cost_is_the_requests_in_flight_of_each_ready_pod():
    samples = (
        PodSample("busy", PodState.READY, num_waiting=2, num_running=6, kv_cache_usage=0.9),
        PodSample("idle", PodState.READY, output_tokens_per_second=0.0),
        PodSample("queued", PodState.READY, num_waiting=1.4, num_running=0.0),
        PodSample("cold", PodState.STARTING),
        PodSample("dark", PodState.UNKNOWN),
    )
    costs = deletion_costs(samples)
    assert costs == {"busy": 8, "idle": 0, "queued": 1}
    # The idlest pod is the one the ReplicaSet removes first (lowest cost).
    assert min(costs, key=costs.get) == "idle"


def test_only_pods_whose_annotation_differs_are_written():
    def pod(name: str, cost: str | None = None) -> dict:
        annotations = {POD_DELETION_COST: cost} if cost is not None else None
        return {"metadata": {"name": name, "annotations": annotations}}

    pods = [pod("a", "3"), pod("b", "1"), pod("c"), pod("gone-from-costs", "9")]
    assert cost_annotations(pods, {"a": 3, "b": 0, "c": 7}) == {"b": "0", "c": "7"}
    assert cost_annotations([], {"a": 1}) == {}
