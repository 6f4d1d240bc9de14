"""Torch attention backend and metadata builder against a dense per-sequence causal attention."""

from __future__ import annotations

import random

import pytest
import torch
from tokenfleet.runtime.errors import ConfigError
from tokenfleet.runtime.model.attention import SeqSpec, build_attention_metadata, get_attention_backend

BLOCK_SIZE, HQ, HKV, D = 4, 6, 2, 8


def dense_reference(q, k, v, scale):
    """Full causal attention of one sequence's whole context: q/k/v [S, H, D] -> [S, Hq, D]."""
    k = k.repeat_interleave(HQ // HKV, dim=1)
    v = v.repeat_interleave(HQ // HKV, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * scale
    causal = torch.ones(q.shape[0], k.shape[0], dtype=torch.bool).tril()
    probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v.float())


def test_metadata_slots_and_tables():
    meta = build_attention_metadata(
        [SeqSpec(0, 3, [5]), SeqSpec(6, 1, [2, 7]), SeqSpec(3, 3, [1, 0])], BLOCK_SIZE
    )
    assert meta.slot_mapping.tolist() == [20, 21, 22, 30, 7, 0, 1]
    assert meta.query_start_loc.tolist() == [0, 3, 4, 7]
    assert meta.seq_lens.tolist() == [3, 7, 6] and meta.seq_lens_list == (3, 7, 6)
    assert meta.block_tables.tolist() == [[5, 0], [2, 7], [1, 0]]
    assert meta.block_tables.dtype == torch.int32 and meta.slot_mapping.dtype == torch.int64
    assert (meta.max_query_len, meta.max_seq_len, meta.query_lens) == (3, 7, (3, 1, 3))
    with pytest.raises(ValueError, match="cannot hold"):
        build_attention_metadata([SeqSpec(4, 1, [3])], BLOCK_SIZE)


@pytest.mark.parametrize("all_decode", [False, True])
def test_mixed_batch_over_shuffled_blocks_equals_dense(all_decode):
    torch.manual_seed(0)
    backend = get_attention_backend("torch")
    scale = D**-0.5
    # Per sequence: (context already cached, new tokens this step).
    shapes = [(0, 1), (5, 1), (12, 1)] if all_decode else [(0, 7), (5, 1), (9, 4), (0, 1), (13, 1), (3, 6)]
    physical = list(range(64))
    random.Random(1).shuffle(physical)
    k_cache = torch.zeros(64, BLOCK_SIZE, HKV, D)
    v_cache = torch.zeros(64, BLOCK_SIZE, HKV, D)
    specs, qs, ks, vs, refs = [], [], [], [], []
    for cached, new in shapes:
        total = cached + new
        blocks = [physical.pop() for _ in range(-(-total // BLOCK_SIZE))]
        q, k, v = torch.randn(total, HQ, D), torch.randn(total, HKV, D), torch.randn(total, HKV, D)
        if cached:  # the earlier steps' K/V already sit in this sequence's blocks
            slots = torch.tensor(
                [blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(cached)]
            )
            k_cache.view(-1, HKV, D)[slots] = k[:cached]
            v_cache.view(-1, HKV, D)[slots] = v[:cached]
        specs.append(SeqSpec(cached, new, blocks))
        qs.append(q[cached:])
        ks.append(k[cached:])
        vs.append(v[cached:])
        refs.append(dense_reference(q, k, v, scale)[cached:])
    meta = build_attention_metadata(specs, BLOCK_SIZE)
    assert meta.is_all_decode == all_decode
    out = backend.forward(torch.cat(qs), torch.cat(ks), torch.cat(vs), k_cache, v_cache, meta, scale)
    torch.testing.assert_close(out, torch.cat(refs), atol=1e-5, rtol=1e-5)
    # The new K/V landed at their slots.
    torch.testing.assert_close(k_cache.view(-1, HKV, D)[meta.slot_mapping], torch.cat(ks))


def test_bf16_inputs_are_attended_in_fp32():
    torch.manual_seed(0)
    specs = [SeqSpec(0, 9, [3, 1, 2])]
    meta = build_attention_metadata(specs, BLOCK_SIZE)
    q, k, v = (torch.randn(9, h, D) for h in (HQ, HKV, HKV))
    k_cache = torch.zeros(4, BLOCK_SIZE, HKV, D, dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    out = get_attention_backend("torch").forward(
        q.bfloat16(), k.bfloat16(), v.bfloat16(), k_cache, v_cache, meta, D**-0.5
    )
    assert out.dtype == torch.bfloat16
    ref = dense_reference(q.bfloat16().float(), k.bfloat16().float(), v.bfloat16().float(), D**-0.5)
    torch.testing.assert_close(out.float(), ref, atol=1e-2, rtol=1e-2)


def test_unknown_backend_is_a_config_error():
    with pytest.raises(ConfigError, match="unknown attention backend"):
        get_attention_backend("flash-of-genius")
