"""The default GGUF model against HF transformers (same file, fp32) through the paged KV cache."""

from __future__ import annotations

import random

import pytest
import torch
from tokenfleet.runtime.model.attention import SeqSpec, build_attention_metadata, build_positions

BLOCK_SIZE = 16
NUM_BLOCKS = 48


def new_caches(arch, num_blocks: int = NUM_BLOCKS):
    shape = (num_blocks, BLOCK_SIZE, arch.num_kv_heads, arch.head_dim)
    return [(torch.zeros(shape), torch.zeros(shape)) for _ in range(arch.num_layers)]


def run_step(model, caches, steps: list[tuple[list[int], int, list[int]]]) -> torch.Tensor:
    """One flattened step: per sequence (new token ids, start position, block ids) -> hidden [T, H]."""
    specs = [SeqSpec(start, len(ids), blocks) for ids, start, blocks in steps]
    input_ids = torch.tensor([t for ids, _, _ in steps for t in ids])
    meta = build_attention_metadata(specs, BLOCK_SIZE)
    with torch.inference_mode():
        return model(input_ids, build_positions(specs), caches, meta)


def hf_logits(hf_oracle, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf_oracle(torch.tensor([ids])).logits[0].float()


def test_prefill_logits_match_transformers(default_model, hf_oracle):
    tok = default_model.tokenizer
    ids = tok.encode("Kubernetes schedules pods onto nodes; the scheduler weighs resources and affinity.")
    model = default_model.model
    hidden = run_step(model, new_caches(default_model.arch), [(ids, 0, [7, 2, 30])])
    with torch.inference_mode():
        ours = model.compute_logits(hidden)
    ref = hf_logits(hf_oracle, ids)
    max_diff = (ours - ref).abs().max().item()
    print(f"prefill max |logit diff| vs HF fp32 over {len(ids)} tokens: {max_diff:.2e}")
    assert ours.dtype == torch.float32 and ours.shape == ref.shape
    assert max_diff < 1e-3
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_greedy_paris_through_paged_kv(default_model):
    tok, model = default_model.tokenizer, default_model.model
    prompt = tok.encode("The capital of France is")
    caches = new_caches(default_model.arch)
    blocks = [11, 3]  # deliberately not 0, 1: the block table must be honoured
    out: list[int] = []
    new, pos = prompt, 0
    for _ in range(3):
        hidden = run_step(model, caches, [(new, pos, blocks)])
        with torch.inference_mode():
            nxt = int(model.compute_logits(hidden[-1:]).argmax(-1))
        out.append(nxt)
        pos += len(new)
        new = [nxt]
    assert tok.decode(out).startswith(" Paris.")


def test_mixed_batch_with_shuffled_blocks_equals_per_sequence(default_model):
    """A fresh prefill, a prefill chunk after cached context, and decodes in one flat step."""
    tok, model, arch = default_model.tokenizer, default_model.model, default_model.arch
    texts = [
        "Once upon a time, in a land far away,",
        "def fib(n):\n    return n if n < 2 else",
        "1 2 3 4 5 6 7 8",
    ]
    prompts = [tok.encode(t) for t in texts]
    rng = random.Random(0)
    physical = list(range(1, NUM_BLOCKS))
    rng.shuffle(physical)
    blocks = [physical[0:3], physical[3:6], physical[6:9], physical[9:12]]

    # Reference: each sequence alone, whole prompt in one step, in its own cache.
    refs = []
    for ids in prompts:
        hidden = run_step(model, new_caches(arch), [(ids, 0, [1, 2, 3])])
        refs.append(hidden)

    caches = new_caches(arch)
    # Step 1: seq0 prefills fully, seq1 prefills its first 5 tokens, seq2 its first 4.
    run_step(
        model,
        caches,
        [(prompts[0], 0, blocks[0]), (prompts[1][:5], 0, blocks[1]), (prompts[2][:4], 0, blocks[2])],
    )
    # Step 2 (mixed): seq1 finishes its prompt (a chunk after cached context), seq2 feeds one token (a
    # decode row), and a new seq3 (= seq0's prompt) prefills from scratch.
    n2 = len(prompts[2])
    step2 = [(prompts[1][5:], 5, blocks[1]), (prompts[2][4:5], 4, blocks[2]), (prompts[0], 0, blocks[3])]
    hidden = run_step(model, caches, step2)
    q1 = len(prompts[1]) - 5
    torch.testing.assert_close(hidden[:q1], refs[1][5:], atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(hidden[q1], refs[2][4], atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(hidden[q1 + 1 :], refs[0], atol=2e-4, rtol=1e-4)
    # Steps 3+ (all decode): seq2's remaining tokens one per step, next to seq1's last token recomputed at
    # its position (rewriting the same K/V is idempotent).
    for pos in range(5, n2):
        last1 = len(prompts[1]) - 1
        step = [(prompts[2][pos : pos + 1], pos, blocks[2]), (prompts[1][last1:], last1, blocks[1])]
        hidden = run_step(model, caches, step)
        torch.testing.assert_close(hidden[0], refs[2][pos], atol=2e-4, rtol=1e-4)
        torch.testing.assert_close(hidden[1], refs[1][-1], atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16])
def test_half_precision_agrees_on_greedy_token(default_model, dtype):
    """bf16 weights and activations (the CUDA default) still pick the fp32 model's next token."""
    from tokenfleet.runtime.config import ModelConfig
    from tokenfleet.runtime.model import load_model

    loaded = load_model(ModelConfig(dtype="bfloat16"), torch.device("cpu"))
    assert loaded.dtype == dtype and loaded.model.lm_head.weight.dtype == dtype
    ids = default_model.tokenizer.encode("The capital of France is")
    shape = (8, BLOCK_SIZE, loaded.arch.num_kv_heads, loaded.arch.head_dim)
    caches = [
        (torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))
        for _ in range(loaded.arch.num_layers)
    ]
    logits = loaded.model.compute_logits(run_step(loaded.model, caches, [(ids, 0, [4])])[-1:])
    ref = default_model.model.compute_logits(
        run_step(default_model.model, new_caches(default_model.arch), [(ids, 0, [4])])[-1:]
    )
    assert logits.dtype == torch.float32
    assert int(logits.argmax()) == int(ref.argmax())
