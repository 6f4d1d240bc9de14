"""DrainRate: how fast the engine finishes requests, to tell a refused client when to come back.

Retry-After on a 429 is `waiting / rate`: the time the requests already queued need to drain at the rate
requests have recently been finishing (a sliding window of completion times), clamped to [1 s, 60 s].
Before anything has finished there is no rate to go by, and the floor is returned.
"""

from __future__ import annotations

import collections
import math

MIN_RETRY_S = 1.0
MAX_RETRY_S = 60.0


class DrainRate:
    def __init__(self, window: int = 64):
        self._done: collections.deque[float] = collections.deque(maxlen=window)

    def record(self, now: float, num_finished: int = 1) -> None:
        self._done.extend([now] * num_finished)

    def rate(self) -> float | None:
        """Requests finished per second over the window; None until two completions are apart in time."""
        if len(self._done) < 2:
            return None
        span = self._done[-1] - self._done[0]
        return (len(self._done) - 1) / span if span > 0 else None

    def retry_after(self, num_waiting: int) -> float:
        rate = self.rate()
        if rate is None:
            return MIN_RETRY_S
        return min(MAX_RETRY_S, max(MIN_RETRY_S, math.ceil(num_waiting / rate)))
