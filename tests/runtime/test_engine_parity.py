"""The engine against HF transformers on the real default model: greedy, fp32, token for token.

Each variant (one batch, chunked prefill, prefix caching, preemption) must produce exactly HF's tokens,
and leave every KV block free afterwards.
"""

from __future__ import annotations

import pytest
import torch
from tokenfleet.runtime.config import RuntimeConfig
from tokenfleet.runtime.engine import logits_buffer
from tokenfleet.runtime.engine.llm import LLM
from tokenfleet.runtime.engine.sampling_params import SamplingParams

MAX_NEW = 12

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "1, 2, 3, 4,",
    "Q: What is the boiling point of water at sea level?\nA:",
    "The quick brown fox",
    "Translate to French: I like apples. ->",
    "In machine learning, a transformer is a deep learning architecture that relies on the attention "
    "mechanism. It was introduced in 2017 and has since become the basis of most large language models, "
    "including those used for chat assistants. The key idea is",
    "Hi",
]

SYSTEM = (
    "You are a meticulous assistant for a shipping company. Always answer with short, factual sentences, "
    "cite the relevant policy number when one applies, and never invent tracking numbers or dates. "
)
SHARED_PREFIX_PROMPTS = [
    SYSTEM + q for q in ("Where is my parcel?", "How do I return an item?", "Who are you?")
]


@pytest.fixture(scope="module")
def loaded(default_model):
    return default_model


@pytest.fixture(scope="module")
def tokenizer(loaded):
    return loaded.tokenizer


def hf_greedy(hf_oracle, ids: list[int], max_new: int) -> list[int]:
    """Greedy decoding through HF's own KV cache, never stopping at EOS (like ignore_eos=True)."""
    out: list[int] = []
    past = None
    step = torch.tensor([ids])
    with torch.no_grad():
        for _ in range(max_new):
            res = hf_oracle(input_ids=step, past_key_values=past, use_cache=True)
            past = res.past_key_values
            token = int(res.logits[0, -1].argmax())
            out.append(token)
            step = torch.tensor([[token]])
    return out


@pytest.fixture(scope="module")
def reference(hf_oracle, tokenizer):
    prompts = PROMPTS + SHARED_PREFIX_PROMPTS
    ids = [tokenizer.encode(p) for p in prompts]
    return {tuple(i): hf_greedy(hf_oracle, i, MAX_NEW) for i in ids}


def run(loaded, reference, prompts, **options):
    llm = LLM(config=RuntimeConfig(), loaded=loaded, dtype="float32", **options)
    ids = [llm.tokenizer.encode(p) for p in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate(ids, params)
    for i, out in zip(ids, outs, strict=True):
        assert out.outputs[0].token_ids == reference[tuple(i)], (
            f"mismatch for prompt {llm.tokenizer.decode(i)!r}"
        )
    km = llm.engine.kv_manager
    assert km.num_free_blocks == km.num_blocks, "KV blocks leaked"
    return llm, outs


def test_one_batch_matches_hf(loaded, reference):
    run(loaded, reference, PROMPTS)


def test_chunked_prefill_matches_hf(loaded, reference):
    # A 7-token budget forces every prompt through several chunks, interleaved with other requests' decodes.
    llm, _ = run(loaded, reference, PROMPTS, max_num_batched_tokens=7)
    assert llm.engine.stats().num_steps > len(PROMPTS) * MAX_NEW // 4


def test_prefix_cache_hits_and_matches_hf(loaded, reference, tokenizer):
    llm = LLM(config=RuntimeConfig(), loaded=loaded, dtype="float32", block_size=16)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    ids = [tokenizer.encode(p) for p in SHARED_PREFIX_PROMPTS]
    first = llm.generate(ids[:1], params)
    assert first[0].num_cached_tokens == 0
    second = llm.generate(ids, params)
    shared_blocks = len(tokenizer.encode(SYSTEM)) // 16
    for out, i in zip(second, ids, strict=True):
        assert out.outputs[0].token_ids == reference[tuple(i)]
        assert out.num_cached_tokens >= shared_blocks * 16
    stats = llm.engine.stats()
    assert stats.prefix_cache_hits >= 3 * shared_blocks * 16
    assert stats.num_free_blocks == stats.num_total_blocks


def test_logits_into_the_kept_buffer_match_hf(loaded, reference, monkeypatch):
    # On CPU, logits above malloc's mmap threshold are written into one buffer kept across steps. The
    # threshold set to 0 sends every step there, with as many rows as it samples (9, then fewer as chunked
    # prompts finish at different steps): the same tokens as HF's.
    monkeypatch.setattr(logits_buffer, "_MMAP_THRESHOLD_MAX", 0)
    llm, _ = run(loaded, reference, PROMPTS, max_num_batched_tokens=7)
    assert llm.engine.runner.logits_buffer._buffer is not None


def test_preemption_matches_hf(loaded, reference):
    # 12 blocks of 16 tokens cannot hold all nine sequences at once: the scheduler must preempt.
    llm, _ = run(loaded, reference, PROMPTS, num_blocks=12, block_size=16)
    assert llm.engine.stats().num_preemptions > 0


def test_capital_of_france(loaded):
    llm = LLM(config=RuntimeConfig(), loaded=loaded)
    out = llm.generate("The capital of France is", SamplingParams(temperature=0.0, max_tokens=3))[0].outputs[
        0
    ]
    assert out.text.startswith(" Paris")
