"""S3-FIFO (Yang et al., SOSP'23): a small probationary FIFO, a main FIFO and a ghost list of hashes.

Why this one as the scan-resistant policy: prefix caches see exactly the traffic it was designed for —
a few hot prefixes (system prompts, shared documents) reused constantly, buried under one-off blocks
(each request's unique tail, long scans of documents read once). LRU lets every one-off block push a
hot prefix one slot closer to eviction; S3-FIFO keeps one-off blocks in the small queue (10% of the
cache) and evicts them there, so a scan of any length cannot flush the main queue. It is O(1) per
operation, unlike LFU's heap, and needs no tuning beyond the small-queue share. `bench/cache_policy.py`
measures it against LRU and LFU-DA on such a trace.

Adapted to ref-counted blocks: a block in use is not evictable and sits in no queue. A hit takes it out
and counts one use (capped at 3, as in the paper); when it is freed again it has proven reuse and goes
to the main queue. A block freed for the first time goes to the small queue — or straight to main when
its hash is in the ghost list (it was evicted from the small queue recently and came back). Evicting
from main gives a block with uses left one more round (uses - 1, back to the tail): FIFO-reinsertion.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenfleet.runtime.engine.kv_cache.block_hash import BlockHash
    from tokenfleet.runtime.engine.kv_cache.block_pool import KVBlock

_SMALL_SHARE = 0.1
_MAX_USES = 3


class S3FIFOEvictionQueue:
    __slots__ = ("_ghost", "_ghost_cap", "_main", "_small", "_small_cap", "_uses")

    def __init__(self, num_blocks: int = 0) -> None:
        self._small: OrderedDict[int, KVBlock] = OrderedDict()
        self._main: OrderedDict[int, KVBlock] = OrderedDict()
        self._ghost: OrderedDict[BlockHash, None] = OrderedDict()
        self._uses: dict[int, tuple[BlockHash | None, int]] = {}  # block_id -> (hash counted, uses)
        self._small_cap = max(1, int(num_blocks * _SMALL_SHARE))
        self._ghost_cap = max(1, num_blocks)  # as many hashes as the cache has blocks (the paper's choice)

    def _uses_of(self, block: KVBlock) -> int | None:
        known = self._uses.get(block.block_id)
        return known[1] if known is not None and known[0] == block.block_hash else None

    def record_hit(self, block: KVBlock) -> None:
        uses = self._uses_of(block) or 0
        self._uses[block.block_id] = (block.block_hash, min(uses + 1, _MAX_USES))

    def append(self, block: KVBlock) -> None:
        bid = block.block_id
        assert bid not in self._small and bid not in self._main, f"block {bid} freed twice"
        uses = self._uses_of(block)
        if uses is not None and uses > 0:
            self._main[bid] = block  # hit since it was cached: proven reuse
            return
        self._uses[bid] = (block.block_hash, 0)
        if block.block_hash is not None and block.block_hash in self._ghost:
            del self._ghost[block.block_hash]
            self._main[bid] = block  # came back soon after a probationary eviction
        else:
            self._small[bid] = block

    def remove(self, block: KVBlock) -> None:
        bid = block.block_id
        if self._small.pop(bid, None) is None:
            del self._main[bid]

    def pop_victim(self) -> KVBlock:
        if self._small and (len(self._small) >= self._small_cap or not self._main):
            block = self._small.popitem(last=False)[1]
            if block.block_hash is not None:
                self._ghost[block.block_hash] = None
                if len(self._ghost) > self._ghost_cap:
                    self._ghost.popitem(last=False)
        else:
            while True:
                bid, block = self._main.popitem(last=False)
                uses = self._uses_of(block) or 0
                if uses == 0:
                    break
                self._uses[bid] = (block.block_hash, uses - 1)
                self._main[bid] = block  # one more round for a block that was used
        del self._uses[block.block_id]
        return block

    def __len__(self) -> int:
        return len(self._small) + len(self._main)

    def __iter__(self) -> Iterator[KVBlock]:
        """Current queue order (small, then main); main blocks with uses left would get another round."""
        return iter([*self._small.values(), *self._main.values()])
