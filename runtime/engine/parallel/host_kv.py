"""The host KV tier under tensor parallelism: rank 0 decides, every rank copies its own heads.

Each rank's KV cache holds only its heads, so a host copy of a block is a copy on every rank. The decision
stays with rank 0's KV manager (which blocks go out, which come back, which host slot): its host tier
records `KVTransfer`s exactly as with one process, rank 0 runs them on its shard at once, and the same
operations queue here to travel with the next step to the workers, which replay them on their own shard
(`HostKVReplica.apply`) before that step's forward pass.

Replaying them later is equivalent: between two forwards only copies touch the KV cache, and the next
forward is the first reader, so every rank holds the same blocks (its heads of them) when it runs. The
queue keeps the recorded order, which matters (see offload.py). Sizing the host buffers (on, resize, off)
is an operation too, so a live config change reaches every rank in order with the copies.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tokenfleet.runtime.engine.kv_cache.offload import KVTransfer
from tokenfleet.runtime.engine.kv_cache.offload_copy import HostKVBuffers, KVCaches


@dataclass(frozen=True, slots=True)
class HostKVAlloc:
    num_slots: int  # new, empty host buffers


@dataclass(frozen=True, slots=True)
class HostKVResize:
    moves: dict[int, int]  # {old slot: new slot}, from HostKVTier.resize
    num_slots: int


@dataclass(frozen=True, slots=True)
class HostKVFree:
    pass  # the tier is off: drop the buffers


@dataclass(frozen=True, slots=True)
class HostKVCopy:
    transfers: tuple[KVTransfer, ...]


HostKVOp = HostKVAlloc | HostKVResize | HostKVFree | HostKVCopy


class HostKVReplica:
    """A worker's host buffers, driven by rank 0's operations."""

    def __init__(self) -> None:
        self.buffers: HostKVBuffers | None = None

    def apply(self, ops: Sequence[HostKVOp], kv_caches: KVCaches) -> None:
        for op in ops:
            if isinstance(op, HostKVAlloc):
                self.buffers = HostKVBuffers(kv_caches, op.num_slots)
            elif isinstance(op, HostKVFree):
                self.buffers = None
            elif self.buffers is None:
                raise RuntimeError(f"host KV operation {type(op).__name__} before the buffers exist")
            elif isinstance(op, HostKVResize):
                self.buffers.resize(op.moves, op.num_slots)
            else:
                self.buffers.run(op.transfers, kv_caches)
