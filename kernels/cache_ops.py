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
    FP8_DTYPE,
    FP8_MAX,
    check_device,
    check_kv_cache_pair,
    check_tensor,
    fp8_scales,
    next_power_of_2,
)

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
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_cs,
    stride_ch,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    FP8: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block_id = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)
    src_k = key_ptr + token * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :]
    src_v = value_ptr + token * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :]
    # Caches may hold >2**31 elements: the block offset is computed in int64 (block_id is int64 already).
    dst = block_id * stride_cb + offset * stride_cs + offs_h[:, None] * stride_ch + offs_d[None, :]
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
    k_cache, v_cache = check_kv_cache_pair(k_cache, v_cache, num_kv_heads=num_kv_heads, head_dim=head_dim)
    if k_cache.dtype not in (key.dtype, FP8_DTYPE):
        raise TypeError(
            f"k_cache has dtype {k_cache.dtype}: expected {key.dtype} (the key dtype) or fp8 e4m3"
        )
    if k_cache.stride() != v_cache.stride():
        raise ValueError(f"k_cache strides {k_cache.stride()} differ from v_cache strides {v_cache.stride()}")
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
    k_scale, v_scale = fp8_scales(k_cache.dtype, k_scale, v_scale, key.device)
    if num_tokens == 0:
        return
    _write_kv_cache_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        k_scale,
        v_scale,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=next_power_of_2(num_kv_heads),
        BLOCK_D=next_power_of_2(head_dim),
        BLOCK_SIZE=k_cache.shape[1],
        FP8=k_cache.dtype == FP8_DTYPE,
        num_warps=4 if num_kv_heads * head_dim >= 1024 else 1,
    )


def quantize_fp8_ref(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x / scale saturated to the e4m3 range and rounded to nearest-even (what the GPU's cvt.rn.satfinite does)."""
    return (x.float() / scale.float()).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


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
            k_cache[block_id, offset] = quantize_fp8_ref(key[t], k_scale)
            v_cache[block_id, offset] = quantize_fp8_ref(value[t], v_scale)
        else:
            k_cache[block_id, offset] = key[t]
            v_cache[block_id, offset] = value[t]
