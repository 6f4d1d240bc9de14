"""Device functions the decode and prefill attention kernels share, so both walk the cache the same way.

- `served_sequence`: which sequence a program serves and where its query tokens are in the packed batch.
- `paged_kv_offsets`: element offsets of a tile of keys of one sequence in the paged cache, through its
  block table. Physical block ids go int64 before the multiply: caches can exceed 2**31 elements.
- `dequantize`: an fp8 tile times its per-tensor scale, in the compute dtype.
- `soft_cap`: Gemma 2's attention logit soft-capping, cap * tanh(scores / cap), before the mask.
- `online_softmax`: one update of the running row max and sum with a tile of scores (exp2 domain: the
  scores carry log2(e)). It returns the tile's weights and the rescale factor of the running accumulator,
  so a kernel can load V after the scores and apply them itself.

Triton inlines these into the calling kernel: the generated code is what an inline copy would produce.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)  # scores are scaled by log2(e) so the softmax can use exp2
TWO_LOG2E = tl.constexpr(2.8853900817779268)  # e^(-2|x|) = 2^(-2 log2(e) |x|), in soft_cap


@triton.jit
def served_sequence(seq_ids_ptr, query_start_loc_ptr, pid_seq):
    """Program `pid_seq` serves batch entry seq_ids[pid_seq] -> (seq as int64, first query row, query count)."""
    seq = tl.load(seq_ids_ptr + pid_seq).to(tl.int64)
    q_start = tl.load(query_start_loc_ptr + seq)
    return seq, q_start, tl.load(query_start_loc_ptr + seq + 1) - q_start


@triton.jit
def paged_kv_offsets(
    block_tables_ptr,  # [num_seqs, max_blocks_per_seq] int32
    seq,  # int64: the sequence's row of the block table
    offs_n,  # [BLOCK_N] logical key positions
    key_valid,  # [BLOCK_N] bool: masked keys read block 0 and must not be loaded
    kv_head_off,  # int64: kv_head * stride_ch
    stride_bt,
    stride_cb,
    stride_cs,
    BLOCK_SIZE: tl.constexpr,
):
    phys = tl.load(block_tables_ptr + seq * stride_bt + offs_n // BLOCK_SIZE, mask=key_valid, other=0)
    return phys.to(tl.int64) * stride_cb + (offs_n % BLOCK_SIZE) * stride_cs + kv_head_off


@triton.jit
def dequantize(tile, scale, dtype: tl.constexpr):
    return (tile.to(tl.float32) * scale).to(dtype)


@triton.jit
def online_softmax(qk, m_i, l_i):
    """Scores qk [M, N] (masked entries -inf) -> (p [M, N], alpha [M], new max, new sum)."""
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def soft_cap(scores, cap):
    """cap * tanh(scores / cap). tanh from one exp2 of -2|x| (never overflows, whatever the sign)."""
    x = scores / cap
    t = tl.exp2(tl.abs(x) * -TWO_LOG2E)
    th = (1.0 - t) / (1.0 + t)
    return cap * tl.where(x < 0.0, -th, th)
