"""A pod's KV blocks under tensor parallelism: every rank's shard, gathered by rank 0 and scattered back.

Each rank's cache holds only its KV heads of every block, so a block that leaves the pod (a disaggregated
prefill's held prompt) is all of its shards, and one that arrives must reach every rank. Rank 0 (the
serving process, which owns the scheduler and the block ids) moves them over the workers' existing pipes:
`read` asks each worker for its shard of the given blocks and joins them, rank 0's first, into one payload
per block; `write` splits each payload into its shards, writes its own and sends each worker its part.

Why rank 0 and not each rank fetching its shard by hash from its peer rank: the block ids, the holds, the
hash chain check and the prefix-cache index all live on rank 0 only (workers have no block pool), and the
HTTP transport ends there; workers only follow rank 0's messages. The pipes already carry each step, in
order, with the host KV tier's queued copies (parallel/host_kv.py) replayed first — so a read or write
lands on every rank between the same two forwards, after the same host-tier copies, as on rank 0.

Rank 0 checks every payload against its own shard's layout before any rank writes: all shards have the
same shape (the KV heads split evenly, or one replicated head each), so a worker never gets bytes that do
not fit. All of it runs on the engine thread, between steps.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenfleet.runtime.engine.kv_cache.kv_connector import (
    KVLayout,
    KVTransferError,
    layout_of,
    read_blocks,
    write_blocks,
)
from tokenfleet.runtime.engine.kv_cache.offload_copy import KVCaches
from tokenfleet.runtime.engine.parallel.workers import TPWorkers


def join_shards(shards: Sequence[Sequence[bytes]]) -> list[bytes]:
    """`shards[rank][i]` -> one payload per block i: its shards in rank order."""
    counts = {len(s) for s in shards}
    if len(counts) > 1:
        raise KVTransferError(f"ranks returned different numbers of blocks: {[len(s) for s in shards]}")
    return [b"".join(parts) for parts in zip(*shards, strict=True)]


def split_shards(payloads: Sequence[bytes], tp_size: int) -> list[list[bytes]]:
    """The inverse of `join_shards`: per rank, its shard of each payload (payloads split in equal parts)."""
    out: list[list[bytes]] = [[] for _ in range(tp_size)]
    for payload in payloads:
        size, rest = divmod(len(payload), tp_size)
        if rest:
            raise KVTransferError(f"a {len(payload)}-byte block does not split into {tp_size} equal shards")
        view = memoryview(payload)
        for rank in range(tp_size):
            out[rank].append(bytes(view[rank * size : (rank + 1) * size]))
    return out


class PodKV:
    """The KV cache of the whole pod: this process's tensors and, under tensor parallelism, the workers'."""

    def __init__(self, kv_caches: KVCaches, workers: TPWorkers | None):
        self.kv_caches = kv_caches
        self.workers = workers

    @property
    def tp_size(self) -> int:
        return 1 if self.workers is None else self.workers.size

    @property
    def layout(self) -> KVLayout:
        return layout_of(self.kv_caches, self.tp_size)

    def read(self, block_ids: Sequence[int]) -> list[bytes]:
        """One payload per block: every rank's shard of it, rank 0 first."""
        own = read_blocks(self.kv_caches, block_ids)
        if self.workers is None or not block_ids:
            return own
        return join_shards([own, *self.workers.read_kv(block_ids)])

    def write(self, block_ids: Sequence[int], payloads: Sequence[bytes]) -> None:
        """Write whole-pod payloads (as `read` gives them, from a pod of the same layout) into device blocks."""
        if not block_ids:
            return
        layout = self.layout
        for payload in payloads:
            if len(payload) != layout.bytes_per_block:
                raise KVTransferError(
                    f"a block payload has {len(payload)} bytes, this pod's blocks have {layout.bytes_per_block}"
                    f" ({layout.tp_size} shard(s) of {layout.bytes_per_shard})"
                )
        if self.workers is None:
            write_blocks(self.kv_caches, block_ids, payloads)
            return
        shards = split_shards(payloads, self.tp_size)
        write_blocks(self.kv_caches, block_ids, shards[0])
        self.workers.write_kv(block_ids, shards[1:])
