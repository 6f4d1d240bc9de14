"""Endpoint health: *not ready* (warming, draining) is not *failing*; only failures eject, with back-off.

Three inputs, three different answers:
- a successful probe (or a served request) makes the endpoint ready at once, and re-admits an ejected one
  at once: the back-off exists to keep traffic off a pod that fails, and a pod that answers its probes
  again is no longer failing;
- a probe that says "not ready" (the pod is loading its model, draining, or its port is not open yet
  because the process is still starting) takes it out of rotation without counting a failure: it joins
  as soon as a probe succeeds, never after an ejection period;
- a probe that says "sleeping" (the pod's sleep mode: alive, its engine's memory released) is "not
  ready" too, and marks the endpoint `asleep` until a probe or a request succeeds: the router may wake it
  when requests wait (wake.py);
- failures (requests or probes of a pod that was serving) count: `failure_threshold` consecutive ones
  eject it for `ejection_seconds`, doubled on each re-ejection up to `max_ejection_seconds` (Envoy's
  outlier detection), so a flapping pod stays out longer each time unless a probe shows it healthy.
  A long stretch of good health forgives earlier ejections.

An endpoint starts not ready: nothing is sent to it before a probe says it serves (requests wait in the
router's queue meanwhile, see priority.py). Time is passed in, so the state machine is tested without
sleeping.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from tokenfleet.runtime.router.config import Discovery


class Probe(enum.Enum):
    OK = "ok"
    NOT_READY = "not_ready"
    SLEEPING = "sleeping"  # not ready because the pod sleeps: it serves again once woken
    FAILED = "failed"


@dataclass(slots=True)
class HealthState:
    policy: Discovery
    ready: bool = False
    ever_ready: bool = False
    consecutive_failures: int = 0
    ejected_until: float | None = None
    num_ejections: int = 0
    last_ok: float | None = None
    asleep: bool = False  # the last word from the pod was that it sleeps

    def is_available(self, now: float) -> bool:
        """May requests be routed here?"""
        return self.ready and self.ejected_until is None

    def record(self, outcome: Probe, now: float) -> bool:
        """Apply a probe's outcome; True when the endpoint became available (wake waiting requests)."""
        if outcome is Probe.OK:
            return self.record_success(now)
        if outcome is Probe.NOT_READY or outcome is Probe.SLEEPING:
            self.record_not_ready()
            self.asleep = outcome is Probe.SLEEPING
            return False
        self.record_failure(now)
        return False

    def record_success(self, now: float) -> bool:
        """Returns True when this makes the endpoint available (first ready, or re-admitted)."""
        was_available = self.is_available(now)
        self.consecutive_failures = 0
        self.ready = self.ever_ready = True
        self.asleep = False
        self.ejected_until = None
        if self.last_ok is not None and now - self.last_ok > self.policy.max_ejection_seconds:
            self.num_ejections = 0  # a long healthy stretch forgives earlier ejections
        if self.last_ok is None:
            self.last_ok = now
        return not was_available

    def record_not_ready(self) -> None:
        """The pod says it cannot take traffic yet (or any more): out of rotation, no failure counted."""
        self.ready = False
        self.consecutive_failures = 0

    def record_failure(self, now: float) -> bool:
        """Returns True when this failure ejects the endpoint."""
        self.consecutive_failures += 1
        self.last_ok = None
        if self.ejected_until is not None:
            # Still out: a failed probe after the period restarts it (without counting a new ejection).
            if now >= self.ejected_until:
                self.ejected_until = now + self.ejection_period()
            return False
        if self.consecutive_failures < self.policy.failure_threshold:
            return False
        self.num_ejections += 1
        self.ejected_until = now + self.ejection_period()
        return True

    def ejection_period(self) -> float:
        n = max(self.num_ejections - 1, 0)
        return min(self.policy.ejection_seconds * (2.0**n), self.policy.max_ejection_seconds)
