"""Gemma 2's attention options in the kernels and both backends: logit soft-capping and a sliding window.

Decode and prefill kernels against their PyTorch references (CPU: Triton interpreter; GPU: the real
kernels), the decode custom op, and the triton backend against the torch backend on one mixed step. Windows
shorter than the contexts, not multiples of the key tiles, and cutting through the cached prefix; caps small
enough that capping changes the result (checked: the options are not no-ops on these inputs).
"""

from __future__ import annotations

import pytest
import torch
from tokenfleet.kernels import custom_ops  # noqa: F401 (registers tokenfleet::triton_paged_decode)
from tokenfleet.kernels._utils import causal_attention_ref
from tokenfleet.kernels.paged_attention import paged_attention_ref, paged_decode_attention
from tokenfleet.kernels.prefill_attention import prefill_attention, prefill_attention_ref
from tokenfleet.runtime.model.attention.base import DecodeMetadata, get_attention_backend
from tokenfleet.runtime.model.attention.metadata import SeqSpec, build_attention_metadata

from .paged_batch import make_paged_batch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOL = {torch.float32: 1e-5, torch.float16: 2e-3}
SOFTCAP = 1.5  # scores are ~N(0, 1): a cap this low bends most of them


def _batch(query_lens, context_lens, dtype=torch.float32, new_kv_in_cache=True, poison=True):
    return make_paged_batch(
        query_lens,
        context_lens,
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=32,
        block_size=16,
        dtype=dtype,
        device=DEVICE,
        new_kv_in_cache=new_kv_in_cache,
        poison=poison,
    )


def _decode(batch, **kwargs):
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
        **kwargs,
    )


def _prefill(batch, **kwargs):
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
        **kwargs,
    )


def _paged_ref(batch, **kwargs):
    args = (batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, batch.query_start_loc)
    return paged_attention_ref(*args, batch.q.shape[-1] ** -0.5, **kwargs)


def _prefill_ref(batch, **kwargs):
    args = (batch.q, batch.k, batch.v, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens)
    return prefill_attention_ref(*args, batch.query_start_loc, batch.q.shape[-1] ** -0.5, **kwargs)


def _close(out, ref, dtype=torch.float32):
    assert not out.isnan().any()
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])


def _differs(a, b):
    assert (a.float() - b.float()).abs().max() > 1e-2


def test_reference_window_is_hf_semantics():
    # Query at position 5 with window 3 sees keys 3, 4, 5 (HF: kv_idx > q_idx - sliding_window).
    q = torch.zeros(1, 1, 4)  # equal scores: the output is the mean of the visible values
    v = torch.arange(8.0)[:, None, None].expand(8, 1, 4)
    out = causal_attention_ref(q, torch.zeros(8, 1, 4), v, 1.0, context_len=5, sliding_window=3)
    assert out[0, 0].tolist() == [4.0] * 4
    scores = torch.tensor([[[[10.0]]]])  # one key, one query: softcap alone cannot change a softmax of one
    capped = causal_attention_ref(scores[0], scores[0], torch.ones(1, 1, 1), 1.0, 0, softcap=2.0)
    assert capped.item() == 1.0


# (query_lens, contexts before the step, window, dtype): decode rows and speculative-verification rows
DECODE_CASES = [
    pytest.param([1, 1, 1, 1], [3, 20, 45, 70], 8, torch.float32, id="w8-short-and-long"),
    pytest.param([1, 4, 3], [37, 29, 0], 19, torch.float32, id="w19-multi-query"),
    pytest.param([1, 1], [30, 63], 17, torch.float16, id="w17-fp16"),
    pytest.param([1, 1], [5, 9], 64, torch.float32, id="window-longer-than-context"),
]


@pytest.mark.parametrize(("query_lens", "context_lens", "window", "dtype"), DECODE_CASES)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_kernel_matches_reference(query_lens, context_lens, window, dtype, num_splits):
    batch = _batch(query_lens, context_lens, dtype)
    for options in (
        {"softcap": SOFTCAP},
        {"sliding_window": window},
        {"softcap": SOFTCAP, "sliding_window": window},
    ):
        _close(_decode(batch, num_splits=num_splits, **options), _paged_ref(batch, **options), dtype)
    _differs(_paged_ref(batch, softcap=SOFTCAP), _paged_ref(batch))
    if max(batch.seq_lens_list) > window:
        _differs(_paged_ref(batch, sliding_window=window), _paged_ref(batch))


def test_decode_window_skips_keys_before_it():
    # Keys in tiles wholly before the window become NaN after the reference ran: a kernel that read (rather
    # than masked) them would return NaN.
    batch = _batch([1, 2], [50, 40])
    window = 9
    ref = _paged_ref(batch, sliding_window=window)
    for b, seq_len in enumerate(batch.seq_lens_list):
        first_visible = seq_len - batch.query_lens[b] - window + 1
        for pos in range(first_visible // 32 * 32):
            block = int(batch.block_tables[b, pos // 16])
            batch.k_cache[block, pos % 16] = float("nan")
            batch.v_cache[block, pos % 16] = float("nan")
    _close(_decode(batch, block_n=32, sliding_window=window), ref)


# (query_lens, cached prefix lengths, window, dtype)
PREFILL_CASES = [
    pytest.param([40, 7, 20], [0, 21, 35], 8, torch.float32, id="w8-prefix-and-chunks"),
    pytest.param([37, 3], [19, 0], 13, torch.float32, id="w13-window-cuts-prefix"),
    pytest.param([33], [50], 40, torch.float16, id="w40-fp16"),
]


@pytest.mark.parametrize(("query_lens", "context_lens", "window", "dtype"), PREFILL_CASES)
@pytest.mark.parametrize(("block_m", "block_n"), [(16, 16), (32, 16)])
def test_prefill_kernel_matches_reference(query_lens, context_lens, window, dtype, block_m, block_n):
    batch = _batch(query_lens, context_lens, dtype, new_kv_in_cache=False)
    for options in (
        {"softcap": SOFTCAP},
        {"sliding_window": window},
        {"softcap": SOFTCAP, "sliding_window": window},
    ):
        out = _prefill(batch, block_m=block_m, block_n=block_n, **options)
        _close(out, _prefill_ref(batch, **options), dtype)
    _differs(_prefill_ref(batch, softcap=SOFTCAP), _prefill_ref(batch))
    _differs(_prefill_ref(batch, sliding_window=window), _prefill_ref(batch))


@pytest.mark.parametrize("bad", [{"softcap": 0.0}, {"softcap": -1.0}, {"sliding_window": 0}])
def test_kernels_reject_bad_options(bad):
    batch = _batch([2], [3])
    with pytest.raises(ValueError, match=next(iter(bad))):
        _decode(batch, **bad)
    with pytest.raises(ValueError, match=next(iter(bad))):
        _prefill(batch, **bad)


def test_decode_custom_op_passes_the_options():
    batch = _batch([1, 1, 1], [4, 25, 47], new_kv_in_cache=False)
    scale = batch.q.shape[-1] ** -0.5
    out = torch.ops.tokenfleet.triton_paged_decode(
        batch.q,
        batch.k,
        batch.v,
        batch.k_cache,
        batch.v_cache,
        batch.slot_mapping,
        batch.block_tables,
        batch.seq_lens,
        scale,
        None,
        None,
        SOFTCAP,
        10,
    )
    _close(out, _paged_ref(batch, softcap=SOFTCAP, sliding_window=10))


@pytest.mark.parametrize(("softcap", "window"), [(SOFTCAP, None), (None, 11), (SOFTCAP, 11)])
def test_backends_agree_on_a_mixed_step(softcap, window):
    """Decode rows, a verification step and prompt chunks over cached prefixes, through both backends."""
    specs = [
        SeqSpec(start_pos=0, num_new_tokens=1, block_ids=[9]),
        SeqSpec(start_pos=30, num_new_tokens=1, block_ids=[3, 10]),
        SeqSpec(start_pos=30, num_new_tokens=3, block_ids=[4, 1, 7]),
        SeqSpec(start_pos=20, num_new_tokens=13, block_ids=[12, 2, 6]),
        SeqSpec(start_pos=0, num_new_tokens=18, block_ids=[5, 8]),
    ]
    meta = build_attention_metadata(specs, 16, DEVICE)
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(meta.num_tokens, h, 32, generator=gen).to(DEVICE) for h in (6, 2, 2))
    cache_init = torch.randn(2, 13, 16, 2, 32, generator=gen).to(DEVICE)
    outputs = []
    for name in ("torch", "triton"):
        k_cache, v_cache = cache_init[0].clone(), cache_init[1].clone()
        backend = get_attention_backend(name)
        outputs.append(backend.forward(q, k, v, k_cache, v_cache, meta, 32**-0.5, softcap, window))
    torch.testing.assert_close(outputs[1], outputs[0], atol=1e-5, rtol=1e-5)
    # Oracle for the torch backend: the dense reference over each sequence's whole context.
    k_cache, v_cache = cache_init[0].clone(), cache_init[1].clone()
    plain = get_attention_backend("torch").forward(q, k, v, k_cache, v_cache, meta, 32**-0.5)
    starts = meta.query_start_loc.tolist()
    for b, spec in enumerate(specs):
        rows = slice(starts[b], starts[b + 1])
        table = torch.tensor(spec.block_ids, device=DEVICE)
        seq_len = spec.start_pos + spec.num_new_tokens
        keys = k_cache[table].reshape(-1, 2, 32)[:seq_len]
        values = v_cache[table].reshape(-1, 2, 32)[:seq_len]
        ref = causal_attention_ref(q[rows], keys, values, 32**-0.5, spec.start_pos, softcap, window)
        torch.testing.assert_close(outputs[0][rows], ref, atol=1e-5, rtol=1e-5)
    _differs(outputs[0], plain)


@pytest.mark.parametrize("name", ["torch", "triton"])
def test_decode_metadata_path_passes_the_options(name):
    """The compiled-decode entry (DecodeMetadata -> one custom op) applies softcap and window too. (No NaN
    padding: the torch backend multiplies masked-out padding rows by 0, which NaN survives.)"""
    batch = _batch([1, 1, 1], [4, 25, 47], poison=False)
    meta = DecodeMetadata(batch.slot_mapping, batch.block_tables, batch.seq_lens)
    scale = batch.q.shape[-1] ** -0.5
    out = get_attention_backend(name).forward(
        batch.q, batch.k, batch.v, batch.k_cache, batch.v_cache, meta, scale, SOFTCAP, 10
    )
    _close(out, _paged_ref(batch, softcap=SOFTCAP, sliding_window=10))
