"""KV-cache write by slot mapping: bit-exact against the PyTorch reference, padding slots skipped.

FP8: the interpreter's fp32 -> fp8 conversion is wrong (no carry, no saturation), so the fp8 test uses the
`fp8_cast` fixture (tests/kernels/conftest.py), which replaces only that conversion with torch's
round-to-nearest-even after saturation — what the GPU's cvt.rn.satfinite does. On a GPU it does nothing.
"""

from __future__ import annotations

import pytest
import torch
from tokenfleet.kernels.cache_ops import write_kv_cache, write_kv_cache_ref
from tokenfleet.kernels.fp8_format import FP8_DTYPE, to_fp8

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float16, torch.float32] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])


def _inputs(num_tokens, num_kv_heads, head_dim, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(device=DEVICE, dtype=dtype)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(device=DEVICE, dtype=dtype)
    return key, value


def _caches(num_blocks, block_size, num_kv_heads, head_dim, dtype):
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    # A sentinel everywhere: any write to a slot that was not asked for shows up in the comparison.
    k_cache = torch.full(shape, -3.0, device=DEVICE).to(dtype)
    return k_cache, k_cache.clone()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("num_kv_heads", "head_dim", "block_size"), [(2, 64, 16), (3, 40, 32), (8, 128, 16), (1, 16, 16)]
)
def test_write_matches_reference_bit_exactly(dtype, num_kv_heads, head_dim, block_size):
    key, value = _inputs(6, num_kv_heads, head_dim, dtype)
    # Shuffled slots across blocks, first/last slot of a block, and a padding token (-1).
    slots = torch.tensor([5 * block_size + 3, 0, -1, 2 * block_size - 1, 7 * block_size, 3 * block_size + 1])
    k_cache, v_cache = _caches(8, block_size, num_kv_heads, head_dim, dtype)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    write_kv_cache(key, value, k_cache, v_cache, slots.to(DEVICE))
    write_kv_cache_ref(key, value, k_ref, v_ref, slots)
    assert torch.equal(k_cache, k_ref)
    assert torch.equal(v_cache, v_ref)


def test_non_contiguous_key_value_views():
    # The model hands over K/V as column slices of a fused QKV projection.
    qkv = torch.randn(4, 3 * 2 * 32, device=DEVICE)
    key = qkv[:, 64:128].view(4, 2, 32)
    value = qkv[:, 128:].view(4, 2, 32)
    k_cache, v_cache = _caches(4, 16, 2, 32, torch.float32)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    slots = torch.tensor([17, 18, 40, 2])
    write_kv_cache(key, value, k_cache, v_cache, slots.to(DEVICE))
    write_kv_cache_ref(key, value, k_ref, v_ref, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


def test_fp8_write_rounds_and_saturates_like_torch(fp8_cast):
    key, value = _inputs(5, 2, 64, torch.float16, seed=1)
    key[0, 0, :4] = torch.tensor(
        [1000.0, -1000.0, 224.5, 1e-3], dtype=torch.float16
    )  # saturates at ±448*scale
    k_scale = torch.tensor([0.5], device=DEVICE)
    v_scale = torch.tensor([0.125], device=DEVICE)
    k_cache, v_cache = (torch.zeros(6, 16, 2, 64, device=DEVICE).to(FP8_DTYPE) for _ in range(2))
    slots = torch.tensor([80, 3, 17, -1, 95])
    write_kv_cache(key, value, k_cache, v_cache, slots.to(DEVICE), k_scale, v_scale)
    k_ref, v_ref = (torch.zeros(6, 16, 2, 64, device=DEVICE).to(FP8_DTYPE) for _ in range(2))
    write_kv_cache_ref(key, value, k_ref, v_ref, slots, k_scale, v_scale)
    assert torch.equal(k_cache.view(torch.uint8), k_ref.view(torch.uint8))
    assert torch.equal(v_cache.view(torch.uint8), v_ref.view(torch.uint8))
    # Saturation, not NaN: e4m3fn's largest finite value, 448.
    assert k_cache[5, 0, 0, :2].float().tolist() == [448.0, -448.0]
    assert torch.equal(to_fp8(key[1], k_scale).view(torch.uint8), k_cache[0, 3].view(torch.uint8))


def test_int64_slots_beyond_2_pow_31_elements():
    # Blocks past 2**31 elements in a lazily committed view (only touched pages cost memory).
    num_blocks, block_size, head_dim, row = 32_800, 16, 16, 4096
    storage = torch.empty(num_blocks * block_size * row, dtype=torch.float16, device=DEVICE)
    shape, stride = (num_blocks, block_size, 1, head_dim), (block_size * row, row, row, 1)
    k_cache = storage.as_strided(shape, stride, 0)
    v_cache = storage.as_strided(shape, stride, head_dim)
    key, value = _inputs(3, 1, head_dim, torch.float16)
    slots = [32_799 * block_size + 15, 32_780 * block_size, 4]
    write_kv_cache(key, value, k_cache, v_cache, torch.tensor(slots, device=DEVICE))
    for t, slot in enumerate(slots):
        assert torch.equal(k_cache[slot // block_size, slot % block_size], key[t])
        assert torch.equal(v_cache[slot // block_size, slot % block_size], value[t])


def test_rejects_bad_arguments_naming_them():
    key, value = _inputs(2, 2, 32, torch.float32)
    k_cache, v_cache = _caches(4, 16, 2, 32, torch.float32)
    slots = torch.tensor([0, 1], device=DEVICE)
    with pytest.raises(TypeError, match="slot_mapping"):
        write_kv_cache(key, value, k_cache, v_cache, slots.int())
    with pytest.raises(ValueError, match="slot_mapping"):
        write_kv_cache(key, value, k_cache, v_cache, slots[:1])
    with pytest.raises(ValueError, match="k_cache"):
        write_kv_cache(key, value, k_cache[:, :, :1], v_cache, slots)
    with pytest.raises(TypeError, match="k_cache"):
        write_kv_cache(key, value, k_cache.half(), v_cache.half(), slots)
    with pytest.raises(ValueError, match="block_size"):
        write_kv_cache(key, value, k_cache[:, :12], v_cache[:, :12], slots)
    with pytest.raises(ValueError, match="k_scale"):
        write_kv_cache(key, value, k_cache.to(FP8_DTYPE), v_cache.to(FP8_DTYPE), slots)
    with pytest.raises(TypeError, match="key"):
        write_kv_cache(key.tolist(), value, k_cache, v_cache, slots)
