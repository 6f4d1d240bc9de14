"""LFU with dynamic ageing (LFU-DA): evict the free cached block with the lowest `uses + age`.

Plain LFU never forgets: a block hit a thousand times yesterday outlives today's working set forever.
LFU-DA fixes that with a cache-wide "age" L, the priority of the last victim: a block enters with
priority `L + uses`, so newcomers start level with what was just evicted and old counts lose their edge
as L rises. Ties go to the block freed earliest (LRU among equals), which also makes orders exact.

A block's use count is remembered across hit/free cycles while it keeps the same hash (a hit takes it
out of the queue; freeing it brings it back with one more use) and forgotten when it is evicted or its
hash changes. Uses while a block is shared by running requests count too (`record_hit`).
O(log n) per operation: a heap with lazy deletion.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenfleet.runtime.engine.kv_cache.block_hash import BlockHash
    from tokenfleet.runtime.engine.kv_cache.block_pool import KVBlock


class LFUEvictionQueue:
    __slots__ = ("_age", "_blocks", "_entries", "_heap", "_seq", "_uses")

    def __init__(self, num_blocks: int = 0) -> None:
        self._heap: list[tuple[int, int, int]] = []  # (priority, seq, block_id); stale entries skipped
        self._entries: dict[int, tuple[int, int]] = {}  # block_id -> its live (priority, seq)
        self._blocks: dict[int, KVBlock] = {}
        self._uses: dict[int, tuple[BlockHash | None, int]] = {}  # block_id -> (hash counted, uses)
        self._age = 0
        self._seq = 0

    def _count_use(self, block: KVBlock) -> int:
        known = self._uses.get(block.block_id)
        uses = known[1] + 1 if known is not None and known[0] == block.block_hash else 1
        self._uses[block.block_id] = (block.block_hash, uses)
        return uses

    def record_hit(self, block: KVBlock) -> None:
        self._count_use(block)

    def append(self, block: KVBlock) -> None:
        bid = block.block_id
        assert bid not in self._entries, f"block {bid} freed twice"
        known = self._uses.get(bid)
        if known is None or known[0] != block.block_hash:
            self._uses[bid] = (block.block_hash, 1)
        entry = (self._age + self._uses[bid][1], self._seq)
        self._seq += 1
        self._entries[bid] = entry
        self._blocks[bid] = block
        heapq.heappush(self._heap, (*entry, bid))
        if len(self._heap) > 2 * len(self._entries) + 64:
            # Hit/free cycles leave stale entries behind; rebuilding keeps the heap O(live blocks).
            self._heap = [(*e, b) for b, e in self._entries.items()]
            heapq.heapify(self._heap)

    def remove(self, block: KVBlock) -> None:
        del self._entries[block.block_id]
        del self._blocks[block.block_id]

    def pop_victim(self) -> KVBlock:
        while True:
            priority, seq, bid = heapq.heappop(self._heap)
            if self._entries.get(bid) == (priority, seq):
                break
        del self._entries[bid]
        del self._uses[bid]
        self._age = priority
        return self._blocks.pop(bid)

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[KVBlock]:
        order = sorted((entry, bid) for bid, entry in self._entries.items())
        return iter([self._blocks[bid] for _, bid in order])
