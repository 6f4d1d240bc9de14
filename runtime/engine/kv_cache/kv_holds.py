"""Held prefixes: a prefill pod keeps the KV blocks of a finished prefill until a decode pod fetches them.

Right after a prefill-only request finishes, its full prompt blocks are free cached blocks; `hold` takes one
reference on the leading ones still cached (a pressure eviction in between shortens the hold; the decode pod
then recomputes the rest), so nothing evicts them. The hold ends exactly once: `take` (a fetch: the caller
copies the KV, then calls `free`), `release`, or `expire` past its deadline — the pod sweeps holds on a
timer, so an abandoned transfer frees its blocks after `ttl` seconds and nothing leaks. A taken hold is the
fetch's alone: a concurrent release or expiry cannot free blocks still being copied. Engine thread only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tokenfleet.runtime.engine.kv_cache.block_hash import BlockHash
from tokenfleet.runtime.engine.kv_cache.block_pool import KVBlock
from tokenfleet.runtime.engine.kv_cache.manager import KVCacheManager


@dataclass(frozen=True, slots=True)
class Hold:
    blocks: tuple[KVBlock, ...]
    block_hashes: tuple[BlockHash, ...]  # of the held blocks, in prompt order
    token_ids: tuple[int, ...]  # the held blocks' tokens (len = blocks * block_size)
    cache_salt: str | None
    deadline: float

    @property
    def block_ids(self) -> list[int]:
        return [b.block_id for b in self.blocks]


class KVHolds:
    def __init__(self, manager: KVCacheManager):
        self._manager = manager
        self._holds: dict[str, Hold] = {}
        self.num_expired = 0

    def __len__(self) -> int:
        return len(self._holds)

    @property
    def num_held_blocks(self) -> int:
        return sum(len(h.blocks) for h in self._holds.values())

    def hold(
        self,
        hold_id: str,
        block_hashes: Sequence[BlockHash],
        token_ids: Sequence[int],
        cache_salt: str | None,
        deadline: float,
    ) -> Hold:
        """Reference the leading cached blocks of `block_hashes` (the prompt's); the hold (maybe empty)."""
        if hold_id in self._holds:
            raise ValueError(f"hold {hold_id!r} exists")
        pool = self._manager.pool
        blocks: list[KVBlock] = []
        for block_hash in block_hashes:
            block = pool.get_cached_block(block_hash)
            if block is None:
                break
            blocks.append(block)
        pool.touch(blocks, count_hit=False)
        bs = self._manager.block_size
        hold = Hold(
            tuple(blocks),
            tuple(block_hashes[: len(blocks)]),
            tuple(token_ids[: len(blocks) * bs]),
            cache_salt,
            deadline,
        )
        self._holds[hold_id] = hold
        return hold

    def ids(self) -> set[str]:
        return set(self._holds)

    def num_blocks(self, hold_id: str) -> int | None:
        hold = self._holds.get(hold_id)
        return None if hold is None else len(hold.blocks)

    def take(self, hold_id: str) -> Hold | None:
        """Hand the hold over to a fetch: it leaves the registry (no release or expiry can free its blocks
        while they are copied) and the fetch frees it with `free` when done. None when unknown or expired."""
        return self._holds.pop(hold_id, None)

    def free(self, hold: Hold) -> None:
        self._manager.pool.free_blocks(reversed(hold.blocks))  # the tail of a prefix is evicted first

    def release(self, hold_id: str) -> bool:
        hold = self._holds.pop(hold_id, None)
        if hold is None:
            return False
        self.free(hold)
        return True

    def expire(self, now: float) -> int:
        """Release every hold past its deadline; how many."""
        expired = [hid for hid, h in self._holds.items() if h.deadline <= now]
        for hid in expired:
            self.release(hid)
        self.num_expired += len(expired)
        return len(expired)
