"""BlockPool: a fixed set of KV blocks, their ref counts, the prefix-cache index and the free queues.

A free block is in exactly one of two places:
- the *empty* queue (FIFO): no hash, nothing worth keeping, reused first;
- the *eviction* queue (a pluggable policy, LRU by default): ref count 0 but the block still holds the
  KV of a full, hashed block. It stays findable by hash until an allocation finds no empty block and
  evicts it (a `BlockRemoved` event), or a lookup hits it and `touch` takes it back into use.
Every operation is O(1) per block (O(log n) under LFU). The pool knows nothing of requests;
`KVCacheManager` does.

Cache policy: free cached blocks past their TTL are evicted before the policy is asked
(`evict_expired` sweeps them eagerly, reason "ttl"); a pressure eviction (reason "pressure") first hands
the block to `on_evict` so a host tier can copy its KV out before the block is reused. The policy and
the TTL can change live (`set_eviction_policy`, `set_ttl`).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from tokenfleet.runtime.engine.kv_cache.block_hash import BlockHash
from tokenfleet.runtime.engine.kv_cache.eviction import EVICTION_POLICIES, EvictionQueue
from tokenfleet.runtime.engine.kv_cache.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
)
from tokenfleet.runtime.engine.kv_cache.ttl import Clock, TTLIndex
from tokenfleet.runtime.errors import ConfigError


@dataclass(slots=True, eq=False)
class KVBlock:
    """One block of `block_size` token slots in every layer's K and V cache tensors."""

    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None  # set once the block is full, computed and cached


class BlockPool:
    def __init__(
        self,
        num_blocks: int,
        enable_caching: bool = True,
        eviction: str = "lru",
        enable_kv_events: bool = True,
        ttl_seconds: float | None = None,
        clock: Clock = time.monotonic,
    ):
        if num_blocks < 1:
            raise ConfigError(f"the KV cache needs at least one block, got {num_blocks}")
        self.enable_caching = enable_caching
        self.enable_kv_events = enable_kv_events
        self._blocks = tuple(KVBlock(i) for i in range(num_blocks))
        self._empty: deque[KVBlock] = deque(self._blocks)
        self.eviction = eviction
        self._evictable = _make_policy(eviction, num_blocks)
        self._ttl = TTLIndex(ttl_seconds, clock)
        self._cached: dict[BlockHash, KVBlock] = {}
        self._events: list[KVEvent] = []
        # Called with (block, its hash) when pressure evicts a cached block, before the block is reused.
        self.on_evict: Callable[[KVBlock, BlockHash], None] | None = None
        self.num_evicted_ttl = 0
        self.num_evicted_pressure = 0

    # ---- inspection --------------------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return len(self._blocks)

    @property
    def blocks(self) -> tuple[KVBlock, ...]:
        return self._blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation may take: empty ones plus cached ones nobody references."""
        return len(self._empty) + len(self._evictable)

    def has_free(self, num_blocks: int) -> bool:
        """Whether `num_blocks` blocks can be taken now (`num_free_blocks >= num_blocks`, cheaper)."""
        return num_blocks <= len(self._empty) or num_blocks <= len(self._empty) + len(self._evictable)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use (ref count > 0); free cached blocks count as free."""
        return 1.0 - self.num_free_blocks / len(self._blocks)

    def free_block_ids(self) -> list[int]:
        """Free blocks in the order allocations will take them: empty ones, then eviction order."""
        return [b.block_id for b in self._empty] + [b.block_id for b in self._evictable]

    # ---- allocation ---------------------------------------------------------------------------------------

    def get_new_blocks(self, num_blocks: int) -> list[KVBlock]:
        """Take `num_blocks` free blocks (ref count 1 each); evicts cached ones only when no empty is left."""
        empty = self._empty
        if num_blocks <= len(empty):  # nothing to evict: the common case while the cache has room
            if num_blocks == 1:  # a decode entering a new block
                block = empty.popleft()
                block.ref_cnt = 1
                return [block]
            out = [empty.popleft() for _ in range(num_blocks)]
            for block in out:
                block.ref_cnt = 1
            return out
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"asked for {num_blocks} blocks, {self.num_free_blocks} free")
        out: list[KVBlock] = []
        removed: list[BlockHash] = []
        for _ in range(num_blocks):
            if self._empty:
                block = self._empty.popleft()
            else:
                block = self._ttl.pop_expired()
                if block is not None:
                    self._evictable.remove(block)
                    self.num_evicted_ttl += 1
                else:
                    block = self._evictable.pop_victim()
                    self._ttl.remove(block)
                    self.num_evicted_pressure += 1
                    if self.on_evict is not None:
                        self.on_evict(block, block.block_hash)
                assert block.block_hash is not None and block.ref_cnt == 0
                removed.append(block.block_hash)
                del self._cached[block.block_hash]
                block.block_hash = None
            block.ref_cnt = 1
            out.append(block)
        if removed and self.enable_kv_events:
            self._events.append(BlockRemoved(tuple(removed)))
        return out

    def get_cached_block(self, block_hash: BlockHash) -> KVBlock | None:
        return self._cached.get(block_hash) if self.enable_caching else None

    def touch(self, blocks: Iterable[KVBlock], count_hit: bool = True) -> None:
        """Take a reference on cache hits; a hit on a free block takes it out of the eviction queue.

        `count_hit=False`: a reference that is not a use (holding blocks while others are allocated).
        """
        evictable = self._evictable
        for block in blocks:
            if block.ref_cnt == 0:
                assert block.block_hash is not None, f"touched free block {block.block_id} holds no KV"
                evictable.remove(block)
                self._ttl.remove(block)
            if count_hit:
                evictable.record_hit(block)
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference from each block, in the given order (earlier ones get evicted earlier).

        A finished request frees its whole table here: the clock is read once for all of its blocks."""
        now = self._ttl.clock()
        for block in blocks:
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, f"block {block.block_id} freed more often than taken"
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    self._empty.append(block)
                else:
                    self._evictable.append(block)
                    self._ttl.append(block, now)

    # ---- prefix cache ----------------------------------------------------------------------------------------

    def cache_blocks(
        self,
        blocks: Sequence[KVBlock],
        block_hashes: Sequence[BlockHash],
        parent_hash: BlockHash | None,
        token_ids: Sequence[int],
        block_size: int,
    ) -> None:
        """Index consecutive full blocks of one sequence by hash (their KV is written).

        `parent_hash` is the hash of the block before `blocks[0]`; `token_ids` are the blocks' tokens.
        A block already cached is left alone; when another block already holds the same hash (two
        requests computed the same prefix at once), the first one stays the cache entry and this block
        stays uncached, to be freed empty. One `BlockStored` event per unbroken run of newly cached blocks.
        """
        if not self.enable_caching:
            return
        if len(blocks) == 1:
            # One block (a decode filled it): the path taken every block_size steps per sequence.
            block = blocks[0]
            block_hash = block_hashes[0]
            if block.block_hash is None and block_hash not in self._cached:
                block.block_hash = block_hash
                self._cached[block_hash] = block
                if self.enable_kv_events:
                    tokens = tuple(token_ids[:block_size])
                    self._events.append(BlockStored((block_hash,), parent_hash, tokens, block_size))
                return
        run: list[BlockHash] = []
        run_start = 0
        run_parent = parent_hash
        for i, (block, block_hash) in enumerate(zip(blocks, block_hashes, strict=True)):
            if block.block_hash is None and block_hash not in self._cached:
                block.block_hash = block_hash
                self._cached[block_hash] = block
                if not run:
                    run_start = i
                run.append(block_hash)
                continue
            assert block.block_hash in (None, block_hash), "a cached block changed content"
            self._emit_stored(run, run_parent, token_ids, run_start, block_size)
            run = []
            run_parent = block_hash
        self._emit_stored(run, run_parent, token_ids, run_start, block_size)

    def _emit_stored(
        self,
        run: list[BlockHash],
        parent: BlockHash | None,
        token_ids: Sequence[int],
        start: int,
        block_size: int,
    ) -> None:
        if run and self.enable_kv_events:
            tokens = tuple(token_ids[start * block_size : (start + len(run)) * block_size])
            self._events.append(BlockStored(tuple(run), parent, tokens, block_size))

    def reset_prefix_cache(self) -> None:
        """Forget every hash (e.g. the weights changed). Blocks in use stay in use, just unshareable."""
        for block in list(self._evictable):
            self._evictable.remove(block)
            self._ttl.remove(block)
            block.block_hash = None
            self._empty.append(block)
        for block in self._cached.values():
            block.block_hash = None
        self._cached.clear()
        if self.enable_kv_events:
            self._events.append(AllBlocksCleared())

    # ---- cache policy ------------------------------------------------------------------------------------

    def evict_expired(self) -> int:
        """Evict every free cached block past its TTL now (it would be evicted first anyway); how many.

        Expired KV is dropped, not offloaded: the TTL says how long a prefix is worth keeping.
        """
        removed: list[BlockHash] = []
        while (block := self._ttl.pop_expired()) is not None:
            self._evictable.remove(block)
            assert block.block_hash is not None
            removed.append(block.block_hash)
            del self._cached[block.block_hash]
            block.block_hash = None
            self._empty.append(block)
        self.num_evicted_ttl += len(removed)
        if removed and self.enable_kv_events:
            self._events.append(BlockRemoved(tuple(removed)))
        return len(removed)

    def set_ttl(self, ttl_seconds: float | None) -> None:
        self._ttl.ttl_seconds = ttl_seconds

    @property
    def ttl_seconds(self) -> float | None:
        return self._ttl.ttl_seconds

    def set_eviction_policy(self, eviction: str) -> None:
        """Switch policy live: the new one starts from the old one's order (usage history is dropped)."""
        if eviction == self.eviction:
            return
        policy = _make_policy(eviction, len(self._blocks))
        for block in self._evictable:
            policy.append(block)
        self._evictable = policy
        self.eviction = eviction

    def take_events(self) -> list[KVEvent]:
        """Events since the last call, oldest first. The engine must drain these every step."""
        events, self._events = self._events, []
        return events


def _make_policy(eviction: str, num_blocks: int) -> EvictionQueue:
    factory = EVICTION_POLICIES.get(eviction)
    if factory is None:
        raise ConfigError(f"unknown eviction policy {eviction!r}; known: {sorted(EVICTION_POLICIES)}")
    return factory(num_blocks)
