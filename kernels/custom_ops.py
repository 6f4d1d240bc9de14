"""The Triton kernels of a decode step as torch.library custom ops, so torch.compile graphs can call them.

A compiled (and, on CUDA, graph-captured) decode step cannot trace into a launcher's Python: its shape
checks and grid arithmetic run once at trace time, and the launch must be one opaque node that the graph
replays. The op here takes only tensors and static figures: the longest possible context (block table
width x block size) bounds the split-KV grid, so nothing depends on host values that change per step —
programs past a sequence's real length exit at once. The cache write and the attention are one op that
declares the caches as mutated, so the compiler orders the layers' writes and reads correctly.
"""

from __future__ import annotations

import torch
from tokenfleet.kernels.cache_ops import write_kv_cache
from tokenfleet.kernels.paged_attention import paged_decode_attention


@torch.library.custom_op("tokenfleet::triton_paged_decode", mutates_args=("k_cache", "v_cache"))
def triton_paged_decode(
    q: torch.Tensor,  # [B, Hq, D]: one query token per sequence
    k: torch.Tensor,  # [B, Hkv, D]: the step's new keys
    v: torch.Tensor,  # [B, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # int64 [B]
    block_tables: torch.Tensor,  # int32 [B, max_blocks_per_seq]
    seq_lens: torch.Tensor,  # int32 [B], new token included
    scale: float,
    k_scale: torch.Tensor | None,  # float32 [1] (fp8 cache only)
    v_scale: torch.Tensor | None,
    softcap: float | None = None,  # Gemma 2: logit cap and this layer's window (None = off)
    sliding_window: int | None = None,
) -> torch.Tensor:
    write_kv_cache(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    num_seqs = q.shape[0]
    query_start_loc = torch.arange(num_seqs + 1, dtype=torch.int32, device=q.device)
    return paged_decode_attention(
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        scale,
        max_query_len=1,
        max_seq_len=block_tables.shape[1] * k_cache.shape[1],
        k_scale=k_scale,
        v_scale=v_scale,
        softcap=softcap,
        sliding_window=sliding_window,
    )


@triton_paged_decode.register_fake
def _triton_paged_decode_fake(
    q,
    k,
    v,
    k_cache,
    v_cache,
    slot_mapping,
    block_tables,
    seq_lens,
    scale,
    ks,
    vs,
    softcap=None,
    sliding_window=None,
):
    return torch.empty_like(q)
