"""Compiled decode steps on the real default model: the same greedy tokens as the eager path and as HF.

The engine-level test compiles three buckets (1, 2, 4) of the whole model with inductor's C++ backend:
minutes on 2 shared cores, so it is marked slow. The cheap tests check the static-shape path itself
(padding rows, the attention custom op, bucket choice) without compiling.
"""

from __future__ import annotations

import pytest
import torch
from tokenfleet.runtime.config import RuntimeConfig, SpeculativeConfig
from tokenfleet.runtime.engine.compiled_decode import default_buckets, should_compile
from tokenfleet.runtime.engine.llm import LLM
from tokenfleet.runtime.engine.sampling_params import SamplingParams
from tokenfleet.runtime.model.attention.base import DecodeMetadata
from tokenfleet.runtime.model.attention.metadata import SeqSpec, build_attention_metadata

MAX_NEW = 24
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "1, 2, 3, 4,",
    "Hi",
]
SYSTEM = "You are a meticulous assistant for a shipping company. Answer with short, factual sentences. "
SHARED = [SYSTEM + q for q in ("Where is my parcel?", "How do I return an item?")]


def test_buckets_are_powers_of_two_capped_by_max_num_seqs():
    assert default_buckets(1) == (1,)
    assert default_buckets(64) == (1, 2, 4, 8, 16, 32, 64)
    assert default_buckets(48) == (1, 2, 4, 8, 16, 32, 48)


def test_compile_setting(default_model):
    cpu = torch.device("cpu")
    assert not should_compile("off", cpu, default_model.model)
    assert not should_compile("auto", cpu, default_model.model)  # auto compiles on CUDA only
    assert should_compile("on", cpu, default_model.model)


@torch.inference_mode()
def test_padded_static_step_equals_the_flat_step(default_model):
    """Three sequences in a bucket of 4 through DecodeMetadata give the flat path's logits, and the padding
    row writes only the scratch block."""
    model, arch = default_model.model, default_model.arch
    block_size, num_blocks = 16, 12
    shape = (num_blocks + 1, block_size, arch.num_kv_heads, arch.head_dim)
    torch.manual_seed(0)
    caches = [(torch.randn(shape), torch.randn(shape)) for _ in range(arch.num_layers)]
    copies = [(k.clone(), v.clone()) for k, v in caches]
    specs = [SeqSpec(20, 1, [3, 4]), SeqSpec(5, 1, [7]), SeqSpec(40, 1, [0, 1, 2])]
    ids, pos = torch.tensor([11, 22, 33]), torch.tensor([20, 5, 40])
    flat = model.compute_logits(model(ids, pos, copies, build_attention_metadata(specs, block_size)))

    meta = build_attention_metadata(specs, block_size)
    scratch = num_blocks * block_size
    tables = torch.zeros(4, 8, dtype=torch.int32)
    tables[:3, : meta.block_tables.shape[1]] = meta.block_tables
    static = DecodeMetadata(
        slot_mapping=torch.cat([meta.slot_mapping, torch.tensor([scratch])]),
        block_tables=tables,
        seq_lens=torch.cat([meta.seq_lens, torch.tensor([1], dtype=torch.int32)]),
    )
    padded = model.compute_logits(
        model(torch.cat([ids, torch.tensor([0])]), torch.cat([pos, torch.tensor([0])]), caches, static)
    )
    # Batches of 4 and 3 rows take different GEMM paths: rounding differs, the greedy choice does not.
    torch.testing.assert_close(padded[:3], flat, rtol=1e-3, atol=2e-3)
    assert torch.equal(padded[:3].argmax(-1), flat.argmax(-1))
    # Real blocks hold the same K/V as the flat step wrote (a batch of 4 rows may round differently).
    for (k, v), (k0, v0) in zip(caches, copies, strict=True):
        torch.testing.assert_close(k[:num_blocks], k0[:num_blocks], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(v[:num_blocks], v0[:num_blocks], rtol=1e-4, atol=1e-4)


def _run(loaded, prompts, config=None, **options):
    llm = LLM(config=config or RuntimeConfig(), loaded=loaded, dtype="float32", max_num_seqs=4, **options)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    ids = [llm.tokenizer.encode(p) for p in prompts]
    outs = [o.token_ids for o in llm.generate(ids, params)]
    for prompt in SHARED:  # one after the other: the second finds the first's system prompt cached
        outs += [o.token_ids for o in llm.generate([llm.tokenizer.encode(prompt)], params)]
    km = llm.engine.kv_manager
    assert km.num_free_blocks == km.num_blocks, "KV blocks leaked"
    return llm, ids, outs


def _hf_greedy(hf_oracle, ids: list[int]) -> list[int]:
    out, past, step = [], None, torch.tensor([ids])
    with torch.no_grad():
        for _ in range(MAX_NEW):
            res = hf_oracle(input_ids=step, past_key_values=past, use_cache=True)
            past, token = res.past_key_values, int(res.logits[0, -1].argmax())
            out.append(token)
            step = torch.tensor([[token]])
    return out


@pytest.mark.slow
def test_compiled_engine_matches_eager_and_hf(default_model, hf_oracle):
    # 6 blocks of 16 tokens for up to 4 running sequences that each grow past 2 blocks: the scheduler must
    # preempt; the second shared-prefix prompt hits the first one's cached system prompt; ngram speculation
    # mixes verify steps (eager) with plain decode steps (compiled).
    options = {"num_blocks": 6, "block_size": 16}
    _eager, ids, expected = _run(default_model, PROMPTS, compile="off", **options)
    compiled, _, got = _run(default_model, PROMPTS, compile="on", **options)
    assert got == expected
    assert compiled.engine.runner.compiled.num_steps > 0
    stats = compiled.engine.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    for i, tokens in zip(ids, got, strict=False):
        assert tokens == _hf_greedy(hf_oracle, i)

    spec = RuntimeConfig(speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=3, ngram_min=1))
    speculative, _, spec_got = _run(default_model, PROMPTS, config=spec, compile="on", **options)
    assert spec_got == expected
    assert speculative.engine.runner.compiled.num_steps > 0
