"""tokenfleet::triton_paged_decode: the decode step's cache write + paged attention as one custom op."""

from __future__ import annotations

import torch
from tokenfleet.kernels.custom_ops import triton_paged_decode
from tokenfleet.kernels.paged_attention import paged_attention_ref

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _case(num_seqs=3, hq=6, hkv=2, head_dim=32, block_size=16, max_blocks=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    num_blocks = num_seqs * max_blocks + 1

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(DEVICE)

    k_cache, v_cache = (
        rand(num_blocks, block_size, hkv, head_dim),
        rand(num_blocks, block_size, hkv, head_dim),
    )
    # Sequence b owns blocks b*max_blocks.. ; context lengths 1 (a padding-like row), mid-block, block-aligned.
    seq_lens = torch.tensor([1, 21, 48][:num_seqs], dtype=torch.int32)
    tables = torch.arange(num_seqs * max_blocks, dtype=torch.int32).view(num_seqs, max_blocks)
    slots = torch.tensor(
        [
            int(tables[b, (n - 1) // block_size]) * block_size + (n - 1) % block_size
            for b, n in enumerate(seq_lens.tolist())
        ]
    )
    q, k, v = rand(num_seqs, hq, head_dim), rand(num_seqs, hkv, head_dim), rand(num_seqs, hkv, head_dim)
    return q, k, v, k_cache, v_cache, slots.to(DEVICE), tables.to(DEVICE), seq_lens.to(DEVICE)


def test_writes_the_new_rows_then_matches_the_reference():
    q, k, v, k_cache, v_cache, slots, tables, seq_lens = _case()
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    hkv, d = k.shape[1], k.shape[2]
    expected_k.view(-1, hkv, d)[slots] = k
    expected_v.view(-1, hkv, d)[slots] = v
    scale = d**-0.5
    out = torch.ops.tokenfleet.triton_paged_decode(
        q, k, v, k_cache, v_cache, slots, tables, seq_lens, scale, None, None
    )
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)
    starts = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=DEVICE)
    ref = paged_attention_ref(q, expected_k, expected_v, tables, seq_lens, starts, scale)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_registration_passes_opcheck():
    # Schema, fake (meta) implementation and declared mutations agree with what the op really does.
    args = _case(seed=1)
    torch.library.opcheck(
        triton_paged_decode,
        (*args, args[0].shape[-1] ** -0.5, None, None),
        test_utils=("test_schema", "test_faketensor"),
    )
