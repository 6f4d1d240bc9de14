"""Endpoint health: not ready is not failing; ejection after consecutive failures, back-off, re-admission."""

from __future__ import annotations

from tokenfleet.runtime.router.config import Discovery
from tokenfleet.runtime.router.health import HealthState, Probe

POLICY = Discovery(failure_threshold=3, ejection_seconds=5.0, max_ejection_seconds=60.0)


def serving() -> HealthState:
    h = HealthState(POLICY)
    assert h.record_success(0.0)
    return h


def test_an_endpoint_takes_traffic_only_once_a_probe_says_it_serves():
    h = HealthState(POLICY)
    assert not h.is_available(0.0)
    assert h.record(Probe.OK, 0.1) is True  # became available: waiting requests are woken
    assert h.is_available(0.1)
    assert h.record(Probe.OK, 0.2) is False  # already was


def test_a_loading_pod_is_not_ready_never_ejected_and_joins_on_the_first_good_probe():
    h = HealthState(POLICY)
    for i in range(20):  # a long model load: many "loading" answers
        h.record(Probe.NOT_READY, i * 0.5)
    assert h.ejected_until is None and h.num_ejections == 0 and not h.is_available(10.0)
    assert h.record(Probe.OK, 10.5)
    assert h.is_available(10.5)


def test_ejected_after_threshold_consecutive_failures_only():
    h = serving()
    assert not h.record_failure(0.0)
    assert not h.record_failure(0.1)
    h.record_success(0.2)  # the run is broken
    assert not h.record_failure(0.3) and not h.record_failure(0.4)
    assert h.is_available(0.4)
    assert h.record_failure(0.5)
    assert not h.is_available(0.5)


def test_a_successful_probe_cuts_the_ejection_short():
    h = serving()
    for t in (1.0, 1.1, 1.2):
        h.record_failure(t)
    assert not h.is_available(3.0)
    assert h.record(Probe.OK, 3.0)  # well before the 5 s period ends
    assert h.is_available(3.0)


def test_draining_takes_an_endpoint_out_without_a_failure():
    h = serving()
    h.record(Probe.NOT_READY, 1.0)
    assert not h.is_available(1.0) and h.consecutive_failures == 0 and h.ejected_until is None


def test_reejection_backs_off_exponentially_up_to_the_cap():
    h = serving()
    now, periods = 0.0, []
    for _ in range(6):
        for _ in range(3):
            h.record_failure(now)
        periods.append(h.ejected_until - now)
        now = h.ejected_until
        assert h.record_success(now)
    assert periods == [5.0, 10.0, 20.0, 40.0, 60.0, 60.0]


def test_failed_probe_while_ejected_extends_without_counting_a_new_ejection():
    h = serving()
    for t in (0.0, 0.0, 0.0):
        h.record_failure(t)
    h.record_failure(6.0)  # the period passed but the pod is still down
    assert h.ejected_until == 11.0 and h.num_ejections == 1


def test_a_sleeping_pod_is_out_of_rotation_without_a_failure_and_any_success_clears_it():
    h = serving()
    for i in range(10):
        h.record(Probe.SLEEPING, 1.0 + i)
    assert not h.is_available(11.0) and h.asleep
    assert h.ejected_until is None and h.consecutive_failures == 0  # asleep is not failing
    h.record(Probe.NOT_READY, 12.0)  # the pod says something else now (loading, draining)
    assert not h.asleep
    h.record(Probe.SLEEPING, 13.0)
    h.record(Probe.FAILED, 14.0)  # a lost probe says nothing about sleep
    assert h.asleep
    assert h.record(Probe.OK, 15.0) and h.is_available(15.0) and not h.asleep
