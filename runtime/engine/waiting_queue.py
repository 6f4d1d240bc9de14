"""The scheduler's waiting queues: requests in (priority, arrival, admission order) order, or, under
`scheduler.fair_share`, the least-served tenant first within a priority (`FairWaitingQueue`).

A heap of `(priority, arrival_time, order, request)`. `order` is fixed when the scheduler first takes the
request, so a preempted request re-enters at its old place, ahead of later arrivals, and entries are unique.
Removal (an abort while waiting) is lazy: an entry is live only while `_live[request_id]` equals its order;
dead entries are dropped when they reach the top or when they outnumber the live ones.
"""

from __future__ import annotations

import heapq

from tokenfleet.runtime.engine.fair_share import FairShare
from tokenfleet.runtime.engine.request import Request


class WaitingQueue:
    __slots__ = ("_heap", "_live")

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._live: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._live

    def push(self, request: Request, order: int) -> None:
        self._live[request.request_id] = order
        heapq.heappush(self._heap, (request.priority, request.arrival_time, order, request))
        # Lazily removed entries must not pile up (clients that abort while waiting).
        if len(self._heap) > 2 * len(self._live) + 64:
            live = self._live
            self._heap = [e for e in self._heap if live.get(e[3].request_id) == e[2]]
            heapq.heapify(self._heap)

    def peek(self) -> Request | None:
        """The request that goes next, or None when nobody waits."""
        heap = self._heap
        live = self._live
        while heap:
            _, _, order, request = heap[0]
            if live.get(request.request_id) == order:
                return request
            heapq.heappop(heap)
        return None

    def pop(self) -> Request:
        """Take the request `peek` returned."""
        request = self.peek()
        if request is None:
            raise IndexError("pop from an empty waiting queue")
        heapq.heappop(self._heap)
        del self._live[request.request_id]
        return request

    def remove(self, request_id: str) -> bool:
        """Forget a waiting request (O(1); its heap entry dies lazily). False if it was not waiting."""
        return self._live.pop(request_id, None) is not None


class FairWaitingQueue:
    """The waiting queue under fair share: one `WaitingQueue` per tenant; the next request is the head of
    the tenant whose head has the best priority and, among those, the smallest fair-share counter (then
    the earliest arrival). Priority bands stay strict, tenants are first come first served within.

    Counters move with every step, so the order between tenants is decided at each `peek` (O(tenants)),
    never kept in a heap. Used only with fair share on: the default path keeps the single heap.
    """

    __slots__ = ("_fair", "_queues", "_tenant_of")

    def __init__(self, fair: FairShare) -> None:
        self._fair = fair
        self._queues: dict[str, WaitingQueue] = {}  # only tenants with someone waiting
        self._tenant_of: dict[str, str] = {}  # request id -> tenant, for `remove`

    def __len__(self) -> int:
        return len(self._tenant_of)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._tenant_of

    def push(self, request: Request, order: int) -> None:
        tenant = request.tenant or ""
        queue = self._queues.get(tenant)
        if queue is None:
            queue = self._queues[tenant] = WaitingQueue()
        queue.push(request, order)
        self._tenant_of[request.request_id] = tenant

    def _head(self) -> tuple[str, Request] | None:
        counter = self._fair.counter
        best: tuple[str, Request] | None = None
        best_key: tuple[int, float, float, int] | None = None
        for tenant, queue in self._queues.items():
            request = queue.peek()  # never None: a tenant's queue goes when it empties
            if request is None:
                continue
            key = (request.priority, counter(tenant), request.arrival_time, queue._live[request.request_id])
            if best_key is None or key < best_key:
                best, best_key = (tenant, request), key
        return best

    def peek(self) -> Request | None:
        """The request that goes next, or None when nobody waits."""
        head = self._head()
        return None if head is None else head[1]

    def pop(self) -> Request:
        """Take the request `peek` returned (counters unchanged since)."""
        head = self._head()
        if head is None:
            raise IndexError("pop from an empty waiting queue")
        tenant, request = head
        queue = self._queues[tenant]
        queue.pop()
        if not len(queue):
            del self._queues[tenant]
        del self._tenant_of[request.request_id]
        return request

    def remove(self, request_id: str) -> bool:
        """Forget a waiting request. False if it was not waiting."""
        tenant = self._tenant_of.pop(request_id, None)
        if tenant is None:
            return False
        queue = self._queues[tenant]
        queue.remove(request_id)
        if not len(queue):
            del self._queues[tenant]
        return True
