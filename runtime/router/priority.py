"""Priority admission: under load, requests wait in the router and the highest priority class goes first.

A request may be sent while some candidate endpoint has fewer than `max_in_flight_per_endpoint` requests
from this router. Otherwise it waits in a heap ordered by (priority desc, arrival); whenever a request
finishes, waiters are woken in that order and re-check. Holding excess work here (instead of in the pods'
queues) is what lets priority matter: a pod's FCFS queue cannot reorder what it was already sent, and the
router keeps the freedom to send a waiter to whichever pod frees up first. A waiter that exceeds the
queue timeout is refused (429, `Overloaded`), so a client never waits unboundedly.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Callable

from tokenfleet.runtime.errors import Overloaded


class PriorityGate:
    def __init__(self) -> None:
        # (-priority, arrival, has_capacity, future); a waiter keeps its arrival number when it re-queues.
        self._heap: list[tuple[int, int, Callable[[], bool], asyncio.Future]] = []
        self._arrivals = itertools.count()

    @property
    def num_waiting(self) -> int:
        return sum(1 for w in self._heap if not w[3].done())

    async def wait_for(self, has_capacity: Callable[[], bool], priority: int, timeout: float) -> None:
        """Return once `has_capacity()` holds and no waiter of higher priority could go first; else Overloaded."""
        if not self._heap and has_capacity():
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        arrival = next(self._arrivals)
        while True:
            fut: asyncio.Future = loop.create_future()
            heapq.heappush(self._heap, (-priority, arrival, has_capacity, fut))
            self.release()
            try:
                await asyncio.wait_for(fut, max(deadline - loop.time(), 0.0))
            except TimeoutError as e:
                raise Overloaded("all endpoints are at capacity; retry later", retry_after=1.0) from e
            finally:
                if not fut.done():
                    fut.cancel()
            if has_capacity():
                return

    def release(self) -> None:
        """Capacity may have freed (a request finished, an endpoint joined): wake the first waiter that fits.

        Waiters are scanned in priority order; each waiter's own `has_capacity` decides, since waiters for
        different models wait on different endpoints.
        """
        self._heap = [w for w in self._heap if not w[3].done()]
        heapq.heapify(self._heap)
        for w in sorted(self._heap):
            if w[2]():
                self._heap.remove(w)
                heapq.heapify(self._heap)
                w[3].set_result(None)
                return
