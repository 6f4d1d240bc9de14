"""The autoscaling policy as tables: each scenario is a sequence of periods (time, pod figures) -> replicas.

A scenario replays `decide` the way the operator does (the returned history feeds the next call, the
decided count becomes the next `current`), so stabilisation windows, cooldowns and steps are exercised
across time, not only one call at a time.
"""

from __future__ import annotations

import itertools

import pytest
from pydantic import ValidationError
from tokenfleet.operator.autoscaling_policy import (
    AutoscalingSpec,
    History,
    PodSample,
    PodState,
    decide,
    demand_calls_decision,
)

READY, STARTING, UNKNOWN = PodState.READY, PodState.STARTING, PodState.UNKNOWN


def spec(**kw) -> AutoscalingSpec:
    base = {
        "minReplicas": 1,
        "maxReplicas": 10,
        "targets": {"waitingRequestsPerReplica": 4},
        "scaleUp": {"stabilizationWindowSeconds": 0, "maxStep": 4, "cooldownSeconds": 0},
        "scaleDown": {"stabilizationWindowSeconds": 60, "maxStep": 1, "cooldownSeconds": 30},
        "scaleToZeroAfterSeconds": 120,
    }
    base.update(kw)
    return AutoscalingSpec.model_validate(base)


def pods(n: int, waiting: float = 0, running: float = 0, state: PodState = READY, **kw) -> list[PodSample]:
    return [PodSample(f"p{i}", state, num_waiting=waiting, num_running=running, **kw) for i in range(n)]


def replay(s: AutoscalingSpec, start: int, periods) -> list[int]:
    """periods: [(now, samples_for(current) or list, pending)] -> replicas after each period."""
    current, history, out = start, History(), []
    for now, samples, pending in periods:
        got = samples(current) if callable(samples) else samples
        d = decide(current, got, s, history, now, pending_requests=pending)
        current, history = d.replicas, d.history
        out.append(current)
    return out


def test_spike_scales_up_at_once_bounded_by_max_step_and_max_replicas():
    s = spec()
    # 2 pods with 20 waiting each at target 4 -> 10 wanted; step 4 per period; capped at maxReplicas.
    got = replay(s, 2, [(t, lambda c: pods(c, waiting=40 / c), 0) for t in (0, 15, 30, 45)])
    assert got == [6, 10, 10, 10]
    d = decide(2, pods(2, waiting=20), s, History(), 0.0)
    assert d.reason.startswith("scale up 2->6: waiting_requests_per_replica")


def test_slow_ramp_follows_load_one_step_at_a_time():
    s = spec()
    # Total waiting grows 2 per period: recommendations ceil(total / 4), within tolerance no change.
    got = replay(s, 1, [(t * 15, lambda c, t=t: pods(c, waiting=(4 + 2 * t) / c), 0) for t in range(8)])
    assert got == [1, 2, 2, 3, 3, 4, 4, 5]
    assert all(b >= a for a, b in itertools.pairwise(got))


def test_within_tolerance_nothing_moves():
    s = spec()
    d = decide(4, pods(4, waiting=4.3), s, History(), 0.0)  # ratio 1.075 <= 1.1
    assert d.replicas == 4 and d.reason.startswith("steady")


def test_flapping_load_never_shrinks_within_the_window():
    s = spec()
    # High every other period: the scale-down window (60 s) always holds a high recommendation.
    periods = [
        (t * 15, lambda c, t=t: pods(c, waiting=(24 if t % 2 == 0 else 0) / c, running=1), 0)
        for t in range(12)
    ]
    got = replay(s, 6, periods)
    assert got == [6] * 12


def test_scale_down_waits_for_the_window_then_one_step_per_cooldown():
    s = spec()
    idle = lambda c: pods(c, running=1)  # noqa: E731 - traffic, but nothing waiting: recommends the floor
    got = replay(s, 4, [(t, idle, 0) for t in range(0, 181, 15)])
    # t=0..45: the window (60 s) still holds the first period's 4; t=60 -> 3; cooldown 30 s per step.
    assert got == [4, 4, 4, 4, 3, 3, 2, 2, 1, 1, 1, 1, 1]


def test_missing_data_never_scales_down():
    s = spec()
    history = History(recommendations=((0.0, 1),), last_traffic_time=0.0)
    samples = [*pods(2, running=1), PodSample("p2", UNKNOWN)]
    d = decide(3, samples, s, history, 500.0)
    assert d.replicas == 3 and "unknown" in d.reason
    # A pod the caller expects but sent nothing for is unknown as well.
    d = decide(3, pods(2, running=1), s, history, 500.0)
    assert d.replicas == 3
    # Unknown pods do not stop a scale-up driven by the pods that do report.
    d = decide(3, [*pods(2, waiting=20), PodSample("p2", UNKNOWN)], s, History(), 0.0)
    assert d.replicas == 7


def test_missing_data_blocks_scale_to_zero():
    s = spec(minReplicas=0)
    history = History(last_traffic_time=0.0)
    d = decide(1, [PodSample("p0", UNKNOWN)], s, history, 1000.0)
    assert d.replicas == 1


def test_cold_starting_pods_count_as_capacity_on_the_way():
    s = spec()
    # Burst: 1 ready pod with 20 waiting -> 5 wanted. Next periods the 4 new pods are still starting and the
    # queue has grown a little: still ~5 wanted, so nothing more is ordered while they boot.
    first = decide(1, pods(1, waiting=20), s, History(), 0.0)
    assert first.replicas == 5
    starting = pods(1, waiting=22) + [PodSample(f"s{i}", STARTING) for i in range(4)]
    second = decide(5, starting, s, first.history, 15.0)
    assert second.replicas == 6  # ceil(22 / 4): only the growth is added, not another 5
    # Only starting pods: no figures, no change either way.
    third = decide(3, [PodSample(f"s{i}", STARTING) for i in range(3)], s, History(), 0.0)
    assert third.replicas == 3


def test_scale_to_zero_after_idle_time_and_back_on_demand():
    s = spec(minReplicas=0)
    idle = lambda c: pods(c)  # noqa: E731
    busy = lambda c: pods(c, running=2)  # noqa: E731
    cold = [PodSample("p0", STARTING)]
    periods = [
        (0, busy, 0),
        (30, busy, 0),
        (90, idle, 0),
        (140, idle, 0),  # idle for 110 s < 120 s: stays
        (155, idle, 0),  # 125 s: to zero
        (170, [], 0),  # nothing pending: stays at zero
        (175, [], 3),  # demand: 0 -> 1 at once
        (190, cold, 0),  # the pod is cold-starting: nothing changes
    ]
    assert replay(s, 1, periods) == [1, 1, 1, 1, 0, 0, 1, 1]
    d = decide(1, pods(1), s, History(last_traffic_time=30.0), 151.0)
    assert d.replicas == 0 and "no traffic for 121s" in d.reason
    up = decide(0, [], s, d.history, 201.0, pending_requests=1)
    assert up.replicas == 1 and "pending" in up.reason


def test_pending_requests_count_as_traffic():
    s = spec(minReplicas=0)
    history = History(last_traffic_time=0.0)
    d = decide(1, pods(1), s, history, 500.0, pending_requests=2)
    assert d.replicas == 1
    assert d.history.last_traffic_time == 500.0


def test_requests_held_by_the_router_count_as_waiting():
    s = spec()
    # Pods at their in-flight limit queue little themselves; the router holds the rest.
    d = decide(2, pods(2, waiting=1, running=8), s, History(), 0.0, pending_requests=30)
    assert d.replicas == 6 and d.signals["waiting_per_replica"] == 16


def test_min_replicas_floor_and_zero_to_min():
    s = spec(minReplicas=2)
    assert decide(0, [], s, History(), 0.0).replicas == 2
    d = decide(2, pods(2), s, History(recommendations=((0.0, 2),)), 500.0)
    assert d.replicas == 2


def test_kv_cache_target_sizes_both_ways():
    s = spec(targets={"kvCacheUsage": 0.5}, scaleDown={"stabilizationWindowSeconds": 0, "maxStep": 8})
    assert decide(2, pods(2, kv_cache_usage=0.9, running=5), s, History(), 0.0).replicas == 4
    assert decide(4, pods(4, kv_cache_usage=0.1, running=1), s, History(), 0.0).replicas == 1


def test_ttft_slo_scales_up_only():
    s = spec(
        targets={"ttft": {"percentile": 0.9, "seconds": 2.0}}, scaleDown={"stabilizationWindowSeconds": 0}
    )
    slow = pods(2, running=3, ttft_seconds=5.0)
    assert decide(2, slow, s, History(), 0.0).replicas == 5  # ceil(2 * 5 / 2)
    fast = pods(4, running=3, ttft_seconds=0.1)
    d = decide(4, fast, s, History(), 0.0)
    assert d.replicas == 4 and "abstain" in d.reason
    # No request in the window on any pod: no TTFT figure, nothing to say.
    assert decide(2, pods(2, running=1), s, History(), 0.0).replicas == 2


def test_largest_target_wins():
    s = spec(targets={"waitingRequestsPerReplica": 4, "outputTokensPerSecondPerReplica": 100})
    d = decide(2, pods(2, waiting=4, output_tokens_per_second=300), s, History(), 0.0)
    assert d.replicas == 6 and "output_tokens_per_second" in d.reason


def test_scale_up_stabilisation_window_needs_a_sustained_rise():
    s = spec(scaleUp={"stabilizationWindowSeconds": 30, "maxStep": 10})
    got = replay(
        s, 2, [(0, pods(2, running=1), 0), (15, pods(2, waiting=20), 0), (45, pods(2, waiting=20), 0)]
    )
    assert got == [2, 2, 10]


def test_scale_up_cooldown():
    s = spec(scaleUp={"maxStep": 2, "cooldownSeconds": 30})
    got = replay(s, 1, [(t, lambda c: pods(c, waiting=40 / c), 0) for t in (0, 15, 30, 45, 60)])
    assert got == [3, 3, 5, 5, 7]


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        ({"minReplicas": 3, "maxReplicas": 2, "targets": {"kvCacheUsage": 0.5}}, "minReplicas"),
        ({"minReplicas": 0, "maxReplicas": 2, "targets": {}}, "targets"),
        ({"maxReplicas": 2, "targets": {"kvCacheUsage": 1.5}}, "kvCacheUsage"),
        (
            {"maxReplicas": 2, "targets": {"waitingRequestsPerReplica": 1}, "scaleUp": {"maxStep": 0}},
            "maxStep",
        ),
    ],
)
def test_invalid_specs_name_the_field(raw, field):
    with pytest.raises(ValidationError) as e:
        AutoscalingSpec.model_validate(raw)
    assert field in str(e.value)


def test_demand_between_decisions_calls_for_one_only_when_more_may_be_needed():
    s = spec(minReplicas=0, maxReplicas=4, targets={"waitingRequestsPerReplica": 2})
    assert demand_calls_decision(0, 1, 0, s)  # held at zero
    assert not demand_calls_decision(0, 0, 0, s)
    assert demand_calls_decision(2, 1, 0, s)  # held behind busy pods
    # The pods' queues against the target, with its tolerance (10 %): 2 pods x 2 = 4.4 at most.
    assert not demand_calls_decision(2, 0, 4, s)
    assert demand_calls_decision(2, 0, 5, s)
    assert not demand_calls_decision(4, 9, 50, s)  # at maxReplicas a decision could only repeat itself
    kv_only = spec(targets={"kvCacheUsage": 0.7})
    assert not demand_calls_decision(1, 0, 50, kv_only)  # no waiting target: only held requests count
    assert demand_calls_decision(1, 1, 0, kv_only)
