"""Varlen causal prefill over a paged prefix against its PyTorch reference.

The new tokens' cache rows are NaN-poisoned: the kernel must take new K/V from the step's tensors, and the
prefix only from the rows the block table gives. Tolerances per dtype as in test_paged_attention.py:
fp32 1e-5, fp16 2e-3, bf16 1.6e-2 (abs and rel; bf16 on GPU only).
"""

from __future__ import annotations

import pytest
import torch
from tokenfleet.kernels.fp8_format import FP8_DTYPE
from tokenfleet.kernels.prefill_attention import prefill_attention, prefill_attention_ref

from .paged_batch import make_paged_batch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _batch(query_lens, context_lens, hq, hkv, head_dim, block_size, dtype, **kwargs):
    return make_paged_batch(
        query_lens,
        context_lens,
        num_q_heads=hq,
        num_kv_heads=hkv,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        device=DEVICE,
        new_kv_in_cache=False,
        **kwargs,
    )


def _run(batch, **kwargs):
    return prefill_attention(
        batch.q,
        batch.k,
        batch.v,
        batch.k_cache,
        batch.v_cache,
        batch.block_tables,
        batch.seq_lens,
        batch.query_start_loc,
        batch.q.shape[-1] ** -0.5,
        max_query_len=batch.max_query_len,
        k_scale=batch.k_scale,
        v_scale=batch.v_scale,
        **kwargs,
    )


def _ref(batch):
    return prefill_attention_ref(
        batch.q,
        batch.k,
        batch.v,
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


# (query_lens, cached prefix lengths, Hq, Hkv, head_dim, block_size, dtype)
CASES = [
    pytest.param([5], [0], 2, 2, 64, 16, torch.float32, id="short-prompt-no-prefix"),
    pytest.param([40, 7, 1], [0, 21, 16], 3, 1, 64, 16, torch.float16, id="mixed-unaligned-chunk-gqa3"),
    pytest.param([20, 33], [32, 15], 2, 2, 128, 32, torch.float32, id="aligned-and-unaligned-prefix-d128"),
    pytest.param([17, 9], [3, 31], 8, 1, 32, 16, torch.float16, id="mqa8"),
    pytest.param([12], [9], 2, 1, 80, 16, torch.float32, id="head-dim-80-padded"),
]
if DEVICE.type == "cuda":
    CASES.append(pytest.param([300, 70], [0, 200], 32, 8, 128, 16, torch.bfloat16, id="bf16-gpu"))


@pytest.mark.parametrize(
    ("query_lens", "context_lens", "hq", "hkv", "head_dim", "block_size", "dtype"), CASES
)
def test_matches_reference(query_lens, context_lens, hq, hkv, head_dim, block_size, dtype):
    batch = _batch(query_lens, context_lens, hq, hkv, head_dim, block_size, dtype)
    _assert_close(_run(batch), _ref(batch), dtype)


def test_tile_sizes_do_not_change_the_result():
    # Query tiles of 16 and 32 rows cut the 37-token chunk (after a 19-token prefix) in different places.
    batch = _batch([37, 3], [19, 0], 2, 1, 32, 16, torch.float32)
    ref = _ref(batch)
    for block_m, block_n in ((16, 16), (32, 16), (32, 32)):
        _assert_close(_run(batch, block_m=block_m, block_n=block_n), ref, torch.float32)


def test_fp8_prefix_dequantised_new_tokens_full_precision():
    batch = _batch([9, 4], [17, 30], 4, 2, 64, 16, torch.float16, cache_dtype=FP8_DTYPE)
    _assert_close(_run(batch), _ref(batch), torch.float16)


def test_int64_offsets_beyond_2_pow_31_elements():
    # See test_paged_attention: a view whose top blocks start past 2**31 elements, lazily committed.
    num_blocks, block_size, head_dim, row = 32_800, 16, 16, 4096
    storage = torch.empty(num_blocks * block_size * row, dtype=torch.float16, device=DEVICE)
    shape, stride = (num_blocks, block_size, 1, head_dim), (block_size * row, row, row, 1)
    caches = (storage.as_strided(shape, stride, 0), storage.as_strided(shape, stride, head_dim))
    batch = _batch(
        [6],
        [35],
        2,
        1,
        head_dim,
        block_size,
        torch.float16,
        caches=caches,
        physical_blocks=[32_799, 7, 32_777],
    )
    _assert_close(_run(batch), _ref(batch), torch.float16)


def test_serves_only_listed_sequences():
    batch = _batch([3, 4], [5, 0], 2, 2, 32, 16, torch.float32)
    out = torch.full_like(batch.q, 7.0)
    _run(batch, seq_ids=torch.tensor([1], dtype=torch.int32, device=DEVICE), out=out)
    _assert_close(out[3:], _ref(batch)[3:], torch.float32)
    assert torch.equal(out[:3], torch.full_like(out[:3], 7.0))


def test_rejects_bad_arguments_naming_them():
    batch = _batch([3], [2], 4, 2, 32, 16, torch.float32)
    scale = 32**-0.5
    rest = (batch.block_tables, batch.seq_lens, batch.query_start_loc, scale)
    with pytest.raises(TypeError, match="k has dtype"):
        prefill_attention(
            batch.q, batch.k.half(), batch.v, batch.k_cache, batch.v_cache, *rest, max_query_len=3
        )
    with pytest.raises(ValueError, match="v has size"):
        prefill_attention(
            batch.q, batch.k, batch.v[:, :1], batch.k_cache, batch.v_cache, *rest, max_query_len=3
        )
    with pytest.raises(ValueError, match="k_cache"):
        prefill_attention(
            batch.q, batch.k, batch.v, batch.k_cache[:, :, :1], batch.v_cache, *rest, max_query_len=3
        )
    with pytest.raises(ValueError, match="block_m"):
        _run(batch, block_m=8)
    with pytest.raises(ValueError, match="multiple of block_n"):
        _run(batch, block_m=16, block_n=32)
    with pytest.raises(TypeError, match="seq_lens"):
        prefill_attention(
            batch.q,
            batch.k,
            batch.v,
            batch.k_cache,
            batch.v_cache,
            batch.block_tables,
            batch.seq_lens.long(),
            batch.query_start_loc,
            scale,
            max_query_len=3,
        )
