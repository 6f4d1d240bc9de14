"""The router's queue policy (`priority.WaitQueue`), on an injected clock: what the live gate and the
simulator both hold their waiters in."""

from __future__ import annotations

import pytest
from tokenfleet.runtime.router.decision import AT_CAPACITY, NO_READY_ENDPOINT, refusal_status
from tokenfleet.runtime.router.priority import QueueFull, WaitQueue


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_waiters_go_by_priority_then_arrival():
    q: WaitQueue[str] = WaitQueue(10, Clock())
    for name, priority in [("a", 5), ("b", 0), ("c", 5), ("d", -1), ("e", 0)]:
        q.push(name, priority, 30.0)
    assert [w.item for w in q.ordered()] == ["d", "b", "e", "a", "c"]
    first = q.ordered()[0]
    assert q.remove(first) and not q.remove(first)
    assert [w.item for w in q.ordered()] == ["b", "e", "a", "c"]


def test_max_queued_refuses_the_next_and_counts_per_key():
    q: WaitQueue[int] = WaitQueue(2, Clock())
    a = q.push(1, 0, 30.0, "m1")
    q.push(2, 0, 30.0, "m2")
    with pytest.raises(QueueFull):
        q.push(3, 0, 30.0, "m1")
    assert q.num_waiting() == 2 and q.num_waiting("m1") == 1 and q.waiting_by_key() == {"m1": 1, "m2": 1}
    q.remove(a)
    q.push(3, 0, 30.0, "m1")  # room again
    assert len(q) == 2


def test_deadlines_pass_on_the_injected_clock():
    clock = Clock()
    q: WaitQueue[str] = WaitQueue(10, clock)
    q.push("short", 9, 1.0)
    q.push("long", 0, 5.0)
    clock.t += 0.5
    assert q.expired() == []
    clock.t += 0.5  # exactly at the deadline: gone, as `wait_for` times out then
    assert [w.item for w in q.expired()] == ["short"]
    clock.t += 10
    assert [w.item for w in q.expired()] == ["long"] and len(q) == 0 and q.num_waiting("") == 0


def test_a_timed_out_waiter_is_429_when_endpoints_were_busy_and_503_when_none_was_ready():
    assert refusal_status(AT_CAPACITY) == 429
    assert refusal_status(NO_READY_ENDPOINT) == 503
