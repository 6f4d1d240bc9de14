"""The router's queue: a request that no endpoint can take right now waits here, by priority, until a deadline.

A request may be sent while one of its candidate endpoints is available (ready, not ejected) and below
`max_in_flight_per_endpoint` requests from this router. Otherwise it waits in a heap ordered by
(priority, arrival) — a lower priority number goes first, as everywhere in tokenfleet — and whenever
capacity may have freed (a request finished, an endpoint became ready or joined, the policy changed),
waiters are woken in that order and re-check. Holding excess work here instead of in the pods' queues is
what lets priority matter (a pod cannot reorder what it was already sent) and keeps the freedom to send a
waiter to whichever pod frees up first.

The same queue holds requests while no endpoint is ready at all — pods still loading their model, all
ejected, or a model scaled to zero — so a burst that arrives with the pods is served once they are up,
not refused. It is bounded twice: at most `max_queued` waiters (beyond that, 429 at once) and at most
`timeout` seconds each (`QueueTimeout`; the app answers 429 when endpoints were merely busy, 503 with
Retry-After when none was ready). `num_waiting(key)` is the demand signal per model: the router exports
it as `tokenfleet:router_pending_requests{model}`, which is what a scale-from-zero controller watches.

Within a priority, waiters go in arrival order — or, with fair share on (`order`, fair_share.py), the
tenant that has received the least service goes first, in arrival order within the tenant. Priorities are
strict, except that a band may be given a minimum share (`min_shares`: its fraction of the last
SHARE_WINDOW requests sent): while it gets less and has waiters, its waiters go first, so a flood of
urgent work cannot starve a lower band completely.

The policy (order, bound, deadlines) is `WaitQueue`: pure, on an injected clock, so the simulator queues its
requests in the same structure on its virtual clock; `PriorityGate` is the asyncio waiting around it.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar

from tokenfleet.runtime.errors import Overloaded

T = TypeVar("T")


# Requests sent (by priority) that the minimum shares are measured over.
SHARE_WINDOW = 200


class QueueFull(Overloaded):
    """`max_queued` requests are waiting already."""


class QueueTimeout(Overloaded):
    """The request waited its whole deadline without an endpoint able to take it."""


@dataclass(eq=False, slots=True)
class Waiter(Generic[T]):
    """One queued request: ordered by (priority, [its tenant's share], arrival); gone at `deadline` on the
    queue's clock."""

    priority: int
    arrival: int
    deadline: float
    key: str
    item: T
    tenant: str = ""


class WaitQueue(Generic[T]):
    """The queue's policy, pure and on an injected clock: (priority, arrival) order, at most `max_queued`
    waiters, each with its deadline. The live gate below holds asyncio futures in it; the simulator holds
    its requests in it on the virtual clock."""

    def __init__(
        self,
        max_queued: int = 1024,
        clock: Callable[[], float] = time.monotonic,
        order: Callable[[str], float] | None = None,
    ) -> None:
        self._heap: list[tuple[int, int, Waiter[T]]] = []
        self._arrivals = itertools.count()
        self._waiting: Counter[str] = Counter()
        self.max_queued = max_queued
        self.clock = clock
        # Within a priority: a tenant's rank (lower goes first), e.g. its fair-share counter; None = arrival.
        self.order = order
        self.min_shares: dict[int, float] = {}  # priority -> its minimum fraction of requests sent
        self._sent: deque[int] = deque(maxlen=SHARE_WINDOW)  # the priorities of the latest requests sent

    def sent(self, priority: int) -> None:
        """A request of `priority` went to an endpoint (queued or not): what minimum shares count."""
        self._sent.append(priority)

    def starving(self) -> set[int]:
        """Bands with waiters that got less than their minimum share of the latest requests sent."""
        if not self.min_shares:
            return set()
        counts = Counter(self._sent)
        sent = max(len(self._sent), 1)
        waiting = {w.priority for _, _, w in self._heap}
        return {p for p, share in self.min_shares.items() if p in waiting and counts[p] < share * sent}

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Waiter[T]]:
        """The waiters in no particular order (`ordered` sorts them)."""
        return (w for _, _, w in self._heap)

    def num_waiting(self, key: str | None = None) -> int:
        """Requests waiting (for one key, e.g. a model, or in all)."""
        return self._waiting[key] if key is not None else len(self._heap)

    def waiting_by_key(self) -> dict[str, int]:
        return {k: n for k, n in self._waiting.items() if n}

    def push(self, item: T, priority: int, timeout: float, key: str = "", tenant: str = "") -> Waiter[T]:
        """Queue `item`; QueueFull when `max_queued` wait already."""
        if len(self._heap) >= self.max_queued:
            raise QueueFull(f"{self.max_queued} requests are queued in the router; retry later")
        w = Waiter(priority, next(self._arrivals), self.clock() + timeout, key, item, tenant)
        heapq.heappush(self._heap, (priority, w.arrival, w))
        self._waiting[key] += 1
        return w

    def ordered(self) -> list[Waiter[T]]:
        """The waiters, first to go first."""
        order = self.order
        if order is None:
            waiters = [w for _, _, w in sorted(self._heap, key=lambda e: (e[0], e[1]))]
        else:
            # Counters move as requests are served, so the order is taken now, not kept in the heap.
            ranks: dict[str, float] = {}
            for _, _, w in self._heap:
                if w.tenant not in ranks:
                    ranks[w.tenant] = order(w.tenant)
            waiters = [w for _, _, w in sorted(self._heap, key=lambda e: (e[0], ranks[e[2].tenant], e[1]))]
        starving = self.starving()
        if starving:
            waiters = [w for w in waiters if w.priority in starving] + [
                w for w in waiters if w.priority not in starving
            ]
        return waiters

    def remove(self, waiter: Waiter[T]) -> bool:
        """Take `waiter` out (it goes, or gives up); False when it was not queued."""
        for i, entry in enumerate(self._heap):
            if entry[2] is waiter:
                self._heap[i] = self._heap[-1]
                self._heap.pop()
                heapq.heapify(self._heap)
                self._waiting[waiter.key] -= 1
                return True
        return False

    def expired(self) -> list[Waiter[T]]:
        """Take out and return the waiters whose deadline has passed (in queue order)."""
        now = self.clock()
        gone = [w for w in self.ordered() if w.deadline <= now]
        for w in gone:
            self.remove(w)
        return gone


class PriorityGate:
    """The live router's admission: a `WaitQueue` of asyncio futures, each with its `can_take` check."""

    def __init__(
        self,
        max_queued: int = 1024,
        clock: Callable[[], float] = time.monotonic,
        order: Callable[[str], float] | None = None,
    ) -> None:
        # Items: (can_take, the future the waiter sleeps on now, or None while it runs its check).
        self.queue: WaitQueue[list] = WaitQueue(max_queued, clock, order)

    @property
    def max_queued(self) -> int:
        return self.queue.max_queued

    @max_queued.setter
    def max_queued(self, value: int) -> None:
        self.queue.max_queued = value

    def num_waiting(self, key: str | None = None) -> int:
        """Requests waiting (for one key, e.g. a model, or in all)."""
        return self.queue.num_waiting(key)

    def waiting_by_key(self) -> dict[str, int]:
        return self.queue.waiting_by_key()

    async def wait_for(
        self, can_take: Callable[[], bool], priority: int, timeout: float, key: str = "", tenant: str = ""
    ) -> None:
        """Return once `can_take()` holds and no earlier waiter (lower priority number, or the same and
        older) could go first; raise QueueFull or QueueTimeout otherwise."""
        if not self._sleeping() and can_take():
            self.queue.sent(priority)
            return
        waiter = self.queue.push([can_take, None], priority, timeout, key, tenant)
        loop = asyncio.get_running_loop()
        try:
            while True:
                fut: asyncio.Future = loop.create_future()
                waiter.item[1] = fut
                self.release()
                try:
                    await asyncio.wait_for(fut, max(waiter.deadline - self.queue.clock(), 0.0))
                except TimeoutError as e:
                    raise QueueTimeout("no endpoint could take the request in time", retry_after=1.0) from e
                finally:
                    if not fut.done():
                        fut.cancel()
                    waiter.item[1] = None
                if can_take():
                    self.queue.sent(priority)
                    return
        finally:
            self.queue.remove(waiter)
            # A leaving waiter may have been the head that blocked others of a different model.
            self.release()

    def _sleeping(self) -> bool:
        return any(w.item[1] is not None and not w.item[1].done() for w in self.queue)

    def release(self) -> None:
        """Capacity may have freed: wake the first waiter (in priority order) that can go now.

        Each waiter's own `can_take` decides, since waiters for different models wait on different
        endpoints.
        """
        for w in self.queue.ordered():
            can_take, fut = w.item
            if fut is not None and not fut.done() and can_take():
                fut.set_result(None)
                return
