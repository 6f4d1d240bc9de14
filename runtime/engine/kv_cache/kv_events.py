"""KV events: what a pod's block pool tells the router so that the router knows each pod's cache exactly.

The router keeps, per pod, the set of block hashes it holds: `BlockStored` adds hashes (a run of
consecutive blocks of one sequence, with the parent of the first so the chain can be checked),
`BlockRemoved` drops hashes (evicted for reuse), `AllBlocksCleared` drops everything (a cache reset).
Events are emitted in the order the pool changed; the engine drains them every step with
`take_events()` and publishes them with a sequence number.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenfleet.runtime.engine.kv_cache.block_hash import BlockHash


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: tuple[BlockHash, ...]  # consecutive blocks of one sequence, in order
    parent_hash: BlockHash | None  # hash of the block before the first one; None at a sequence start
    token_ids: tuple[int, ...]  # the blocks' tokens, concatenated (block_size each)
    block_size: int


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[BlockHash, ...]


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


@dataclass(frozen=True, slots=True)
class PrefillScheduled:
    """A request was scheduled for the first time: its prompt's full blocks are being computed here.

    Not a cache change (the pool emits `BlockStored` once the KV is written); it lets routers send
    requests sharing this prefix here while the prefill runs, before those blocks are stored."""

    block_hashes: tuple[BlockHash, ...]


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared | PrefillScheduled
