"""The host (CPU memory) tier of the KV cache: an index of offloaded blocks and the copies it asks for.

When pressure evicts a cached block from the device pool, its KV is copied to a host slot keyed by the
same block hash (`offload`); a later prefix lookup that misses the device pool but hits the host tier
gets a device block and a copy back (`load`) instead of recomputing the prefix. The tier is inclusive: a
block loaded back keeps its host copy, so evicting it again costs no copy.

This file is pure bookkeeping, like the block pool: it decides *which* copies happen and records them,
in order, as `KVTransfer`s; `offload_copy.HostKVBuffers` performs them on the tensors, once per step
before the forward pass (the engine's hook). Order matters and is kept: a device block evicted and
refilled in the same step is copied out before it is copied into, and a host slot reused in the same
step is read before it is overwritten.

Its own eviction: LRU over host slots (an offload or a load makes a hash most recent). Sized in slots by
the caller from `cache.cpu_offload_gib` and the bytes of one block; resizable live.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from tokenfleet.runtime.engine.kv_cache.block_hash import BlockHash


@dataclass(frozen=True, slots=True)
class KVTransfer:
    to_host: bool  # True: device block -> host slot (offload); False: host slot -> device block (load)
    device_block_id: int
    host_slot: int


class HostKVTier:
    def __init__(self, num_slots: int):
        if num_slots < 1:
            raise ValueError(f"a host KV tier needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self._slots: OrderedDict[BlockHash, int] = OrderedDict()  # LRU first
        self._free_slots: list[int] = list(range(num_slots - 1, -1, -1))  # pop() gives slot 0 first
        self._transfers: list[KVTransfer] = []
        self.num_blocks_offloaded = 0  # device -> host copies
        self.num_blocks_loaded = 0  # host -> device copies
        self.num_evicted = 0  # host entries dropped for room
        self.num_hits = 0  # blocks a lookup found here (after missing the device pool)
        self.num_misses = 0  # blocks a lookup found in neither tier

    def __len__(self) -> int:
        return len(self._slots)

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._slots

    def hashes(self) -> list[BlockHash]:
        """Held hashes, least recently used first."""
        return list(self._slots)

    def offload(self, device_block_id: int, block_hash: BlockHash) -> None:
        """The device block holding `block_hash` is being evicted: keep its KV here."""
        if block_hash in self._slots:
            self._slots.move_to_end(block_hash)  # inclusive tier: the host copy is still good
            return
        if self._free_slots:
            slot = self._free_slots.pop()
        else:
            _, slot = self._slots.popitem(last=False)
            self.num_evicted += 1
        self._slots[block_hash] = slot
        self._transfers.append(KVTransfer(True, device_block_id, slot))
        self.num_blocks_offloaded += 1

    def load(self, block_hash: BlockHash, device_block_id: int) -> bool:
        """Copy `block_hash` back into `device_block_id` if held here; whether it was."""
        slot = self._slots.get(block_hash)
        if slot is None:
            return False
        self._slots.move_to_end(block_hash)
        self._transfers.append(KVTransfer(False, device_block_id, slot))
        self.num_blocks_loaded += 1
        return True

    def take_transfers(self) -> list[KVTransfer]:
        """Copies recorded since the last call, in the order they must run."""
        transfers, self._transfers = self._transfers, []
        return transfers

    def resize(self, num_slots: int) -> dict[int, int]:
        """Change capacity, keeping the most recent entries; returns {old slot: new slot} to copy.

        Pending transfers must have run first (they name old slots).
        """
        if num_slots < 1:
            raise ValueError(f"a host KV tier needs at least one slot, got {num_slots}")
        assert not self._transfers, "resize with copies pending"
        while len(self._slots) > num_slots:
            self._slots.popitem(last=False)
            self.num_evicted += 1
        moves = {old: new for new, old in enumerate(self._slots.values())}
        for new, block_hash in enumerate(self._slots):
            self._slots[block_hash] = new
        self.num_slots = num_slots
        self._free_slots = list(range(num_slots - 1, len(self._slots) - 1, -1))
        return moves
