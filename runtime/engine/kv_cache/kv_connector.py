"""KV connectors: move the KV of cache blocks, named by their chained hash, between this engine's device
cache and somewhere else (the host tier; another pod).

A block hash names the whole prefix up to and including its block (block_hash.py), so a block's KV is
the same wherever it was computed, given the same model: a block copied in under its hash is exactly a
block this engine would have computed. That makes the transfer a cache fill, not a special request state:
`insert_prefix_blocks` takes free device blocks, lets a connector write their KV, and indexes them as
ordinary free cached blocks; a request with that prompt then gets a prefix hit through the normal lookup
and runs as any other request. Before anything is inserted the chain is recomputed from the blocks' token
ids with this engine's own hash extra (model name, pod salt, request salt): blocks from a different model,
tokenizer or salt are refused rather than served to the wrong prompt.

A connector's interface (`KVConnector`): `save` copies device blocks out by hash, `contains` asks whether a
hash is held, `load` copies held blocks into given device blocks. `HostKVConnector` is the host-memory
tier's (offload.py + offload_copy.py). The remote one is split the way the bytes flow: the prefill pod holds
its finished prompt's blocks (kv_holds.py) and serves `read_blocks` payloads; the decode pod writes
received payloads with `write_blocks` (the server's kv_transfer.py is the HTTP transport between them).

Block payload layout (`KVLayout`): for each layer in order its K block then its V block, each the raw
bytes of a contiguous `[block_size, num_kv_heads, head_dim]` tensor of the cache dtype (native byte order).
Under tensor parallelism a pod's block is its ranks' shards of it, rank 0 first, each in that layout over
the rank's own KV heads (`tp_size` ranks; engine/parallel/kv_shards.py gathers and scatters them): only a
pod with the same split can use it, so `check_layout` refuses another `tp_size`, naming both.
All functions here run on the engine thread (they touch the block pool and the cache tensors).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from tokenfleet.runtime.engine.kv_cache.block_hash import (
    BlockHash,
    encode_extra,
    hash_block_encoded,
    with_adapter,
)
from tokenfleet.runtime.engine.kv_cache.manager import KVCacheManager
from tokenfleet.runtime.engine.kv_cache.offload import HostKVTier
from tokenfleet.runtime.engine.kv_cache.offload_copy import HostKVBuffers, KVCaches
from tokenfleet.runtime.errors import TokenfleetError


class KVTransferError(TokenfleetError):
    """Blocks offered for insertion do not belong to this engine's cache (layout or hash chain differ)."""


@dataclass(frozen=True, slots=True)
class KVLayout:
    num_layers: int
    block_shape: tuple[int, ...]  # [block_size, num_kv_heads, head_dim] of one rank's shard
    dtype: str  # torch dtype name, e.g. "float32"
    itemsize: int
    tp_size: int = 1  # shards per block: the pod's tensor-parallel ranks

    @property
    def bytes_per_tensor(self) -> int:
        n = self.itemsize
        for d in self.block_shape:
            n *= d
        return n

    @property
    def bytes_per_shard(self) -> int:
        return 2 * self.num_layers * self.bytes_per_tensor

    @property
    def bytes_per_block(self) -> int:
        return self.tp_size * self.bytes_per_shard

    def as_json(self) -> dict:
        return {
            "num_layers": self.num_layers,
            "block_shape": list(self.block_shape),
            "dtype": self.dtype,
            "tp_size": self.tp_size,
        }


def layout_of(kv_caches: KVCaches, tp_size: int = 1) -> KVLayout:
    """The layout of a pod's blocks; `kv_caches` is this process's cache (rank 0's shard under TP)."""
    k = kv_caches[0][0]
    dtype = str(k.dtype).removeprefix("torch.")
    return KVLayout(len(kv_caches), tuple(k.shape[1:]), dtype, k.element_size(), tp_size)


def check_layout(ours: KVLayout, theirs: dict) -> None:
    """Raise KVTransferError unless blocks of layout `theirs` (as_json; a sender without `tp_size` is one
    process) can be written into our cache as they are."""
    their_tp = int(theirs.get("tp_size", 1))
    if their_tp != ours.tp_size:
        raise KVTransferError(
            f"tensor_parallel_size differs: the sending pod has {their_tp}, this pod {ours.tp_size} (each "
            "rank holds only its KV heads; both roles need the same size)"
        )
    if {**theirs, "tp_size": their_tp} != ours.as_json():
        raise KVTransferError(f"remote KV layout {theirs} is not ours {ours.as_json()}")


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)  # every dtype (fp8 included) moves as bytes


@torch.inference_mode()
def read_blocks(kv_caches: KVCaches, block_ids: Sequence[int]) -> list[bytes]:
    """The payload of each device block (layout in the module docstring)."""
    if not block_ids:
        return []
    idx = torch.tensor(list(block_ids), dtype=torch.long, device=kv_caches[0][0].device)
    parts = [_raw(t.index_select(0, idx)).cpu() for pair in kv_caches for t in pair]  # [n, bytes] each
    out = []
    for i in range(len(block_ids)):
        out.append(b"".join(p[i].numpy().tobytes() for p in parts))
    return out


@torch.inference_mode()
def write_blocks(kv_caches: KVCaches, block_ids: Sequence[int], payloads: Sequence[bytes]) -> None:
    """Write payloads (as read by `read_blocks` from a cache of the same layout) into device blocks."""
    if not block_ids:
        return
    layout = layout_of(kv_caches)
    per = layout.bytes_per_tensor
    for payload in payloads:
        if len(payload) != layout.bytes_per_block:
            raise KVTransferError(
                f"a block payload has {len(payload)} bytes, this cache's blocks have {layout.bytes_per_block}"
            )
    device = kv_caches[0][0].device
    idx = torch.tensor(list(block_ids), dtype=torch.long, device=device)
    flat = torch.frombuffer(bytearray(b"".join(payloads)), dtype=torch.uint8).view(len(payloads), -1)
    j = 0
    for pair in kv_caches:
        for t in pair:
            raw = _raw(t)
            src = flat[:, j * per : (j + 1) * per].reshape(len(payloads), *raw.shape[1:])
            raw.index_copy_(0, idx, src.to(device))
            j += 1


class KVConnector(Protocol):
    """Where block KV can be saved to and loaded from, by block hash."""

    def save(self, kv_caches: KVCaches, blocks: Sequence[tuple[BlockHash, int]]) -> int:
        """Copy out each (hash, device block id); how many were saved."""
        ...

    def contains(self, block_hash: BlockHash) -> bool: ...

    def load(self, kv_caches: KVCaches, blocks: Sequence[tuple[BlockHash, int]]) -> int:
        """Copy the held KV of each hash into its device block, stopping at the first one not held; how many."""
        ...


class HostKVConnector:
    """The host-memory tier as a connector: the same LRU slots the pressure offload fills."""

    def __init__(self, tier: HostKVTier, buffers: HostKVBuffers):
        self.tier = tier
        self.buffers = buffers

    def save(self, kv_caches: KVCaches, blocks: Sequence[tuple[BlockHash, int]]) -> int:
        for block_hash, block_id in blocks:
            self.tier.offload(block_id, block_hash)
        self.buffers.run(self.tier.take_transfers(), kv_caches)
        return len(blocks)

    def contains(self, block_hash: BlockHash) -> bool:
        return block_hash in self.tier

    def load(self, kv_caches: KVCaches, blocks: Sequence[tuple[BlockHash, int]]) -> int:
        n = 0
        for block_hash, block_id in blocks:
            if not self.tier.load(block_hash, block_id):
                break
            n += 1
        self.buffers.run(self.tier.take_transfers(), kv_caches)
        return n


# ---- the device cache side ----------------------------------------------------------------------------------


def cached_prefix_len(manager: KVCacheManager, block_hashes: Sequence[BlockHash]) -> int:
    """How many leading blocks of a chain the device cache holds now."""
    n = 0
    for block_hash in block_hashes:
        if manager.pool.get_cached_block(block_hash) is None:
            break
        n += 1
    return n


def check_chain(
    manager: KVCacheManager,
    block_hashes: Sequence[BlockHash],
    token_ids: Sequence[int],
    cache_salt: str | None,
    parent: BlockHash | None = None,
    adapter_key: str | None = None,
) -> None:
    """Raise KVTransferError unless `block_hashes` are this engine's hashes of `token_ids` after `parent`
    (run under the LoRA adapter this engine keys `adapter_key`, None for the base model)."""
    bs = manager.block_size
    if len(token_ids) != len(block_hashes) * bs:
        raise KVTransferError(
            f"{len(block_hashes)} blocks need {len(block_hashes) * bs} token ids, got {len(token_ids)}"
        )
    extra = encode_extra(with_adapter(manager.hash_extra, cache_salt, adapter_key))
    for i, block_hash in enumerate(block_hashes):
        parent = hash_block_encoded(parent, token_ids[i * bs : (i + 1) * bs], extra)
        if parent != block_hash:
            raise KVTransferError(
                f"block {i}: hash differs from this engine's hash of its tokens (another "
                "model, tokenizer, cache salt or LoRA adapter)"
            )


def insert_prefix_blocks(
    manager: KVCacheManager,
    block_hashes: Sequence[BlockHash],
    token_ids: Sequence[int],
    parent: BlockHash | None,
    fill: Callable[[list[int]], int],
) -> int:
    """Make consecutive blocks of one prefix (after `parent`) free cached blocks of the device cache.

    Takes free blocks (never more than are free), lets `fill(block_ids)` write their KV — it returns how
    many leading blocks it wrote — and indexes those by hash. They are freed at once: ordinary free cached
    blocks, hit by the next lookup of that prefix, evictable under pressure like any other (an eviction
    before the request is scheduled costs a recompute of those blocks, never a wrong token). Returns how
    many blocks were inserted. The caller checked the chain (`check_chain`).
    """
    pool = manager.pool
    n = min(len(block_hashes), pool.num_free_blocks)
    if n == 0:
        return 0
    blocks = pool.get_new_blocks(n)
    # Taking them may have evicted cached blocks into the host tier: those copies must run before `fill`
    # overwrites the victims, or the host would keep this prefix's KV under the evicted hashes.
    manager.run_host_transfers()
    try:
        written = max(0, min(n, fill([b.block_id for b in blocks])))
        bs = manager.block_size
        pool.cache_blocks(blocks[:written], block_hashes[:written], parent, token_ids[: written * bs], bs)
    finally:
        pool.free_blocks(reversed(blocks))
    return written
