"""Passive/active health: ejection after consecutive failures, back-off, re-admission."""

from __future__ import annotations

from tokenfleet.runtime.router.config import Discovery
from tokenfleet.runtime.router.health import HealthState

POLICY = Discovery(failure_threshold=3, ejection_seconds=5.0, max_ejection_seconds=60.0)


def test_ejected_after_threshold_consecutive_failures_only():
    h = HealthState(POLICY)
    assert not h.record_failure(0.0)
    assert not h.record_failure(0.1)
    h.record_success(0.2)  # the run is broken
    assert not h.record_failure(0.3) and not h.record_failure(0.4)
    assert h.is_available(0.4)
    assert h.record_failure(0.5)
    assert not h.is_available(0.5)


def test_readmitted_only_after_the_period_and_a_success():
    h = HealthState(POLICY)
    for t in (0.0, 0.1, 0.2):
        h.record_failure(t)
    assert not h.record_success(3.0)  # too early: still ejected
    assert not h.is_available(3.0)
    assert h.record_success(5.3)
    assert h.is_available(5.3)


def test_reejection_backs_off_exponentially_up_to_the_cap():
    h = HealthState(POLICY)
    now, periods = 0.0, []
    for _ in range(6):
        for _ in range(3):
            h.record_failure(now)
        periods.append(h.ejected_until - now)
        now = h.ejected_until
        assert h.record_success(now)
    assert periods == [5.0, 10.0, 20.0, 40.0, 60.0, 60.0]


def test_failed_probe_while_ejected_extends_without_counting_a_new_ejection():
    h = HealthState(POLICY)
    for t in (0.0, 0.0, 0.0):
        h.record_failure(t)
    h.record_failure(6.0)  # the period passed but the pod is still down
    assert h.ejected_until == 11.0 and h.num_ejections == 1
