"""Paged decode attention against its PyTorch reference (CPU: Triton interpreter; GPU: the real kernel).

Caches are NaN-poisoned outside each sequence's rows, so reading a wrong slot fails loudly. Tolerances per
dtype (outputs are averages of unit-variance values, so |out| < ~3):
  fp32 1e-5 abs + 1e-5 rel (exact dots: input_precision="ieee");
  fp16 2e-3 abs + 2e-3 rel (probabilities are rounded to fp16 before the PV dot; the output to fp16: 1 ulp);
  bf16 1.6e-2 abs + 1.6e-2 rel (GPU only: the interpreter's bf16 arithmetic is wrong).
"""

from __future__ import annotations

import pytest
import torch
from tokenfleet.kernels.fp8_format import FP8_DTYPE
from tokenfleet.kernels.paged_attention import paged_attention_ref, paged_decode_attention

from .paged_batch import make_paged_batch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _run(batch, num_splits=1, **kwargs):
    return paged_decode_attention(
        batch.q,
        batch.k_cache,
        batch.v_cache,
        batch.block_tables,
        batch.seq_lens,
        batch.query_start_loc,
        batch.q.shape[-1] ** -0.5,
        max_query_len=batch.max_query_len,
        max_seq_len=batch.max_seq_len,
        k_scale=batch.k_scale,
        v_scale=batch.v_scale,
        num_splits=num_splits,
        **kwargs,
    )


def _ref(batch):
    return paged_attention_ref(
        batch.q,
        batch.k_cache,
        batch.v_cache,
        batch.block_tables,
        batch.seq_lens,
        batch.query_start_loc,
        batch.q.shape[-1] ** -0.5,
        batch.k_scale,
        batch.v_scale,
    )


def _assert_close(out, ref, dtype):
    assert not out.isnan().any()
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])


# (query_lens, context lengths before the step, Hq, Hkv, head_dim, block_size, dtype)
CASES = [
    pytest.param([1], [0], 4, 4, 64, 16, torch.float32, id="ctx1-single"),
    pytest.param([1] * 4, [14, 15, 16, 39], 6, 2, 64, 16, torch.float16, id="bs-1,bs,bs+1,long-gqa3"),
    pytest.param([1] * 4, [30, 31, 32, 69], 8, 1, 128, 32, torch.float32, id="bs32-mqa8-d128"),
    pytest.param([1, 4, 3], [20, 13, 0], 4, 2, 64, 16, torch.float16, id="spec-verify-multi-query"),
    pytest.param([1, 1], [5, 40], 2, 1, 40, 16, torch.float32, id="head-dim-40-padded"),
    pytest.param([1, 1], [33, 70], 3, 1, 96, 32, torch.float16, id="head-dim-96-gqa3"),
]
if DEVICE.type == "cuda":
    CASES.append(pytest.param([1] * 4, [14, 15, 16, 39], 8, 8, 128, 16, torch.bfloat16, id="bf16-gpu"))


@pytest.mark.parametrize(
    ("query_lens", "context_lens", "hq", "hkv", "head_dim", "block_size", "dtype"), CASES
)
def test_matches_reference(query_lens, context_lens, hq, hkv, head_dim, block_size, dtype):
    batch = make_paged_batch(
        query_lens,
        context_lens,
        num_q_heads=hq,
        num_kv_heads=hkv,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        device=DEVICE,
    )
    _assert_close(_run(batch), _ref(batch), dtype)


def test_split_kv_equals_unsplit():
    # 3 splits do not divide the 70 / 37 keys evenly; the short sequence leaves trailing splits empty.
    batch = make_paged_batch(
        [1, 2, 1],
        [69, 35, 4],
        num_q_heads=3,
        num_kv_heads=1,
        head_dim=64,
        block_size=16,
        dtype=torch.float32,
        device=DEVICE,
    )
    unsplit = _run(batch, num_splits=1)
    for num_splits in (3, 4):
        split = _run(batch, num_splits=num_splits)
        torch.testing.assert_close(split, unsplit, atol=1e-6, rtol=1e-6)
    _assert_close(unsplit, _ref(batch), torch.float32)


def test_key_tile_width_does_not_change_the_result():
    # Key tiles narrower than, equal to and wider than a 32-token page (gathered across pages).
    batch = make_paged_batch(
        [1, 2],
        [44, 20],
        num_q_heads=2,
        num_kv_heads=1,
        head_dim=32,
        block_size=32,
        dtype=torch.float32,
        device=DEVICE,
    )
    ref = _ref(batch)
    for block_n in (16, 32, 64):
        _assert_close(_run(batch, block_n=block_n), ref, torch.float32)


def test_fp8_cache_dequantises_with_scales():
    # The cache is quantised by torch (the interpreter's fp32->fp8 cast is wrong); the kernel only reads it.
    batch = make_paged_batch(
        [1, 1, 2],
        [15, 33, 8],
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=64,
        block_size=16,
        dtype=torch.float16,
        cache_dtype=FP8_DTYPE,
        device=DEVICE,
    )
    # Dequantised K/V are exact in fp16, so the fp16 tolerance holds against the reference on the same codes.
    _assert_close(_run(batch, num_splits=2), _ref(batch), torch.float16)


def test_int64_offsets_beyond_2_pow_31_elements():
    # 32,800 blocks with a row stride of 65,536 elements: the top blocks start past 2**31 elements, where
    # an int32 block offset wraps. The view lives in one lazily committed allocation: only the touched
    # pages cost memory.
    num_blocks, block_size, head_dim, row = 32_800, 16, 16, 4096
    storage = torch.empty(num_blocks * block_size * row, dtype=torch.float16, device=DEVICE)
    shape, stride = (num_blocks, block_size, 1, head_dim), (block_size * row, row, row, 1)
    k_cache = storage.as_strided(shape, stride, 0)
    v_cache = storage.as_strided(shape, stride, head_dim)
    physical = [32_799, 32_790, 32_770, 1, 32_780]  # shuffled, all but one past the int32 limit
    batch = make_paged_batch(
        [1, 1],
        [40, 27],
        num_q_heads=2,
        num_kv_heads=1,
        head_dim=head_dim,
        block_size=block_size,
        dtype=torch.float16,
        device=DEVICE,
        caches=(k_cache, v_cache),
        physical_blocks=physical,
    )
    assert batch.block_tables.max().item() * k_cache.stride(0) > 2**31
    _assert_close(_run(batch, num_splits=2), _ref(batch), torch.float16)


def test_serves_only_listed_sequences():
    batch = make_paged_batch(
        [1, 5, 1],
        [16, 0, 3],
        num_q_heads=2,
        num_kv_heads=2,
        head_dim=32,
        block_size=16,
        dtype=torch.float32,
        device=DEVICE,
    )
    out = torch.full_like(batch.q, 7.0)
    seq_ids = torch.tensor([0, 2], dtype=torch.int32, device=DEVICE)
    _run(batch, seq_ids=seq_ids, out=out)
    ref = _ref(batch)
    served = torch.tensor([0, 6])  # row of sequence 0 and of sequence 2
    _assert_close(out[served], ref[served], torch.float32)
    assert torch.equal(out[1:6], torch.full_like(out[1:6], 7.0))  # sequence 1's rows untouched


def _small_batch():
    return make_paged_batch(
        [1, 1],
        [3, 7],
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=32,
        block_size=16,
        dtype=torch.float32,
        device=DEVICE,
    )


def test_rejects_bad_arguments_naming_them():
    batch = _small_batch()
    scale = 32**-0.5
    args = (batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, batch.query_start_loc)
    bounds = {"max_query_len": 1, "max_seq_len": 8}
    with pytest.raises(TypeError, match="block_tables"):
        paged_decode_attention(*args[:3], batch.block_tables.long(), *args[4:], scale, **bounds)
    with pytest.raises(TypeError, match="k_cache"):
        paged_decode_attention(
            batch.q, batch.k_cache.half(), batch.v_cache.half(), *args[3:], scale, **bounds
        )
    with pytest.raises(ValueError, match="multiple"):
        paged_decode_attention(batch.q[:, :3], *args[1:], scale, **bounds)
    with pytest.raises(ValueError, match="query_start_loc"):
        paged_decode_attention(*args[:5], batch.query_start_loc[:2], scale, **bounds)
    with pytest.raises(ValueError, match="contiguous"):
        paged_decode_attention(
            batch.q.transpose(0, 2).contiguous().transpose(0, 2), *args[1:], scale, **bounds
        )
    with pytest.raises(ValueError, match="prefill_attention"):
        paged_decode_attention(*args, scale, max_query_len=65, max_seq_len=8)
    with pytest.raises(ValueError, match="k_scale"):
        fp8 = batch.k_cache.to(FP8_DTYPE)
        paged_decode_attention(batch.q, fp8, fp8, *args[3:], scale, **bounds)
