"""Varlen causal flash attention over packed prompts whose keys are a paged cached prefix + the new tokens.

This is what chunked prefill and prefix caching need: a sequence with seq_len keys and q_len new tokens has
its first context_len = seq_len - q_len keys in the paged cache (a prefix-cache hit or earlier chunks) and
the new ones in the step's contiguous K/V. One program serves one (sequence, q head, BLOCK_M query tile)
and walks three key ranges with an fp32 online softmax:
  1. the cached prefix, gathered through the block table (every prefix key is visible to every query);
  2. new keys strictly before the tile (visible to every row: no causal mask needed);
  3. the diagonal tile(s), masked causally.
New K/V are read from the step's tensors, not the cache: contiguous loads, and full precision even when the
cache is FP8 — so this kernel does not depend on the cache write having run first.

Optional (Gemma 2), compile-time switches that leave other models' kernels unchanged: `softcap` caps the
scores (softcap * tanh(s / softcap)) before the mask; `sliding_window` W hides keys more than W - 1 positions
behind the query: ranges 1 and 2 then start at the first tile the tile's first query can see, and are masked.
"""

from __future__ import annotations

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


@triton.jit
def _softmax_step(
    acc,
    m_i,
    l_i,
    q,
    k,
    v,
    qk_scale,
    scale,
    softcap,
    visible,
    CAUSAL: tl.constexpr,
    SOFTCAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One online-softmax update of (acc, m_i, l_i) with a [D, N] key tile and a [N, D] value tile.
    CAUSAL: apply the `visible` mask (any mask: causal and/or window)."""
    qk = tl.dot(q, k, input_precision=DOT_PRECISION)
    if SOFTCAP:  # noqa: SIM108 (a compile-time branch: the other side is never compiled)
        qk = soft_cap(qk * scale, softcap) * LOG2E
    else:
        qk = qk * qk_scale
    if CAUSAL:
        qk = tl.where(visible, qk, float("-inf"))
    p, alpha, m_i, l_i = online_softmax(qk, m_i, l_i)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_i, l_i


@triton.jit
def _prefill_kernel(
    q_ptr,  # [num_tokens, num_q_heads, head_dim]
    k_ptr,  # [num_tokens, num_kv_heads, head_dim]  new keys of this step
    v_ptr,  # [num_tokens, num_kv_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables_ptr,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens_ptr,  # [num_seqs] int32: keys per sequence, new tokens included
    query_start_loc_ptr,  # [num_seqs + 1] int32
    seq_ids_ptr,  # [num_served] int32: the batch entries this launch serves
    k_scale_ptr,  # [1] float32 (fp8 cache only)
    v_scale_ptr,  # [1] float32 (fp8 cache only)
    out_ptr,  # [num_tokens, num_q_heads, head_dim]
    scale,
    softcap,  # logit cap (SOFTCAP only)
    window,  # keys visible behind and including the query (SLIDING only)
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    stride_ot,
    stride_oh,
    QUERIES_PER_KV: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    FP8: tl.constexpr,
    SOFTCAP: tl.constexpr,
    SLIDING: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid_seq = tl.program_id(0)
    head = tl.program_id(1)
    tile = tl.program_id(2)
    seq, q_start, q_len = served_sequence(seq_ids_ptr, query_start_loc_ptr, pid_seq)
    m_start = tile * BLOCK_M
    if m_start >= q_len:
        return  # the grid is sized for the longest sequence
    context_len = tl.load(seq_lens_ptr + seq) - q_len
    kv_head = head // QUERIES_PER_KV

    offs_m = m_start + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_valid = offs_m < q_len
    d_valid = offs_d < HEAD_DIM
    rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(
        q_ptr + rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
        mask=row_valid[:, None] & d_valid[None, :],
        other=0.0,
    )
    qk_scale = scale * LOG2E
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)  # finite: keeps exp2(m_old - m_new) NaN-free
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    # 1. Cached prefix through the block table.
    if FP8:
        k_scale = tl.load(k_scale_ptr)
        v_scale = tl.load(v_scale_ptr)
    kv_head_off = kv_head.to(tl.int64) * stride_ch
    if SLIDING:  # noqa: SIM108 (compile-time branch)
        # The tile's first query (position context_len + m_start) sees the least far back.
        prefix_start = (tl.maximum(context_len + m_start - window + 1, 0) // BLOCK_N) * BLOCK_N
    else:
        prefix_start = 0
    for start_n in range(prefix_start, context_len, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        key_valid = offs_n < context_len
        kv_off = paged_kv_offsets(
            block_tables_ptr, seq, offs_n, key_valid, kv_head_off, stride_bt, stride_cb, stride_cs, BLOCK_SIZE
        )
        k = tl.load(
            k_cache_ptr + kv_off[None, :] + offs_d[:, None],
            mask=key_valid[None, :] & d_valid[:, None],
            other=0.0,
        )
        v = tl.load(
            v_cache_ptr + kv_off[:, None] + offs_d[None, :],
            mask=key_valid[:, None] & d_valid[None, :],
            other=0.0,
        )
        if FP8:
            k = dequantize(k, k_scale, q.dtype)
            v = dequantize(v, v_scale, q.dtype)
        visible = key_valid[None, :]
        if SLIDING:
            visible = visible & (offs_n[None, :] > context_len + offs_m[:, None] - window)
        acc, m_i, l_i = _softmax_step(
            acc,
            m_i,
            l_i,
            q,
            k,
            v,
            qk_scale,
            scale,
            softcap,
            visible,
            CAUSAL=True,
            SOFTCAP=SOFTCAP,
            DOT_PRECISION=DOT_PRECISION,
        )

    # 2./3. New keys: tiles wholly before this query tile need no causal mask (only the window's); the rest
    # are masked causally.
    diag_start = (m_start // BLOCK_N) * BLOCK_N
    if SLIDING:  # noqa: SIM108 (compile-time branch)
        new_start = (tl.maximum(m_start - window + 1, 0) // BLOCK_N) * BLOCK_N
    else:
        new_start = 0
    for start_n in range(new_start, diag_start, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        key_rows = (q_start + offs_n).to(tl.int64)
        k = tl.load(
            k_ptr + key_rows[None, :] * stride_kt + kv_head * stride_kh + offs_d[:, None],
            mask=d_valid[:, None],
        )
        v = tl.load(
            v_ptr + key_rows[:, None] * stride_vt + kv_head * stride_vh + offs_d[None, :],
            mask=d_valid[None, :],
        )
        if SLIDING:  # noqa: SIM108 (compile-time branch)
            in_window = offs_n[None, :] > offs_m[:, None] - window
        else:
            in_window = None
        acc, m_i, l_i = _softmax_step(
            acc,
            m_i,
            l_i,
            q,
            k,
            v,
            qk_scale,
            scale,
            softcap,
            in_window,
            CAUSAL=SLIDING,
            SOFTCAP=SOFTCAP,
            DOT_PRECISION=DOT_PRECISION,
        )
    new_end = tl.minimum(q_len, m_start + BLOCK_M)
    for start_n in range(diag_start, new_end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        key_valid = offs_n < new_end
        key_rows = (q_start + offs_n).to(tl.int64)
        k = tl.load(
            k_ptr + key_rows[None, :] * stride_kt + kv_head * stride_kh + offs_d[:, None],
            mask=key_valid[None, :] & d_valid[:, None],
            other=0.0,
        )
        v = tl.load(
            v_ptr + key_rows[:, None] * stride_vt + kv_head * stride_vh + offs_d[None, :],
            mask=key_valid[:, None] & d_valid[None, :],
            other=0.0,
        )
        visible = key_valid[None, :] & (offs_n[None, :] <= offs_m[:, None])
        if SLIDING:
            visible = visible & (offs_n[None, :] > offs_m[:, None] - window)
        acc, m_i, l_i = _softmax_step(
            acc,
            m_i,
            l_i,
            q,
            k,
            v,
            qk_scale,
            scale,
            softcap,
            visible,
            CAUSAL=True,
            SOFTCAP=SOFTCAP,
            DOT_PRECISION=DOT_PRECISION,
        )

    # Every valid row sees at least its own key, so l_i > 0 there; padded rows are not stored.
    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr + rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_valid[:, None] & d_valid[None, :],
    )


def _default_tiles(head_dim: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages): Hopper-sized tiles on GPU, cheap ones in the interpreter."""
    if interpreter_active():
        return 32, 32, 4, 1
    if head_dim <= 64:
        return 128, 64, 4, 3
    return 128, 64, 8, 3


def prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    *,
    max_query_len: int,
    seq_ids: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    softcap: float | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Causal attention of packed q [T, Hq, D] over each sequence's cached prefix + its new k/v [T, Hkv, D].

    `max_query_len` bounds the served sequences' new tokens (a host int: no device sync). Rows of `out`
    belonging to sequences outside `seq_ids` are left untouched. Returns `out`.
    `softcap` / `sliding_window`: Gemma 2's logit cap and window (see the module docstring); None = off.
    """
    q = check_tensor("q", q, ndim=3, dtypes=COMPUTE_DTYPES)
    check_softcap_window(softcap, sliding_window)
    num_tokens, num_q_heads, head_dim = q.shape
    k = check_tensor("k", k, ndim=3, dtypes=(q.dtype,), shape=(num_tokens, None, head_dim))
    num_kv_heads = k.shape[1]
    v = check_tensor("v", v, ndim=3, dtypes=(q.dtype,), shape=tuple(k.shape))
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
        same_device=(("k", k), ("v", v)),
    )
    out = args.out
    if args.seq_ids.shape[0] == 0 or num_tokens == 0 or max_query_len < 1:
        return out

    d_m, d_n, d_warps, d_stages = _default_tiles(head_dim)
    block_m, block_n = block_m or d_m, block_n or d_n
    check_tile("block_m", block_m)
    check_tile("block_n", block_n)
    if block_m % block_n:
        raise ValueError(f"block_m ({block_m}) must be a multiple of block_n ({block_n})")
    grid = (args.seq_ids.shape[0], num_q_heads, cdiv(max_query_len, block_m))
    _prefill_kernel[grid](
        q,
        k,
        v,
        args.k_cache,
        args.v_cache,
        args.block_tables,
        args.seq_lens,
        args.query_start_loc,
        args.seq_ids,
        args.k_scale,
        args.v_scale,
        out,
        scale,
        float(softcap or 0.0),
        int(sliding_window or 0),
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        args.k_cache.stride(0),
        args.k_cache.stride(1),
        args.k_cache.stride(2),
        args.block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        QUERIES_PER_KV=num_q_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_D=max(16, next_power_of_2(head_dim)),
        BLOCK_SIZE=args.k_cache.shape[1],
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        FP8=args.k_cache.dtype == FP8_DTYPE,
        SOFTCAP=softcap is not None,
        SLIDING=sliding_window is not None,
        DOT_PRECISION=dot_precision(q.dtype),
        num_warps=num_warps or d_warps,
        num_stages=num_stages or d_stages,
    )
    return out


def prefill_attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
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
    """Plain PyTorch reference: per sequence, keys = prefix gathered through the block table + new k/v."""
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    qsl = query_start_loc.tolist()
    for seq, seq_len in enumerate(seq_lens.tolist()):
        start, end = qsl[seq], qsl[seq + 1]
        context_len = seq_len - (end - start)
        keys = torch.cat(
            [gather_kv_ref(k_cache, block_tables[seq], context_len, k_scale), k[start:end].float()]
        )
        values = torch.cat(
            [gather_kv_ref(v_cache, block_tables[seq], context_len, v_scale), v[start:end].float()]
        )
        out[start:end] = causal_attention_ref(
            q[start:end], keys, values, scale, context_len, softcap, sliding_window
        )
    return out.to(q.dtype)
