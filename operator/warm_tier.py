"""The warm tier: with `autoscaling.idle: sleep`, pods the fleet no longer needs sleep instead of leaving.

The policy (autoscaling_policy.py) decides how many pods should be *awake*; this module turns that into the
Deployment's count and into the pods to put to sleep or wake — a pure function (`plan`), so the operator
and the tests ask it the same question. A sleeping pod keeps its process and (level 1) its weights in host
memory, frees its KV cache and device memory, and wakes in about a second instead of a cold start (new pod,
image, model load, warm-up); it still holds its GPUs, so the pool is bounded (`warmPoolSize`).

- Scale-up wakes sleeping pods first; only the rest are new pods. (The router wakes one on its own as soon
  as it holds a request no awake pod can take: demand does not wait for this timer.)
- Scale-down puts idle Ready pods to sleep while the pool has room, and removes the rest by lowering the
  count. A sleeping pod is not Ready, and a ReplicaSet removes not-Ready pods first, so a lowered count takes
  sleeping pods before awake ones: the count and the sleeps are never changed in the same decision (the
  next decision puts the surplus awake pods to sleep), and a pool already full is refilled from the awake
  pods that are left rather than kept from older sleepers.
- Only pods with nothing running or waiting are put to sleep (a sleep waits for requests in flight, and
  the decision that sent it must not hold up the next one).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tokenfleet.operator.autoscaling_policy import AutoscalingSpec, PodSample, PodState


@dataclass(frozen=True, slots=True)
class WarmPlan:
    replicas: int  # the Deployment's count: awake pods wanted plus the pods kept asleep
    sleep: tuple[str, ...] = ()  # pods to put to sleep now
    wake: tuple[str, ...] = ()  # sleeping pods to wake now


def awake_count(written: int, samples: Sequence[PodSample]) -> int:
    """Pods that are (or will be) awake: the count last written, less the pods that sleep."""
    return max(0, written - sum(s.state is PodState.SLEEPING for s in samples))


def plan(desired: int, written: int, samples: Sequence[PodSample], spec: AutoscalingSpec) -> WarmPlan:
    """The count to write and the pods to sleep or wake so that `desired` pods are awake.

    `written`: the Deployment's count as the autoscaler last wrote it (awake and asleep pods, including
    pods not created yet); `samples`: the pods as observed, sleeping ones as PodState.SLEEPING.
    """
    asleep = sorted(s.pod for s in samples if s.state is PodState.SLEEPING)
    if spec.idle != "sleep":
        return WarmPlan(desired)
    awake = awake_count(written, samples)
    if desired > awake:
        wake = tuple(asleep[: desired - awake])
        return WarmPlan(desired + len(asleep) - len(wake), wake=wake)
    surplus = awake - desired
    keep_asleep = min(spec.warm_pool, len(asleep) + surplus)
    replicas = desired + keep_asleep
    if replicas < written:
        return WarmPlan(replicas)
    room = max(0, spec.warm_pool - len(asleep))
    idle = sorted(
        s.pod for s in samples if s.state is PodState.READY and s.num_running == 0 and s.num_waiting == 0
    )
    return WarmPlan(written, sleep=tuple(idle[: min(surplus, room)]))
