"""The scheduler's waiting queue: requests in (priority, arrival, admission order) order.

A heap of `(priority, arrival_time, order, request)`. `order` is fixed when the scheduler first takes the
request, so a preempted request re-enters at its old place, ahead of later arrivals, and entries are unique.
Removal (an abort while waiting) is lazy: an entry is live only while `_live[request_id]` equals its order;
dead entries are dropped when they reach the top or when they outnumber the live ones.
"""

from __future__ import annotations

import heapq

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
