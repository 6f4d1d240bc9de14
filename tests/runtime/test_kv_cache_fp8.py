"""An fp8 (e4m3) KV cache on the default model: a quarter of fp32's bytes, output close to the fp32 cache.

Per-tensor scale 1.0 (no calibration, as vLLM's default): K/V of this model stay well inside e4m3's range.
"""

from __future__ import annotations

import torch
from tokenfleet.runtime.config import RuntimeConfig
from tokenfleet.runtime.engine.llm import LLM
from tokenfleet.runtime.engine.sampling_params import SamplingParams
from tokenfleet.runtime.model.attention.torch_backend import gather_context, write_kv

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at", "Once upon a time"]


def test_fp8_write_then_gather_round_trips_within_e4m3_precision():
    torch.manual_seed(0)
    k_cache = torch.zeros(4, 16, 2, 64, dtype=torch.float8_e4m3fn)
    v_cache = torch.zeros_like(k_cache)
    k, v = torch.randn(5, 2, 64) * 3, torch.randn(5, 2, 64)
    slots = torch.tensor([17, 18, 40, 3, 63])
    write_kv(k, v, k_cache, v_cache, slots, k_scale=0.5, v_scale=1.0)
    table = [1, 2, 0, 3]  # logical block i lives in physical block table[i]
    keys = gather_context(k_cache, torch.tensor([table]), 64, scale=0.5)[0]
    values = gather_context(v_cache, torch.tensor([table]), 64, scale=1.0)[0]
    for row, slot in enumerate(slots.tolist()):
        pos = table.index(slot // 16) * 16 + slot % 16
        for got, want in ((keys[pos], k[row]), (values[pos], v[row])):
            # e4m3 keeps 3 mantissa bits: relative rounding error <= 2^-4 (absolute near zero).
            assert ((got - want).abs() <= want.abs() / 16 + 2e-3).all()


def test_fp8_kv_cache_serves_close_to_the_fp32_cache(default_model):
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    base = LLM(config=RuntimeConfig(), loaded=default_model, num_blocks=64)
    fp8 = LLM(config=RuntimeConfig(), loaded=default_model, num_blocks=64, kv_cache_dtype="fp8_e4m3")
    assert fp8.engine.runner.kv_caches[0][0].dtype == torch.float8_e4m3fn
    ref = [o.outputs[0] for o in base.generate(PROMPTS, params)]
    out = [o.outputs[0] for o in fp8.generate(PROMPTS, params)]
    # Greedy continuations agree on their first tokens and mostly beyond (near-ties may flip later).
    assert [o.token_ids[0] for o in out] == [r.token_ids[0] for r in ref]
    agree = sum(
        a == b for o, r in zip(out, ref, strict=True) for a, b in zip(o.token_ids, r.token_ids, strict=True)
    )
    assert agree >= 0.75 * sum(len(r.token_ids) for r in ref)
    km = fp8.engine.kv_manager
    assert km.num_free_blocks == km.num_blocks


def test_fp8_kv_cache_quarters_the_bytes_per_block(default_model):
    budget = {"cpu_kv_cache_gib": 0.05}
    fp32 = LLM(config=RuntimeConfig(), loaded=default_model, **budget)
    fp8 = LLM(config=RuntimeConfig(), loaded=default_model, kv_cache_dtype="fp8_e4m3", **budget)
    # Same budget, a quarter of the bytes per block (up to the rounding of budget // bytes per block).
    assert 0 <= fp8.engine.kv_manager.num_blocks - 4 * fp32.engine.kv_manager.num_blocks < 4
