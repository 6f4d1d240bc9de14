"""How fast this CPU runs pure Python right now, to compare timings taken at different hours or machines.

A shared machine's speed drifts (here by a third within an hour), so a figure measured at one time says
little next to one from another. Each timing run also times a fixed pure-Python loop, interleaved with
its own work so that both see the same contention, and reports its figure scaled to a reference core:
`measured * REFERENCE_CALIBRATION_US / calibration`.
"""

from __future__ import annotations

import time
import timeit

REFERENCE_CALIBRATION_US = 10.0  # sum(range(1000)) on an idle, current x86 server core (CPython 3.11)


def calibration_us(number: int = 2000) -> float:
    """CPU time of `sum(range(1000))` here, per run (us)."""
    return 1e6 * timeit.timeit("sum(range(1000))", number=number, timer=time.process_time) / number
