"""The cyclic garbage collector's settings for a process that runs engine steps (a server, a simulator).

Two things make CPython's defaults a poor fit. First, the heap an engine builds once (weights' Python
objects, every KV block, the tokenizer) is walked by every older-generation collection although none of
it ever becomes garbage: it is frozen out of the collector's reach once built. Second, each step
allocates a few container objects per running sequence (its scheduled entry, the entry's token tuple,
the sampled-token list) that live until the step's results are applied and are then freed by reference
counting. At CPython's young threshold of 700, a step of 1,024 sequences crossed it about twice, and
every tenth young collection walked the older generations too: 12-20 % of the scheduler's step time at
that batch size, and a fifth of a 16-replica simulation's CPU time (one process holds every replica's
blocks and steps them all). At 50,000 the live young objects of a step never reach it; the collector
still runs when cyclic garbage (tracebacks, closed connections) accumulates, a few MB at most."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

# Net allocations of tracked objects between young-generation collections (CPython's default is 700).
YOUNG_THRESHOLD = 50_000


def settle_heap() -> None:
    """For the rest of the process: freeze what exists now and collect young objects rarely."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(YOUNG_THRESHOLD, *gc.get_threshold()[1:])


@contextmanager
def long_lived_heap() -> Iterator[None]:
    """`settle_heap` for the duration of a block (a simulation run); the process's settings come back."""
    threshold = gc.get_threshold()
    settle_heap()
    try:
        yield
    finally:
        gc.set_threshold(*threshold)
        gc.unfreeze()
