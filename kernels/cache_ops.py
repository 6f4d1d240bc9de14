"""Write new K/V rows into the paged KV cache by slot mapping (optionally quantising to FP8 e4m3).

Token t of the step goes to physical slot `slot_mapping[t]` = block_id * block_size + offset; a negative
slot marks a padding token that is not written. An FP8 cache stores `x / scale` saturated to ±448 with one
per-tensor scale for K and one for V (readers multiply back).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from tokenfleet.kernels._utils import (
    COMPUTE_DTYPES,
    cdiv,
    check_device,
    check_kv_cache_pair,
    check_tensor,
    fp8_scales,
    interpreter_active,
    next_power_of_2,
)
from tokenfleet.kernels.fp8_format import FP8_DTYPE, FP8_MAX, to_fp8

# A global read inside @triton.jit must be a constexpr.
FP8_MAX_VALUE = tl.constexpr(FP8_MAX)


@triton.jit
def _write_kv_cache_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_dim]
    value_ptr,  # [num_tokens, num_kv_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping_ptr,  # [num_tokens] int64
    k_scale_ptr,  # [1] float32
    v_scale_ptr,  # [1] float32
    num_tokens,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_cs,
    stride_ch,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    FP8: tl.constexpr,
):
    # One program writes BLOCK_T tokens; heads x head dims are flattened into the second tile axis.
    tokens = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    token_valid = tokens < num_tokens
    slots = tl.load(slot_mapping_ptr + tokens, mask=token_valid, other=-1).to(tl.int64)
    # Caches may hold >2**31 elements: block offsets are computed in int64 (slots are int64).
    block_ids = slots // BLOCK_SIZE
    offsets = slots % BLOCK_SIZE
    offs_hd = tl.arange(0, BLOCK_H * BLOCK_D)
    heads = offs_hd // BLOCK_D
    dims = offs_hd % BLOCK_D
    mask = ((slots >= 0) & token_valid)[:, None] & ((heads < NUM_KV_HEADS) & (dims < HEAD_DIM))[None, :]
    src_k = key_ptr + tokens[:, None] * stride_kt + (heads * stride_kh + dims)[None, :]
    src_v = value_ptr + tokens[:, None] * stride_vt + (heads * stride_vh + dims)[None, :]
    dst = (block_ids * stride_cb + offsets * stride_cs)[:, None] + (heads * stride_ch + dims)[None, :]
    k = tl.load(src_k, mask=mask, other=0.0)
    v = tl.load(src_v, mask=mask, other=0.0)
    if FP8:
        k_scale = tl.load(k_scale_ptr)
        v_scale = tl.load(v_scale_ptr)
        # Saturate: e4m3fn has no infinity, an out-of-range value would become NaN.
        k = tl.clamp(k.to(tl.float32) / k_scale, -FP8_MAX_VALUE, FP8_MAX_VALUE)
        v = tl.clamp(v.to(tl.float32) / v_scale, -FP8_MAX_VALUE, FP8_MAX_VALUE)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Scatter key/value [T, Hkv, D] into k_cache/v_cache [num_blocks, block_size, Hkv, D] at slot_mapping [T].

    With an fp8 (float8_e4m3fn) cache, `k_scale`/`v_scale` (float32, one element) are required.
    """
    key = check_tensor("key", key, ndim=3, dtypes=COMPUTE_DTYPES)
    num_tokens, num_kv_heads, head_dim = key.shape
    value = check_tensor("value", value, ndim=3, dtypes=(key.dtype,), shape=tuple(key.shape))
    k_cache, v_cache = check_kv_cache_pair(
        k_cache, v_cache, num_kv_heads=num_kv_heads, head_dim=head_dim, like=("key", key.dtype)
    )
    slot_mapping = check_tensor(
        "slot_mapping", slot_mapping, ndim=1, dtypes=(torch.int64,), shape=(num_tokens,)
    )
    for name, t in (
        ("value", value),
        ("k_cache", k_cache),
        ("v_cache", v_cache),
        ("slot_mapping", slot_mapping),
    ):
        check_device(name, t, key.device)
    k_scale, v_scale = fp8_scales(k_cache, k_scale, v_scale)
    if num_tokens == 0:
        return
    block_h, block_d = next_power_of_2(num_kv_heads), next_power_of_2(head_dim)
    # ~4k elements per program on a GPU; the interpreter pays per program, so it takes up to 64 tokens.
    cap = 64 if interpreter_active() else max(1, 4096 // (block_h * block_d))
    block_t = min(next_power_of_2(num_tokens), next_power_of_2(cap))
    _write_kv_cache_kernel[(cdiv(num_tokens, block_t),)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        k_scale,
        v_scale,
        num_tokens,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_T=block_t,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        BLOCK_SIZE=k_cache.shape[1],
        FP8=k_cache.dtype == FP8_DTYPE,
        num_warps=4,
    )


def write_kv_cache_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Plain PyTorch reference of write_kv_cache, one token at a time."""
    block_size = k_cache.shape[1]
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        block_id, offset = divmod(slot, block_size)
        if k_cache.dtype == FP8_DTYPE:
            assert k_scale is not None and v_scale is not None
            k_cache[block_id, offset] = to_fp8(key[t], k_scale)
            v_cache[block_id, offset] = to_fp8(value[t], v_scale)
        else:
            k_cache[block_id, offset] = key[t]
            v_cache[block_id, offset] = value[t]
