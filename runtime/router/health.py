"""Endpoint health: passive (request errors) and active (/health probes), with ejection and re-admission.

`failure_threshold` consecutive failures eject an endpoint for `ejection_seconds`, doubled on every
re-ejection up to `max_ejection_seconds` (Envoy's outlier detection): a flapping pod stays out longer each
time instead of eating a retry on every cycle. While ejected, only active probes reach it; a successful probe
after the ejection period re-admits it. A success resets the failure run, and a stretch of good health
resets the back-off. Time is passed in, so the state machine is tested without sleeping.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenfleet.runtime.router.config import Discovery


@dataclass(slots=True)
class HealthState:
    policy: Discovery
    consecutive_failures: int = 0
    ejected_until: float | None = None
    num_ejections: int = 0
    last_ok: float | None = None

    def is_available(self, now: float) -> bool:
        """May requests be routed here? An endpoint not yet probed counts as healthy (static config)."""
        return self.ejected_until is None

    def record_success(self, now: float) -> bool:
        """Returns True when this re-admits an ejected endpoint."""
        self.consecutive_failures = 0
        if self.ejected_until is not None:
            if now < self.ejected_until:
                return False  # the ejection period runs its course even if one probe passes
            self.ejected_until = None
            self.last_ok = now
            return True
        if self.last_ok is not None and now - self.last_ok > self.policy.max_ejection_seconds:
            self.num_ejections = 0  # a long healthy stretch forgives earlier ejections
        if self.last_ok is None:
            self.last_ok = now
        return False

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
