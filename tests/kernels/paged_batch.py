"""Kernel test fixture: one random step over a paged KV cache (`make_paged_batch` -> `PagedBatch`)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from tokenfleet.kernels._utils import cdiv
from tokenfleet.kernels.fp8_format import FP8_DTYPE


@dataclass(frozen=True, slots=True)
class PagedBatch:
    """A random step over a paged cache, shared by the kernel tests.

    Sequence b has context_lens[b] cached tokens and query_lens[b] new ones (seq_lens = their sum).
    """

    q: torch.Tensor  # [T, Hq, D]
    k: torch.Tensor  # [T, Hkv, D] new keys of the step
    v: torch.Tensor  # [T, Hkv, D]
    k_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # int32 [B, max_blocks]
    seq_lens: torch.Tensor  # int32 [B]
    query_start_loc: torch.Tensor  # int32 [B + 1]
    slot_mapping: torch.Tensor  # int64 [T]
    query_lens: tuple[int, ...]
    seq_lens_list: tuple[int, ...]
    k_scale: torch.Tensor | None  # float32 [1] with an fp8 cache
    v_scale: torch.Tensor | None

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens)

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens_list)


def make_paged_batch(
    query_lens: Sequence[int],
    context_lens: Sequence[int],
    *,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
    cache_dtype: torch.dtype | None = None,
    num_blocks: int | None = None,
    caches: tuple[torch.Tensor, torch.Tensor] | None = None,
    physical_blocks: Sequence[int] | None = None,
    new_kv_in_cache: bool = True,
    poison: bool = True,
    seed: int = 0,
) -> PagedBatch:
    """Random q/k/v and a paged cache whose blocks are handed out in shuffled order.

    Only the blocks the batch uses are written (so `caches` may be a huge, lazily committed allocation).
    With `poison`, cache rows no sequence owns inside its blocks, and the new tokens' rows when
    `new_kv_in_cache` is False, hold NaN: a kernel that reads one of them returns NaN. An fp8 cache holds
    values quantised by torch with scales 0.5 (K) and 0.25 (V).
    """
    gen = torch.Generator().manual_seed(seed)
    device = torch.device(device)
    cache_dtype = cache_dtype or dtype
    seq_lens = [c + n for c, n in zip(context_lens, query_lens, strict=True)]
    blocks_per_seq = [cdiv(s, block_size) for s in seq_lens]
    needed = sum(blocks_per_seq)
    if caches is None:
        num_blocks = num_blocks or needed + 3
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        caches = (
            torch.empty(shape, dtype=cache_dtype, device=device),
            torch.empty(shape, dtype=cache_dtype, device=device),
        )
    k_cache, v_cache = caches
    if physical_blocks is None:
        physical_blocks = torch.randperm(k_cache.shape[0], generator=gen)[:needed].tolist()
    if len(physical_blocks) < needed:
        raise ValueError(f"batch needs {needed} blocks, got {len(physical_blocks)} physical_blocks")

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    total = sum(query_lens)
    q, k, v = (
        randn(total, num_q_heads, head_dim),
        randn(total, num_kv_heads, head_dim),
        randn(total, num_kv_heads, head_dim),
    )
    fp8 = cache_dtype == FP8_DTYPE
    k_scale = torch.tensor([0.5]) if fp8 else None
    v_scale = torch.tensor([0.25]) if fp8 else None

    block_tables = torch.zeros(len(seq_lens), max(blocks_per_seq), dtype=torch.int32)
    slots, cursor, start = [], 0, 0
    for b, (ctx, n, s) in enumerate(zip(context_lens, query_lens, seq_lens, strict=True)):
        ids = list(physical_blocks[cursor : cursor + blocks_per_seq[b]])
        cursor += blocks_per_seq[b]
        block_tables[b, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
        # Logical rows of this sequence: cached context, then the new tokens, then NaN (or random) padding.
        rows_k = torch.cat([randn(ctx, num_kv_heads, head_dim).float(), k[start : start + n].float()])
        rows_v = torch.cat([randn(ctx, num_kv_heads, head_dim).float(), v[start : start + n].float()])
        pad = len(ids) * block_size - s
        filler = float("nan") if poison else 0.0
        rows_k = torch.cat([rows_k, torch.full((pad, num_kv_heads, head_dim), filler)])
        rows_v = torch.cat([rows_v, torch.full((pad, num_kv_heads, head_dim), filler)])
        if not new_kv_in_cache:
            rows_k[ctx:s] = filler
            rows_v[ctx:s] = filler
        if fp8:
            rows_k, rows_v = rows_k / k_scale, rows_v / v_scale
        idx = torch.tensor(ids, dtype=torch.long, device=device)
        k_cache[idx] = rows_k.view(len(ids), block_size, num_kv_heads, head_dim).to(
            device=device, dtype=cache_dtype
        )
        v_cache[idx] = rows_v.view(len(ids), block_size, num_kv_heads, head_dim).to(
            device=device, dtype=cache_dtype
        )
        slots += [ids[p // block_size] * block_size + p % block_size for p in range(ctx, s)]
        start += n

    query_start_loc = torch.tensor([0, *itertools.accumulate(query_lens)], dtype=torch.int32)
    return PagedBatch(
        q=q.to(device),
        k=k.to(device),
        v=v.to(device),
        k_cache=k_cache,
        v_cache=v_cache,
        block_tables=block_tables.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        query_start_loc=query_start_loc.to(device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_lens=tuple(query_lens),
        seq_lens_list=tuple(seq_lens),
        k_scale=None if k_scale is None else k_scale.to(device),
        v_scale=None if v_scale is None else v_scale.to(device),
    )
