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
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections import Counter
from collections.abc import Callable

from tokenfleet.runtime.errors import Overloaded


class QueueFull(Overloaded):
    """`max_queued` requests are waiting already."""


class QueueTimeout(Overloaded):
    """The request waited its whole deadline without an endpoint able to take it."""


class PriorityGate:
    def __init__(self, max_queued: int = 1024) -> None:
        # (priority, arrival, can_take, future); a waiter keeps its arrival number when it re-queues.
        self._heap: list[tuple[int, int, Callable[[], bool], asyncio.Future]] = []
        self._arrivals = itertools.count()
        self._waiting: Counter[str] = Counter()
        self.max_queued = max_queued

    def num_waiting(self, key: str | None = None) -> int:
        """Requests waiting (for one key, e.g. a model, or in all)."""
        return self._waiting[key] if key is not None else sum(self._waiting.values())

    def waiting_by_key(self) -> dict[str, int]:
        return {k: n for k, n in self._waiting.items() if n}

    async def wait_for(
        self, can_take: Callable[[], bool], priority: int, timeout: float, key: str = ""
    ) -> None:
        """Return once `can_take()` holds and no earlier waiter (lower priority number, or the same and
        older) could go first; raise QueueFull or QueueTimeout otherwise."""
        if not self._heap and can_take():
            return
        if self.num_waiting() >= self.max_queued:
            raise QueueFull(f"{self.max_queued} requests are queued in the router; retry later")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        arrival = next(self._arrivals)
        self._waiting[key] += 1
        try:
            while True:
                fut: asyncio.Future = loop.create_future()
                heapq.heappush(self._heap, (priority, arrival, can_take, fut))
                self.release()
                try:
                    await asyncio.wait_for(fut, max(deadline - loop.time(), 0.0))
                except TimeoutError as e:
                    raise QueueTimeout("no endpoint could take the request in time", retry_after=1.0) from e
                finally:
                    if not fut.done():
                        fut.cancel()
                if can_take():
                    return
        finally:
            self._waiting[key] -= 1
            # A leaving waiter may have been the head that blocked others of a different model.
            self.release()

    def release(self) -> None:
        """Capacity may have freed: wake the first waiter (in priority order) that can go now.

        Each waiter's own `can_take` decides, since waiters for different models wait on different
        endpoints.
        """
        self._heap = [w for w in self._heap if not w[3].done()]
        heapq.heapify(self._heap)
        for w in sorted(self._heap, key=lambda w: (w[0], w[1])):
            if w[2]():
                self._heap.remove(w)
                heapq.heapify(self._heap)
                w[3].set_result(None)
                return
