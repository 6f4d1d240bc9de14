"""Paged decode attention: a few query tokens per sequence against its paged KV cache (GQA/MQA, split-KV).

Decode is memory-bound: what matters is reading each K/V row once. One program serves one
(sequence, kv head, split) and all query heads sharing that kv head times the sequence's query tokens (1 for
plain decode, 1 + k for speculative verification), packed as the rows of one tile so K/V loaded once feed a
tensor-core dot of >= 16 rows. Keys are gathered row by row through the block table, so a key tile may span
several physical blocks. Long contexts split the keys over NUM_SPLITS programs whose partial results (output
normalised per split + log-sum-exp) a reduce kernel merges; softmax is in fp32 throughout (exp2 domain).

The new tokens' K/V must already be in the cache (cache_ops.write_kv_cache runs first): query token i of a
sequence with q_len queries and seq_len keys sits at position seq_len - q_len + i and sees keys 0..that.

Optional (Gemma 2), each a compile-time switch so other models' kernels are unchanged: `softcap` caps the
scores (softcap * tanh(s / softcap)) before the mask; `sliding_window` W hides keys more than W - 1 positions
behind the query, and the key walk starts at the first tile any query of the sequence can see.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from tokenfleet.kernels._utils import (
    COMPUTE_DTYPES,
    causal_attention_ref,
    cdiv,
    check_paged_args,
    check_softcap_window,
    check_tensor,
    check_tile,
    dot_precision,
    gather_kv_ref,
    interpreter_active,
    next_power_of_2,
)
from tokenfleet.kernels.attention_tiles import (
    LOG2E,
    dequantize,
    online_softmax,
    paged_kv_offsets,
    served_sequence,
    soft_cap,
)
from tokenfleet.kernels.fp8_format import FP8_DTYPE

# Rows of one program: query heads per kv head x query tokens per sequence. Past this, use prefill_attention.
MAX_DECODE_ROWS = 128


@triton.jit
def _paged_decode_kernel(
    q_ptr,  # [num_tokens, num_q_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables_ptr,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens_ptr,  # [num_seqs] int32: keys per sequence, new tokens included
    query_start_loc_ptr,  # [num_seqs + 1] int32
    seq_ids_ptr,  # [num_served] int32: the batch entries this launch serves
    k_scale_ptr,  # [1] float32 (fp8 cache only)
    v_scale_ptr,  # [1] float32 (fp8 cache only)
    out_ptr,  # [num_tokens, num_q_heads, head_dim]  (NUM_SPLITS == 1)
    part_out_ptr,  # [num_served * max_query_len, num_q_heads, NUM_SPLITS, head_dim] float32
    part_lse_ptr,  # [num_served * max_query_len, num_q_heads, NUM_SPLITS] float32
    scale,
    softcap,  # logit cap (SOFTCAP only)
    window,  # keys visible behind and including the query (SLIDING only)
    max_query_len,
    stride_qt,
    stride_qh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    stride_ot,
    stride_oh,
    QUERIES_PER_KV: tl.constexpr,
    NUM_Q_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    FP8: tl.constexpr,
    SOFTCAP: tl.constexpr,
    SLIDING: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid_seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq, q_start, q_len = served_sequence(seq_ids_ptr, query_start_loc_ptr, pid_seq)
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len

    # Row r of the tile = query token r // QUERIES_PER_KV of the sequence, head kv_head * G + r % G.
    offs_m = tl.arange(0, BLOCK_M)
    q_idx = offs_m // QUERIES_PER_KV
    head = kv_head * QUERIES_PER_KV + offs_m % QUERIES_PER_KV
    row_valid = q_idx < q_len
    q_pos = context_len + q_idx
    offs_d = tl.arange(0, BLOCK_D)
    d_valid = offs_d < HEAD_DIM
    q_rows = (q_start + q_idx).to(tl.int64)
    q = tl.load(
        q_ptr + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
        mask=row_valid[:, None] & d_valid[None, :],
        other=0.0,
    )

    # Each split covers a BLOCK_N-aligned key range; trailing splits of a short sequence get none. With a
    # window, keys before the earliest query's window are never read: the range starts at its tile.
    if SLIDING:
        first_key = (tl.maximum(context_len - window + 1, 0) // BLOCK_N) * BLOCK_N
        keys_per_split = tl.cdiv(tl.cdiv(seq_len - first_key, NUM_SPLITS), BLOCK_N) * BLOCK_N
        key_start = first_key + split * keys_per_split
    else:
        keys_per_split = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
        key_start = split * keys_per_split
    key_end = tl.minimum(key_start + keys_per_split, seq_len)

    qk_scale = scale * LOG2E
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)  # finite: keeps exp2(m_old - m_new) NaN-free
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    if FP8:
        k_scale = tl.load(k_scale_ptr)
        v_scale = tl.load(v_scale_ptr)
    kv_head_off = kv_head.to(tl.int64) * stride_ch
    for start_n in range(key_start, key_end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        key_valid = offs_n < key_end
        kv_off = paged_kv_offsets(
            block_tables_ptr, seq, offs_n, key_valid, kv_head_off, stride_bt, stride_cb, stride_cs, BLOCK_SIZE
        )
        kv_mask = key_valid[None, :] & d_valid[:, None]
        k = tl.load(k_cache_ptr + kv_off[None, :] + offs_d[:, None], mask=kv_mask, other=0.0)  # [D, N]
        if FP8:
            k = dequantize(k, k_scale, q.dtype)
        qk = tl.dot(q, k, input_precision=DOT_PRECISION)
        if SOFTCAP:  # noqa: SIM108 (a compile-time branch: the other side is never compiled)
            qk = soft_cap(qk * scale, softcap) * LOG2E
        else:
            qk = qk * qk_scale
        visible = key_valid[None, :] & (offs_n[None, :] <= q_pos[:, None])
        if SLIDING:
            visible = visible & (offs_n[None, :] > q_pos[:, None] - window)
        p, alpha, m_i, l_i = online_softmax(tl.where(visible, qk, float("-inf")), m_i, l_i)
        # V is loaded after the scores, so its [N, D] tile is not held in registers across the QK dot.
        v = tl.load(
            v_cache_ptr + kv_off[:, None] + offs_d[None, :], mask=tl.trans(kv_mask), other=0.0
        )  # [N, D]
        if FP8:
            v = dequantize(v, v_scale, q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)

    has_keys = l_i > 0.0
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    out_mask = row_valid[:, None] & d_valid[None, :]
    if NUM_SPLITS == 1:
        o_ptrs = out_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        # Partials are indexed by (served sequence, query token): compact, whatever else is in the batch.
        p_rows = (pid_seq * max_query_len + q_idx).to(tl.int64)
        p_base = (p_rows * NUM_Q_HEADS + head) * NUM_SPLITS + split
        tl.store(part_out_ptr + p_base[:, None] * HEAD_DIM + offs_d[None, :], out, mask=out_mask)
        lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + p_base, lse, mask=row_valid)


@triton.jit
def _split_reduce_kernel(
    part_out_ptr,  # [num_served * max_query_len, num_q_heads, NUM_SPLITS, head_dim] float32
    part_lse_ptr,  # [num_served * max_query_len, num_q_heads, NUM_SPLITS] float32
    query_start_loc_ptr,  # [num_seqs + 1] int32
    seq_ids_ptr,  # [num_served] int32
    out_ptr,  # [num_tokens, num_q_heads, head_dim]
    max_query_len,
    stride_ot,
    stride_oh,
    NUM_Q_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_P2: tl.constexpr,
):
    pid_seq = tl.program_id(0)
    head = tl.program_id(1)
    _, q_start, q_len = served_sequence(seq_ids_ptr, query_start_loc_ptr, pid_seq)
    offs_s = tl.arange(0, SPLITS_P2)
    offs_d = tl.arange(0, BLOCK_D)
    s_valid = offs_s < NUM_SPLITS
    d_valid = offs_d < HEAD_DIM
    for q_idx in range(0, q_len):
        p_base = ((pid_seq * max_query_len + q_idx).to(tl.int64) * NUM_Q_HEADS + head) * NUM_SPLITS
        lse = tl.load(part_lse_ptr + p_base + offs_s, mask=s_valid, other=float("-inf"))
        lse_max = tl.max(lse, 0)
        weight = tl.exp2(lse - tl.where(lse_max == float("-inf"), 0.0, lse_max))
        part = tl.load(
            part_out_ptr + (p_base + offs_s)[:, None] * HEAD_DIM + offs_d[None, :],
            mask=s_valid[:, None] & d_valid[None, :],
            other=0.0,
        )
        out = tl.sum(part * weight[:, None], 0) / tl.maximum(tl.sum(weight, 0), 1e-30)
        row = (q_start + q_idx).to(tl.int64)
        tl.store(
            out_ptr + row * stride_ot + head * stride_oh + offs_d,
            out.to(out_ptr.dtype.element_ty),
            mask=d_valid,
        )


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def default_num_splits(num_served: int, num_kv_heads: int, max_seq_len: int, device: torch.device) -> int:
    """Enough programs to fill the GPU a few times over, each split still reading >= 256 keys."""
    if device.type != "cuda":
        return 1
    sm_count = _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    programs = max(1, num_served * num_kv_heads)
    return max(1, min(cdiv(4 * sm_count, programs), cdiv(max_seq_len, 256), 32))


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    *,
    max_query_len: int,
    max_seq_len: int,
    seq_ids: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    num_splits: int | None = None,
    block_n: int | None = None,
    out: torch.Tensor | None = None,
    softcap: float | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Causal attention of q [T, Hq, D] over the paged cache for the sequences in `seq_ids` (default: all).

    `max_query_len` / `max_seq_len` bound the served sequences (host ints: no device sync). Rows of `out`
    belonging to other sequences are left untouched, so a prefill kernel can fill them. Returns `out`.
    `softcap` / `sliding_window`: Gemma 2's logit cap and window (see the module docstring); None = off.
    """
    q = check_tensor("q", q, ndim=3, dtypes=COMPUTE_DTYPES)
    check_softcap_window(softcap, sliding_window)
    num_tokens, num_q_heads, head_dim = q.shape
    if not (isinstance(k_cache, torch.Tensor) and k_cache.dim() == 4):
        raise ValueError(
            f"k_cache must be [num_blocks, block_size, num_kv_heads, head_dim], got {k_cache!r:.80}"
        )
    num_kv_heads = k_cache.shape[2]
    args = check_paged_args(
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        num_kv_heads=num_kv_heads,
        seq_ids=seq_ids,
        out=out,
        k_scale=k_scale,
        v_scale=v_scale,
    )
    queries_per_kv = num_q_heads // num_kv_heads
    if max_query_len < 1 or queries_per_kv * max_query_len > MAX_DECODE_ROWS:
        raise ValueError(
            f"max_query_len={max_query_len} with {queries_per_kv} q heads per kv head exceeds the decode kernel's "
            f"{MAX_DECODE_ROWS} rows per program: use prefill_attention for these sequences"
        )
    k_cache, v_cache, out = args.k_cache, args.v_cache, args.out
    num_served = args.seq_ids.shape[0]
    if num_served == 0 or num_tokens == 0:
        return out

    block_size = k_cache.shape[1]
    if block_n is None:
        # Wider key tiles keep more bytes in flight on a GPU; the interpreter pays per loop iteration.
        block_n = max(block_size, 32 if interpreter_active() else 64)
    check_tile("block_n", block_n)
    if num_splits is None:
        num_splits = default_num_splits(num_served, num_kv_heads, max_seq_len, q.device)
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    block_d = max(16, next_power_of_2(head_dim))
    block_m = max(16, next_power_of_2(queries_per_kv * max_query_len))

    if num_splits > 1:
        part_rows = num_served * max_query_len
        part_out = torch.empty(
            part_rows, num_q_heads, num_splits, head_dim, dtype=torch.float32, device=q.device
        )
        part_lse = torch.empty(part_rows, num_q_heads, num_splits, dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = out  # unused by the kernel when NUM_SPLITS == 1
    _paged_decode_kernel[(num_served, num_kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        args.block_tables,
        args.seq_lens,
        args.query_start_loc,
        args.seq_ids,
        args.k_scale,
        args.v_scale,
        out,
        part_out,
        part_lse,
        scale,
        float(softcap or 0.0),
        int(sliding_window or 0),
        max_query_len,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        args.block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        QUERIES_PER_KV=queries_per_kv,
        NUM_Q_HEADS=num_q_heads,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        NUM_SPLITS=num_splits,
        FP8=k_cache.dtype == FP8_DTYPE,
        SOFTCAP=softcap is not None,
        SLIDING=sliding_window is not None,
        DOT_PRECISION=dot_precision(q.dtype),
        num_warps=4,
        num_stages=2,
    )
    if num_splits > 1:
        _split_reduce_kernel[(num_served, num_q_heads)](
            part_out,
            part_lse,
            args.query_start_loc,
            args.seq_ids,
            out,
            max_query_len,
            out.stride(0),
            out.stride(1),
            NUM_Q_HEADS=num_q_heads,
            HEAD_DIM=head_dim,
            BLOCK_D=block_d,
            NUM_SPLITS=num_splits,
            SPLITS_P2=next_power_of_2(num_splits),
            num_warps=4,
        )
    return out


def paged_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    softcap: float | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Plain PyTorch reference: per sequence, gather all seq_len keys through the block table, attend causally."""
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    qsl = query_start_loc.tolist()
    for seq, seq_len in enumerate(seq_lens.tolist()):
        start, end = qsl[seq], qsl[seq + 1]
        k = gather_kv_ref(k_cache, block_tables[seq], seq_len, k_scale)
        v = gather_kv_ref(v_cache, block_tables[seq], seq_len, v_scale)
        out[start:end] = causal_attention_ref(
            q[start:end], k, v, scale, seq_len - (end - start), softcap, sliding_window
        )
    return out.to(q.dtype)
