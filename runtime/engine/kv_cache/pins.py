"""Pinned prefixes: token sequences whose full KV blocks are held by a reference, so nothing evicts them.

A pin needs its KV computed first: the engine runs the prefix as a request (max_tokens=1, see
engine/cache_policy.py) and registers it here with `expect`; when that request is freed the manager hands
its full, cached prompt blocks to `take`, which keeps one reference on each. The blocks stay ordinary
cached blocks — any request with that prefix hits them — they just never reach the eviction queue.
`unpin` drops the references (the blocks become evictable like any other free cached block).

The cap (`max_pinned_fraction` of all blocks) keeps pins from starving live requests: a pin that does
not fit entirely keeps its leading blocks (a prefix of a prefix still saves prefill) and the shortfall
is logged. Lowering the cap live trims the most recently pinned blocks first.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from tokenfleet.runtime.engine.kv_cache.block_pool import BlockPool, KVBlock

logger = logging.getLogger(__name__)

PinKey = tuple[int, ...]  # the pinned prefix's token ids


class PinnedPrefixes:
    def __init__(self, pool: BlockPool, max_fraction: float):
        self._pool = pool
        self.max_fraction = max_fraction
        self._pins: dict[PinKey, list[KVBlock]] = {}
        self._pending: dict[str, PinKey] = {}  # prefill request id -> the pin it computes

    @property
    def max_blocks(self) -> int:
        return int(self.max_fraction * self._pool.num_blocks)

    @property
    def num_pinned_blocks(self) -> int:
        return sum(len(blocks) for blocks in self._pins.values())

    def pin_keys(self) -> list[PinKey]:
        """Pins held or being computed."""
        return [*self._pins, *(k for k in self._pending.values() if k not in self._pins)]

    def pinned_block_ids(self, key: PinKey) -> list[int]:
        return [b.block_id for b in self._pins.get(key, ())]

    def expect(self, request_id: str, key: PinKey) -> None:
        """`request_id` computes the KV of pin `key`; its blocks are pinned when it is freed."""
        self._pending[request_id] = key

    def pending_key(self, request_id: str) -> PinKey | None:
        return self._pending.get(request_id)

    def forget(self, request_id: str) -> None:
        """The prefill of a pin ended without computing it (aborted)."""
        self._pending.pop(request_id, None)

    def take(self, request_id: str, blocks: Sequence[KVBlock]) -> int:
        """Pin the leading `blocks` (cached, referenced by the finishing request) within the cap; how many."""
        key = self._pending.pop(request_id, None)
        if key is None or key in self._pins:
            return 0
        room = max(0, self.max_blocks - self.num_pinned_blocks)
        kept = list(blocks[:room])
        if len(kept) < len(blocks):
            logger.warning(
                "pinned prefix of %d tokens: %d of its %d blocks pinned (max_pinned_fraction %.2f = %d blocks)",
                len(key),
                len(kept),
                len(blocks),
                self.max_fraction,
                self.max_blocks,
            )
        self._pool.touch(kept)
        self._pins[key] = kept
        return len(kept)

    def unpin(self, key: PinKey) -> None:
        self._pending = {rid: k for rid, k in self._pending.items() if k != key}
        blocks = self._pins.pop(key, None)
        if blocks:
            self._pool.free_blocks(reversed(blocks))  # the tail of a prefix is evicted first

    def set_max_fraction(self, max_fraction: float) -> None:
        self.max_fraction = max_fraction
        excess = self.num_pinned_blocks - self.max_blocks
        for key in reversed(list(self._pins)):
            if excess <= 0:
                break
            blocks = self._pins[key]
            drop = min(excess, len(blocks))
            tail = blocks[len(blocks) - drop :]
            del blocks[len(blocks) - drop :]
            self._pool.free_blocks(reversed(tail))
            excess -= drop
            logger.warning("max_pinned_fraction lowered: unpinned %d blocks of a pinned prefix", drop)
