"""Reference attention in plain PyTorch over the paged KV cache (CPU serving, and the oracle for kernels).

An fp8 (e4m3) cache stores K/V divided by a per-tensor scale, saturated at +-448, and is dequantised on read.
Math in fp32 whatever the model dtype: the softmax of a long context in bf16 loses tokens. Decode rows
(one new token) of all sequences go through one batched gather + masked SDPA; sequences with several new
tokens (prefill chunks, speculative verification) go one by one with a causal mask shifted by the context
already in the cache.

Gemma 2's options: `softcap` (scores -> softcap * tanh(scores / softcap) before the mask; SDPA has no such
hook, so capped attention is computed explicitly) and `sliding_window` W (a query at position p sees keys
p - W + 1 .. p: an extra mask). With neither, the SDPA calls are exactly what they were.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from tokenfleet.kernels.fp8_format import FP8_DTYPE as FP8_KV_DTYPE
from tokenfleet.kernels.fp8_format import FP8_MAX
from tokenfleet.runtime.model.attention.base import AttentionBackend, AttentionMetadata, DecodeMetadata


def _store(rows: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor, scale: float) -> None:
    num_kv_heads, head_dim = cache.shape[2], cache.shape[3]
    if cache.dtype == FP8_KV_DTYPE:
        # Quantised with a per-tensor scale (x / scale, saturating). index_copy_ has no fp8 kernel on CPU:
        # copy the raw bytes instead.
        quant = (rows.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_KV_DTYPE)
        cache.view(torch.uint8).view(-1, num_kv_heads, head_dim).index_copy_(
            0, slot_mapping, quant.view(torch.uint8)
        )
        return
    cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, rows.to(cache.dtype))


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Store the step's new K/V rows at their flat slots ([num_blocks * block_size, Hkv, D] view)."""
    _store(k, k_cache, slot_mapping, k_scale)
    _store(v, v_cache, slot_mapping, v_scale)


def gather_context(
    cache: torch.Tensor, block_tables: torch.Tensor, length: int, scale: float = 1.0
) -> torch.Tensor:
    """[B, length, Hkv, D] fp32: the first `length` cached positions of each row of `block_tables`."""
    block_size = cache.shape[1]
    num_blocks = -(-length // block_size)
    index = block_tables[:, :num_blocks].reshape(-1)
    # index_select copies whole blocks (one memcpy each); advanced indexing computes every element's offset
    # and was ~6x slower for a decode step's gather on CPU.
    if cache.dtype == FP8_KV_DTYPE:  # gather raw bytes (no fp8 indexing kernel on CPU), then dequantise
        blocks = cache.view(torch.uint8).index_select(0, index).view(FP8_KV_DTYPE)
        blocks = blocks.view(block_tables.shape[0], num_blocks * block_size, *cache.shape[2:])
        return blocks[:, :length].float() * scale
    blocks = cache.index_select(0, index)  # [B * num_blocks, block_size, Hkv, D]
    return blocks.view(block_tables.shape[0], num_blocks * block_size, *cache.shape[2:])[:, :length].float()


def _attend(
    query: torch.Tensor,  # [..., q, D]
    keys: torch.Tensor,  # [..., S, D]
    values: torch.Tensor,  # [..., S, D]
    visible: torch.Tensor,  # bool, broadcastable to [..., q, S]
    scale: float,
    softcap: float | None,
) -> torch.Tensor:
    """Masked attention in fp32; with `softcap`, the scores are capped before the mask (as HF's eager path)."""
    if softcap is None:
        return F.scaled_dot_product_attention(query, keys, values, attn_mask=visible, scale=scale)
    scores = torch.matmul(query, keys.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    return torch.matmul(scores.masked_fill(~visible, float("-inf")).softmax(-1), values)


def decode_attention(
    q: torch.Tensor,  # [B, Hq, D]: one query per sequence
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks]
    seq_lens: torch.Tensor,  # [B]
    max_seq_len: int,
    scale: float,
    kv_scales: tuple[float, float] = (1.0, 1.0),
    softcap: float | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    keys = gather_context(k_cache, block_tables, max_seq_len, kv_scales[0]).transpose(1, 2)  # [B, Hkv, S, D]
    values = gather_context(v_cache, block_tables, max_seq_len, kv_scales[1]).transpose(1, 2)
    # GQA without copying K/V: the query heads sharing a KV head act as that head's query rows.
    grouped_q = q.float().view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
    key_pos = torch.arange(max_seq_len, device=q.device)[None, :]
    valid = key_pos < seq_lens[:, None]  # [B, S]
    if sliding_window is not None:  # the query sits at seq_len - 1
        valid = valid & (key_pos > seq_lens[:, None] - 1 - sliding_window)
    if softcap is None and sliding_window is None:
        out = F.scaled_dot_product_attention(
            grouped_q, keys, values, attn_mask=valid[:, None, None, :], scale=scale
        )
    else:
        out = _attend(grouped_q, keys, values, valid[:, None, None, :], scale, softcap)
    return out.reshape(num_seqs, num_heads, head_dim)


def sequence_attention(
    q: torch.Tensor,  # [q_len, Hq, D]: the last q_len tokens of the sequence
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,  # [max_blocks]
    seq_len: int,
    scale: float,
    kv_scales: tuple[float, float] = (1.0, 1.0),
    softcap: float | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    q_len, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    keys = gather_context(k_cache, block_table[None], seq_len, kv_scales[0])[0].transpose(0, 1)  # [Hkv, S, D]
    values = gather_context(v_cache, block_table[None], seq_len, kv_scales[1])[0].transpose(0, 1)
    query = q.float().transpose(0, 1)  # [Hq, q_len, D]
    if softcap is not None or sliding_window is not None:
        visible = torch.ones(q_len, seq_len, dtype=torch.bool, device=q.device).tril(seq_len - q_len)
        if sliding_window is not None:
            # ... and no key more than W - 1 positions behind it.
            visible &= ~torch.ones_like(visible).tril(seq_len - q_len - sliding_window)
        # GQA: the query heads of a KV head are its rows ([Hkv, G, q_len, D] against [Hkv, 1, S, D]).
        grouped = query.view(num_kv_heads, num_heads // num_kv_heads, q_len, head_dim)
        out = _attend(grouped, keys[:, None], values[:, None], visible, scale, softcap)
        return out.view(num_heads, q_len, head_dim).transpose(0, 1)
    if q_len == seq_len:
        # Nothing cached before this chunk: the plain causal mask, which SDPA handles without a mask tensor.
        out = F.scaled_dot_product_attention(
            query, keys, values, is_causal=True, scale=scale, enable_gqa=num_kv_heads != num_heads
        )
    else:
        # Query i sits at position seq_len - q_len + i and sees every key up to and including it.
        visible = torch.ones(q_len, seq_len, dtype=torch.bool, device=q.device).tril(seq_len - q_len)
        out = F.scaled_dot_product_attention(
            query, keys, values, attn_mask=visible, scale=scale, enable_gqa=num_kv_heads != num_heads
        )
    return out.transpose(0, 1)


@torch.library.custom_op("tokenfleet::torch_paged_decode", mutates_args=("k_cache", "v_cache"))
def torch_paged_decode(
    q: torch.Tensor,  # [B, Hq, D]
    k: torch.Tensor,  # [B, Hkv, D]
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # int64 [B]
    block_tables: torch.Tensor,  # int32 [B, max_blocks]
    seq_lens: torch.Tensor,  # int32 [B]
    scale: float,
    k_scale: float,
    v_scale: float,
    softcap: float | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Cache write + decode attention of a static-shape decode step, as one op the compiler does not trace
    into: its one data-dependent figure (the longest context, which bounds the gather) is read inside."""
    write_kv(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    # A host read: free on CPU, a device sync on CUDA, where it rules out CUDA-graph capture
    # (TorchAttentionBackend.decode_reads_host).
    max_seq_len = int(seq_lens.max())
    out = decode_attention(
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        max_seq_len,
        scale,
        (k_scale, v_scale),
        softcap,
        sliding_window,
    )
    return out.to(q.dtype)


@torch_paged_decode.register_fake
def _torch_paged_decode_fake(
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


class TorchAttentionBackend(AttentionBackend):
    """`k_scale` / `v_scale`: per-tensor scales of an fp8 (e4m3) KV cache; unused for other cache dtypes."""

    name = "torch"
    traceable_decode = True  # DecodeMetadata steps go through tokenfleet::torch_paged_decode
    # ... which reads the longest context back to the host each step: on CUDA a sync that a CUDA graph
    # cannot capture, so compiled decode (CUDA graphs there) refuses this backend on CUDA.
    decode_reads_host = True

    def __init__(self, k_scale: float = 1.0, v_scale: float = 1.0):
        if not (k_scale > 0 and v_scale > 0):
            raise ValueError(f"KV-cache scales must be positive, got k_scale={k_scale}, v_scale={v_scale}")
        self.kv_scales = (float(k_scale), float(v_scale))

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata | DecodeMetadata,
        scale: float,
        softcap: float | None = None,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        if isinstance(meta, DecodeMetadata):
            return torch.ops.tokenfleet.torch_paged_decode(
                q,
                k,
                v,
                k_cache,
                v_cache,
                meta.slot_mapping,
                meta.block_tables,
                meta.seq_lens,
                scale,
                *self.kv_scales,
                softcap,
                sliding_window,
            )
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping, *self.kv_scales)
        if meta.is_all_decode:
            out = decode_attention(
                q,
                k_cache,
                v_cache,
                meta.block_tables,
                meta.seq_lens,
                meta.max_seq_len,
                scale,
                self.kv_scales,
                softcap,
                sliding_window,
            )
            return out.to(q.dtype)

        out = torch.empty_like(q)
        starts = [0]
        for q_len in meta.query_lens:
            starts.append(starts[-1] + q_len)
        decode_seqs = [b for b, q_len in enumerate(meta.query_lens) if q_len == 1]
        if decode_seqs:
            seq_idx = torch.tensor(decode_seqs, device=q.device)
            rows = torch.tensor([starts[b] for b in decode_seqs], device=q.device)
            max_len = max(meta.seq_lens_list[b] for b in decode_seqs)
            decoded = decode_attention(
                q[rows],
                k_cache,
                v_cache,
                meta.block_tables[seq_idx],
                meta.seq_lens[seq_idx],
                max_len,
                scale,
                self.kv_scales,
                softcap,
                sliding_window,
            )
            out[rows] = decoded.to(q.dtype)
        for b, q_len in enumerate(meta.query_lens):
            if q_len == 1:
                continue
            rows = slice(starts[b], starts[b + 1])
            seq_out = sequence_attention(
                q[rows],
                k_cache,
                v_cache,
                meta.block_tables[b],
                meta.seq_lens_list[b],
                scale,
                self.kv_scales,
                softcap,
                sliding_window,
            )
            out[rows] = seq_out.to(q.dtype)
        return out
