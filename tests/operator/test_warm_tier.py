"""The warm tier's plan: how many pods the Deployment keeps and which pods sleep or wake (pure)."""

from __future__ import annotations

import pytest
from tokenfleet.operator.api import parse_model_deployment
from tokenfleet.operator.autoscaling_policy import AutoscalingSpec, PodSample, PodState
from tokenfleet.operator.builders import build_runtime_config
from tokenfleet.operator.warm_tier import WarmPlan, plan
from tokenfleet.runtime.errors import ConfigError


def spec(**extra) -> AutoscalingSpec:
    return AutoscalingSpec.model_validate(
        {"minReplicas": 0, "maxReplicas": 8, "targets": {"kvCacheUsage": 0.8}, "idle": "sleep", **extra}
    )


def pods(ready: int = 0, busy: int = 0, asleep: int = 0, starting: int = 0) -> list[PodSample]:
    out = [PodSample(f"r{i}", PodState.READY) for i in range(ready)]
    out += [PodSample(f"b{i}", PodState.READY, num_running=1) for i in range(busy)]
    out += [PodSample(f"s{i}", PodState.SLEEPING) for i in range(asleep)]
    out += [PodSample(f"c{i}", PodState.STARTING) for i in range(starting)]
    return out


def test_scale_down_sleeps_idle_pods_while_the_pool_has_room():
    assert plan(1, 3, pods(ready=3), spec(warmPoolSize=2)) == WarmPlan(3, sleep=("r0", "r1"))
    # Busy pods are never chosen; with none idle nothing sleeps this time.
    assert plan(1, 3, pods(ready=1, busy=2), spec(warmPoolSize=2)) == WarmPlan(3, sleep=("r0",))
    assert plan(0, 1, pods(busy=1), spec()) == WarmPlan(1)


def test_a_full_pool_lowers_the_count_and_never_sleeps_in_the_same_decision():
    # 3 awake, 1 asleep, pool 1, 1 wanted: 2 pods stay (1 awake + 1 asleep); the ReplicaSet removes the
    # sleeper first, and a later decision puts a surplus awake pod to sleep.
    assert plan(1, 4, pods(ready=3, asleep=1), spec()) == WarmPlan(2)
    assert plan(1, 2, pods(ready=2), spec()) == WarmPlan(2, sleep=("r0",))
    # A pool shrunk by an edit: sleepers beyond it go.
    assert plan(1, 4, pods(ready=1, asleep=3), spec(warmPoolSize=1)) == WarmPlan(2)
    assert plan(0, 2, pods(asleep=2), spec(warmPoolSize=0)) == WarmPlan(0)


def test_scale_up_wakes_sleepers_before_it_adds_pods():
    assert plan(2, 3, pods(ready=1, asleep=2), spec(warmPoolSize=2)) == WarmPlan(3, wake=("s0",))
    assert plan(4, 3, pods(ready=1, asleep=2), spec(warmPoolSize=2)) == WarmPlan(4, wake=("s0", "s1"))
    # Pods not created yet count as awake (the count already asked for them).
    assert plan(3, 4, pods(ready=1, asleep=1, starting=1), spec()) == WarmPlan(4)


def test_steady_keeps_everything_and_idle_zero_is_the_plain_count():
    assert plan(2, 3, pods(ready=2, asleep=1), spec()) == WarmPlan(3)
    zero = AutoscalingSpec.model_validate({"maxReplicas": 8, "targets": {"kvCacheUsage": 0.8}})
    assert plan(1, 3, pods(ready=3), zero) == WarmPlan(1)
    assert zero.warm_pool == 0 and spec().warm_pool == 1 and spec().level == 1


def test_sleep_mode_is_on_exactly_when_the_autoscaler_keeps_a_warm_tier():
    def sleep_mode(autoscaling: dict | None) -> bool:
        md = {"routingPolicyRef": "front"} | ({"autoscaling": autoscaling} if autoscaling else {})
        return build_runtime_config(parse_model_deployment(md), None).server.enable_sleep_mode

    base = {"maxReplicas": 3, "targets": {"kvCacheUsage": 0.8}}
    assert sleep_mode(base | {"idle": "sleep", "sleepLevel": 2})
    assert not sleep_mode(base) and not sleep_mode(None)


def test_a_role_cannot_sleep():
    role = {"autoscaling": {"maxReplicas": 3, "targets": {"kvCacheUsage": 0.8}, "idle": "sleep"}}
    with pytest.raises(ConfigError, match="idle: sleep is for aggregated deployments"):
        parse_model_deployment({"disaggregation": {"prefill": {}, "decode": role}})
