"""TTL of cached prefixes: a free cached block unreferenced for longer than `ttl_seconds` is evicted first.

Runs in front of the eviction policy rather than as one: whichever policy orders the live blocks,
expired ones go before any of them. A block's clock starts when its last reference is dropped (freeing
it); a hit takes it back into use, so freeing it again restarts the clock — a hit refreshes it.

Free order is expiry order (same TTL for all), so an insertion-ordered dict gives O(1) for everything:
the oldest free block is always first. The TTL can change live; what is stored is the time a block was
freed, so the new TTL applies to every block at once. The clock is injected (tests script it).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenfleet.runtime.engine.kv_cache.block_pool import KVBlock

Clock = Callable[[], float]


class TTLIndex:
    __slots__ = ("_freed_at", "clock", "ttl_seconds")

    def __init__(self, ttl_seconds: float | None, clock: Clock = time.monotonic) -> None:
        self.ttl_seconds = ttl_seconds  # None: nothing ever expires (the index still tracks free times)
        self.clock = clock
        self._freed_at: OrderedDict[int, tuple[KVBlock, float]] = OrderedDict()

    def append(self, block: KVBlock, now: float | None = None) -> None:
        """`block` was freed at `now` (default: the clock now)."""
        self._freed_at[block.block_id] = (block, self.clock() if now is None else now)

    def remove(self, block: KVBlock) -> None:
        del self._freed_at[block.block_id]

    def pop_expired(self) -> KVBlock | None:
        """Take out the oldest free block if its TTL has run out, else None."""
        if self.ttl_seconds is None or not self._freed_at:
            return None
        block, freed_at = next(iter(self._freed_at.values()))
        if self.clock() - freed_at < self.ttl_seconds:
            return None
        del self._freed_at[block.block_id]
        return block

    def __len__(self) -> int:
        return len(self._freed_at)
