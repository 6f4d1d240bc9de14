"""Eviction policies: which free-but-cached block a new allocation reuses first.

A block whose ref count drops to 0 keeps its hash (its KV is still valid and may be hit again) and is
handed to the policy; a cache hit takes it back out (`remove`); an allocation that finds no empty block
asks the policy for a victim. Blocks without a hash never reach the policy: the pool reuses those first,
since evicting them loses nothing.

Policies are chosen by name through `EVICTION_POLICIES` (CacheConfig.eviction): `lru` (the default),
`lfu` (LFU with dynamic ageing, evict_lfu.py) and `s3fifo` (scan-resistant, evict_s3fifo.py). A factory
takes the pool's block count (policies that size internal queues need it). TTL expiry is not a policy:
it runs in front of whichever policy is chosen (ttl.py).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Protocol

from tokenfleet.runtime.engine.kv_cache.evict_lfu import LFUEvictionQueue
from tokenfleet.runtime.engine.kv_cache.evict_s3fifo import S3FIFOEvictionQueue

if TYPE_CHECKING:
    from tokenfleet.runtime.engine.kv_cache.block_pool import KVBlock


class EvictionQueue(Protocol):
    def append(self, block: KVBlock) -> None:
        """`block` just became free (ref count 0) and still holds cached KV."""

    def remove(self, block: KVBlock) -> None:
        """`block` (currently in the queue) was hit by a lookup and is in use again."""

    def record_hit(self, block: KVBlock) -> None:
        """A lookup hit `block` (free or shared by running requests); frequency-aware policies count it."""

    def pop_victim(self) -> KVBlock:
        """Take out the block to evict next; only called when `len(self) > 0`."""

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[KVBlock]:
        """The queued blocks in the order they would be evicted now (inspection and tests)."""


class LRUEvictionQueue:
    """Least recently freed first. O(1) per operation (an insertion-ordered dict keyed by block id)."""

    __slots__ = ("_blocks",)

    def __init__(self, num_blocks: int = 0) -> None:
        self._blocks: OrderedDict[int, KVBlock] = OrderedDict()

    def record_hit(self, block: KVBlock) -> None:
        pass  # recency is the free order itself

    def append(self, block: KVBlock) -> None:
        assert block.block_id not in self._blocks, f"block {block.block_id} freed twice"
        self._blocks[block.block_id] = block

    def remove(self, block: KVBlock) -> None:
        del self._blocks[block.block_id]

    def pop_victim(self) -> KVBlock:
        return self._blocks.popitem(last=False)[1]

    def __len__(self) -> int:
        return len(self._blocks)

    def __iter__(self) -> Iterator[KVBlock]:
        return iter(list(self._blocks.values()))


EVICTION_POLICIES: dict[str, Callable[[int], EvictionQueue]] = {
    "lru": LRUEvictionQueue,
    "lfu": LFUEvictionQueue,
    "s3fifo": S3FIFOEvictionQueue,
}
