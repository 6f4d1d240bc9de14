"""The autoscaling policy: one pure function from what the pods report to a replica count and a reason.

`decide(current, samples, spec, history, now, pending_requests)` is all there is. The operator calls it on
a timer with scraped pod samples and stores the returned history in the resource's status; the fleet
simulator calls the very same function with samples read from its simulated replicas. No I/O, no clock,
no Kubernetes: the same inputs always give the same decision.

Semantics follow the Kubernetes HPA (autoscaling/v2), with LLM signals:
- Each target gives a recommendation `ceil(sum of the metric over Ready pods / target)` — the HPA's
  `ceil(current * average / target)` where pods without data count as 0 — and the largest wins. Within
  `tolerance` of the target a target recommends the current count (no churn on noise).
- Additive targets (waiting requests per replica, output tokens/s per replica) and KV-cache usage size the
  fleet both ways. Waiting requests include `pending_requests`, those the router holds back for the model. TTFT is an SLO guard: above it, it scales up in proportion to how far it is over; under
  it, it abstains (latency is not linear in replicas, so it never argues for fewer).
- Cold-starting pods (created, not Ready yet) are capacity on the way: they count in `current`, so a
  burst does not order the same pods again every period while the first ones boot.
- Unknown data (a Ready pod whose scrape failed, a pod that is neither Ready nor starting) never causes a
  scale-down: with any unknown pod the decision is at least `current`.
- Stabilisation (HPA behaviour): the recommendations of the last `scaleDown.stabilizationWindowSeconds`
  are kept; a scale-down goes only to the highest of them (flapping load never shrinks the fleet), and a
  scale-up only to the lowest recommendation of `scaleUp.stabilizationWindowSeconds` (0 = at once).
  Each step moves at most `maxStep` replicas; `cooldownSeconds` is the quiet time after the last scale
  before another one in that direction (a scale-down also waits that long after any scale-up).
- Scale to zero: with `minReplicas: 0`, after `scaleToZeroAfterSeconds` without traffic (nothing running or
  waiting, no tokens produced, nothing pending) and no unknown pod. At zero there are no pods and no
  metrics: `pending_requests` (requests the router holds for the model) > 0 scales 0 -> 1 at once,
  bypassing windows and cooldowns.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.alias_generators import to_camel


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, alias_generator=to_camel, populate_by_name=True)


class TTFTTarget(_Spec):
    """Time to first token at a percentile over a window: the SLO the fleet is sized to meet."""

    percentile: float = Field(0.9, gt=0, lt=1, description="Quantile, e.g. 0.9 for p90.")
    seconds: float = Field(gt=0, description="TTFT at that percentile must stay at or below this.")
    window_seconds: float = Field(60.0, gt=0, description="Window the percentile is computed over.")


class Targets(_Spec):
    """Any of these; the one asking for the most replicas wins."""

    waiting_requests_per_replica: float | None = Field(None, gt=0, description="Queued requests per replica.")
    kv_cache_usage: float | None = Field(None, gt=0, le=1, description="KV-cache blocks in use, 0..1.")
    ttft: TTFTTarget | None = Field(None, description="TTFT SLO guard (scales up only).")
    output_tokens_per_second_per_replica: float | None = Field(
        None, gt=0, description="Generated tokens per second per replica."
    )


class ScalingBehavior(_Spec):
    stabilization_window_seconds: float = Field(0.0, ge=0, le=3600)
    max_step: int = Field(4, ge=1, description="Most replicas added or removed in one decision.")
    cooldown_seconds: float = Field(0.0, ge=0, le=3600, description="Quiet time after the last scale.")


class ScaleDownBehavior(ScalingBehavior):
    """Slower down than up by default (the HPA's 5-minute window, one replica at a time).

    Its own class rather than a default instance of ScalingBehavior: the CRD's schema carries field
    defaults only, and the API server fills an omitted or partial `scaleDown` from them.
    """

    stabilization_window_seconds: float = Field(300.0, ge=0, le=3600)
    max_step: int = Field(1, ge=1, description="Most replicas removed in one decision.")
    cooldown_seconds: float = Field(60.0, ge=0, le=3600, description="Quiet time after the last scale.")


class AutoscalingSpec(_Spec):
    """`ModelDeployment.spec.autoscaling`: while set, the autoscaler owns the replica count."""

    min_replicas: int = Field(1, ge=0, description="0 allows scale to zero.")
    max_replicas: int = Field(ge=1)
    targets: Targets
    scale_up: ScalingBehavior = ScalingBehavior()
    scale_down: ScaleDownBehavior = ScaleDownBehavior()
    scale_to_zero_after_seconds: float = Field(600.0, gt=0, description="Idle time before 1 -> 0.")
    tolerance: float = Field(0.1, ge=0, lt=1, description="No change within this fraction of a target.")
    idle: Literal["zero", "sleep"] = Field(
        "zero",
        description="What a scale-down does with a pod it no longer needs: 'zero' removes it; 'sleep' puts up "
        "to warmPoolSize of them to sleep (weights kept, KV cache and device memory freed), woken on demand "
        "in about a second instead of a cold start. Sleeping pods keep their GPUs.",
    )
    warm_pool_size: int | None = Field(
        None, ge=0, description="idle: sleep — most pods kept asleep (default 1); the rest are removed."
    )
    sleep_level: Literal[1, 2] | None = Field(
        None,
        description="idle: sleep — 1 keeps the weights in host memory (fast wake, default); 2 keeps only the "
        "process (the weights are reloaded on wake).",
    )

    @model_validator(mode="after")
    def _check(self) -> AutoscalingSpec:
        if self.min_replicas > self.max_replicas:
            raise ValueError(
                f"minReplicas ({self.min_replicas}) must be <= maxReplicas ({self.max_replicas})"
            )
        if self.idle != "sleep" and (self.warm_pool_size is not None or self.sleep_level is not None):
            raise ValueError("warmPoolSize and sleepLevel need idle: sleep")
        t = self.targets
        if all(
            v is None
            for v in (
                t.waiting_requests_per_replica,
                t.kv_cache_usage,
                t.ttft,
                t.output_tokens_per_second_per_replica,
            )
        ):
            raise ValueError(
                "targets: set at least one of waitingRequestsPerReplica, kvCacheUsage, ttft, "
                "outputTokensPerSecondPerReplica"
            )
        return self

    @property
    def warm_pool(self) -> int:
        """Pods kept asleep at most (0 unless idle: sleep)."""
        if self.idle != "sleep":
            return 0
        return 1 if self.warm_pool_size is None else self.warm_pool_size

    @property
    def level(self) -> int:
        return self.sleep_level or 1


class PodState(enum.Enum):
    READY = "ready"  # Ready and scraped: its figures are real
    STARTING = "starting"  # created, not Ready yet (cold start): capacity on the way, no figures
    UNKNOWN = "unknown"  # scrape failed, or not Ready for another reason: no figures, blocks scale-down
    # In sleep mode (its /metrics says so): no capacity until woken; the policy does not count it at all —
    # the warm tier (warm_tier.py) decides what happens to sleeping pods.
    SLEEPING = "sleeping"


@dataclass(frozen=True, slots=True)
class PodSample:
    """One pod's signals at one decision (`pod_metrics.pod_sample` builds it from `/metrics`)."""

    pod: str
    state: PodState
    num_waiting: float = 0.0
    num_running: float = 0.0
    kv_cache_usage: float = 0.0
    ttft_seconds: float | None = None  # the spec's TTFT percentile over its window; None: no request in it
    output_tokens_per_second: float = 0.0

    @property
    def has_traffic(self) -> bool:
        return self.num_waiting > 0 or self.num_running > 0 or self.output_tokens_per_second > 0


@dataclass(frozen=True, slots=True)
class History:
    """What the policy remembers between decisions (the caller stores it; the operator in its status)."""

    recommendations: tuple[tuple[float, int], ...] = ()  # (time, recommendation), oldest first
    last_scale_up_time: float | None = None
    last_scale_down_time: float | None = None
    last_traffic_time: float | None = None


@dataclass(frozen=True, slots=True)
class Decision:
    replicas: int
    reason: str
    history: History
    recommendation: int = 0  # this period's unstabilised recommendation
    signals: dict[str, float] = field(default_factory=dict)  # fleet-wide figures, for status and events


def _recommend(n_ready: int, total: float, target: float, tolerance: float, current: int) -> int:
    """HPA rule over a metric summed across Ready pods: within tolerance of the target, stay."""
    ratio = total / (target * n_ready)
    if abs(ratio - 1.0) <= tolerance:
        return current
    return math.ceil(total / target - 1e-9)


def demand_calls_decision(awake: int, held: int, waiting: int, spec: AutoscalingSpec) -> bool:
    """Whether what the routers see now is worth a decision before the periodic one: requests the routers
    hold for the model (at zero, or every pod at its in-flight limit), or the pods' own queues beyond the
    waiting target. The periodic decision may be a whole interval away, and new capacity only starts on
    its way with a decision: at the start of a burst those seconds are most of the SLO misses. Only demand
    for more is checked this way (fewer replicas wait for the periodic decision and its windows), and not
    at `maxReplicas`, where a decision could only repeat itself.

    `awake`: pods serving or on their way; `held`: requests the routers hold for the model; `waiting`:
    requests queued in its pods, as the routers last heard from them."""
    if awake >= spec.max_replicas:
        return False
    if held > 0:
        return True
    per = spec.targets.waiting_requests_per_replica
    return per is not None and awake > 0 and waiting > per * awake * (1 + spec.tolerance)


def _target_recommendations(
    current: int, ready: Sequence[PodSample], spec: AutoscalingSpec, pending_requests: int = 0
) -> tuple[dict[str, int], dict[str, float]]:
    t = spec.targets
    n = len(ready)
    recs: dict[str, int] = {}
    signals: dict[str, float] = {}
    if n == 0:
        return recs, signals
    tol = spec.tolerance
    if t.waiting_requests_per_replica is not None:
        # Requests the router holds back for this model wait as much as those queued in a pod.
        total = sum(s.num_waiting for s in ready) + pending_requests
        signals["waiting_per_replica"] = total / n
        recs["waiting_requests_per_replica"] = _recommend(
            n, total, t.waiting_requests_per_replica, tol, current
        )
    if t.kv_cache_usage is not None:
        total = sum(min(max(s.kv_cache_usage, 0.0), 1.0) for s in ready)
        signals["kv_cache_usage"] = total / n
        recs["kv_cache_usage"] = _recommend(n, total, t.kv_cache_usage, tol, current)
    if t.output_tokens_per_second_per_replica is not None:
        total = sum(s.output_tokens_per_second for s in ready)
        signals["output_tokens_per_second_per_replica"] = total / n
        recs["output_tokens_per_second_per_replica"] = _recommend(
            n, total, t.output_tokens_per_second_per_replica, tol, current
        )
    if t.ttft is not None:
        measured = [s.ttft_seconds for s in ready if s.ttft_seconds is not None]
        if measured:
            # The worst pod decides: an SLO is missed wherever any pod misses it.
            worst = max(measured)
            signals["ttft_seconds"] = worst
            ratio = worst / t.ttft.seconds
            if ratio > 1.0 + tol:
                # In proportion to the Ready pods only: starting ones are already on their way.
                recs["ttft"] = math.ceil(n * ratio - 1e-9)
    return recs, signals


def decide(
    current: int,
    samples: Sequence[PodSample],
    spec: AutoscalingSpec,
    history: History,
    now: float,
    pending_requests: int = 0,
) -> Decision:
    """The replica count to run now and why; `current` counts every pod (Ready, starting or unknown)."""
    samples = [s for s in samples if s.state is not PodState.SLEEPING]  # no capacity, no figures
    ready = [s for s in samples if s.state is PodState.READY]
    num_starting = sum(1 for s in samples if s.state is PodState.STARTING)
    num_unknown = sum(1 for s in samples if s.state is PodState.UNKNOWN)
    # Pods the caller expects but sent no sample for are unknown too.
    num_unknown += max(0, current - len(samples))

    traffic = pending_requests > 0 or any(s.has_traffic for s in ready)
    last_traffic = now if traffic or history.last_traffic_time is None else history.last_traffic_time
    history = replace(history, last_traffic_time=last_traffic)
    floor = max(spec.min_replicas, 1)

    if current == 0:
        if pending_requests > 0:
            target = min(max(floor, 1), spec.max_replicas)
            hist = replace(history, recommendations=((now, target),), last_scale_up_time=now)
            return Decision(target, f"scale 0->{target}: {pending_requests} requests pending", hist, target)
        if spec.min_replicas > 0:
            hist = replace(history, last_scale_up_time=now)
            return Decision(spec.min_replicas, f"scale 0->{spec.min_replicas}: minReplicas", hist, floor)
        return Decision(0, "scaled to zero: no demand", history, 0)

    recs, signals = _target_recommendations(current, ready, spec, pending_requests)
    signals |= {
        "ready": len(ready),
        "starting": num_starting,
        "unknown": num_unknown,
        "pending": pending_requests,
    }
    idle_for = now - last_traffic
    if (
        spec.min_replicas == 0
        and not traffic
        and num_unknown == 0
        and num_starting == 0
        and idle_for >= spec.scale_to_zero_after_seconds
    ):
        recommendation, why = 0, f"no traffic for {idle_for:.0f}s"
    elif recs:
        name = max(recs, key=lambda k: (recs[k], k))
        recommendation = recs[name]
        why = f"{name} {signals.get(_SIGNAL_OF[name], 0.0):.3g} vs target {_target_value(spec, name):.3g}"
    else:
        recommendation, why = current, "no Ready pod with figures" if not ready else "all targets abstain"
    if why.startswith("no traffic"):
        pass  # scale to zero: below the floor on purpose
    else:
        recommendation = min(max(recommendation, floor), spec.max_replicas)
    if num_unknown and recommendation < current:
        recommendation, why = current, f"{num_unknown} pods with unknown figures: no scale-down"

    window = max(spec.scale_up.stabilization_window_seconds, spec.scale_down.stabilization_window_seconds)
    # No history yet (a fresh start): the running count stands as this moment's earlier recommendation,
    # so a restart of the caller cannot shrink the fleet before a whole window has been observed.
    past = history.recommendations or ((now, current),)
    recent = (*tuple((t, r) for t, r in past if now - t < window), (now, recommendation))
    history = replace(history, recommendations=recent)

    def within(seconds: float) -> list[int]:
        return [r for t, r in recent if now - t < seconds] or [recommendation]

    if recommendation > current:
        stable = min([*within(spec.scale_up.stabilization_window_seconds), recommendation])
        behavior = spec.scale_up
        last = history.last_scale_up_time
        if stable <= current:
            return Decision(
                current,
                f"hold at {current}: scale-up not stable yet ({why})",
                history,
                recommendation,
                signals,
            )
        if last is not None and now - last < behavior.cooldown_seconds:
            return Decision(
                current, f"hold at {current}: scale-up cooldown ({why})", history, recommendation, signals
            )
        new = min(stable, current + behavior.max_step)
        hist = replace(history, last_scale_up_time=now)
        return Decision(new, f"scale up {current}->{new}: {why}", hist, recommendation, signals)

    if recommendation == 0:
        # Idle for scaleToZeroAfterSeconds is its own stabilisation: no window, cooldown or step on top.
        hist = replace(history, last_scale_down_time=now)
        return Decision(0, f"scale down {current}->0: {why}", hist, 0, signals)

    if recommendation < current:
        stable = max([*within(spec.scale_down.stabilization_window_seconds), recommendation])
        behavior = spec.scale_down
        last = max(
            (t for t in (history.last_scale_up_time, history.last_scale_down_time) if t is not None),
            default=None,
        )
        if stable >= current:
            return Decision(
                current,
                f"hold at {current}: scale-down not stable yet ({why})",
                history,
                recommendation,
                signals,
            )
        if last is not None and now - last < behavior.cooldown_seconds:
            return Decision(
                current, f"hold at {current}: scale-down cooldown ({why})", history, recommendation, signals
            )
        new = max(stable, current - behavior.max_step)
        hist = replace(history, last_scale_down_time=now)
        return Decision(new, f"scale down {current}->{new}: {why}", hist, recommendation, signals)

    return Decision(current, f"steady at {current}: {why}", history, recommendation, signals)


_SIGNAL_OF = {
    "waiting_requests_per_replica": "waiting_per_replica",
    "kv_cache_usage": "kv_cache_usage",
    "output_tokens_per_second_per_replica": "output_tokens_per_second_per_replica",
    "ttft": "ttft_seconds",
}


def _target_value(spec: AutoscalingSpec, name: str) -> float:
    t = spec.targets
    if name == "ttft":
        assert t.ttft is not None
        return t.ttft.seconds
    value = getattr(t, name)
    assert value is not None
    return float(value)
