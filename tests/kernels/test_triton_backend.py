"""The triton attention backend against the torch reference backend: same metadata, same results.

On CPU the kernels run under the Triton interpreter (fp32, exact dots); on a GPU, natively. Two levels:
one mixed step straight through the backends, and greedy generation with a tiny random 2-layer Llama
(chunked prefill, decode and a speculative-verification-shaped step) that must produce the same tokens.
"""

from __future__ import annotations

import pytest
import torch
from tokenfleet.kernels.cache_ops import write_kv_cache_ref
from tokenfleet.kernels.paged_attention import paged_attention_ref
from tokenfleet.runtime.model.arch import ModelArch
from tokenfleet.runtime.model.attention.base import get_attention_backend, resolve_backend_name
from tokenfleet.runtime.model.attention.metadata import SeqSpec, build_attention_metadata, build_positions
from tokenfleet.runtime.model.attention.triton_backend import TritonAttentionBackend, plan_launches
from tokenfleet.runtime.model.llama import LlamaForCausalLM

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
BLOCK_SIZE = 16


def _caches(num_blocks, num_kv_heads, head_dim, seed):
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(num_blocks, BLOCK_SIZE, num_kv_heads, head_dim, generator=gen).to(DEVICE)
    return k, torch.randn(k.shape, generator=gen).to(DEVICE)


def test_registered_and_chosen_on_cuda():
    assert isinstance(get_attention_backend("triton"), TritonAttentionBackend)
    assert resolve_backend_name("auto", torch.device("cuda")) == "triton"


def test_mixed_step_matches_torch_backend():
    # Decode rows (context 1, 16, 17), a 3-token verification step, a prompt chunk after a 20-token cached
    # prefix (not block-aligned), and a fresh 18-token prompt; physical blocks out of order.
    specs = [
        SeqSpec(start_pos=0, num_new_tokens=1, block_ids=[9]),
        SeqSpec(start_pos=15, num_new_tokens=1, block_ids=[3]),
        SeqSpec(start_pos=16, num_new_tokens=1, block_ids=[0, 11]),
        SeqSpec(start_pos=30, num_new_tokens=3, block_ids=[4, 1, 7]),
        SeqSpec(start_pos=20, num_new_tokens=13, block_ids=[12, 2, 6]),
        SeqSpec(start_pos=0, num_new_tokens=18, block_ids=[5, 8]),
    ]
    meta = build_attention_metadata(specs, BLOCK_SIZE, DEVICE)
    num_q_heads, num_kv_heads, head_dim = 6, 2, 32
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(meta.num_tokens, num_q_heads, head_dim, generator=gen).to(DEVICE)
    k = torch.randn(meta.num_tokens, num_kv_heads, head_dim, generator=gen).to(DEVICE)
    v = torch.randn(meta.num_tokens, num_kv_heads, head_dim, generator=gen).to(DEVICE)
    scale = head_dim**-0.5

    plan = plan_launches(meta, num_q_heads // num_kv_heads, DEVICE)
    assert plan.decode_ids.tolist() == [0, 1, 2, 3] and plan.prefill_ids.tolist() == [4, 5]

    outputs, caches = [], []
    for name in ("torch", "triton"):
        k_cache, v_cache = _caches(13, num_kv_heads, head_dim, seed=2)
        outputs.append(get_attention_backend(name).forward(q, k, v, k_cache, v_cache, meta, scale))
        caches.append((k_cache, v_cache))
    torch.testing.assert_close(outputs[1], outputs[0], atol=1e-5, rtol=1e-5)
    assert torch.equal(caches[1][0], caches[0][0]) and torch.equal(caches[1][1], caches[0][1])


def test_fp8_cache_decode_step_matches_reference(fp8_cast):
    # The torch backend has no fp8 path on CPU (index_copy_ lacks Float8), so the oracle is the kernels'
    # references: torch's e4m3 quantisation at scale 1.0, then attention over the dequantised cache.
    specs = [SeqSpec(p, 1, ids) for p, ids in ((0, [3]), (16, [1, 4]), (40, [0, 2, 5]))]
    meta = build_attention_metadata(specs, BLOCK_SIZE, DEVICE)
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(3, heads, 32, generator=gen).to(DEVICE) for heads in (4, 2, 2))
    k_cache, v_cache = (c.to(torch.float8_e4m3fn) for c in _caches(6, 2, 32, seed=4))
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    out = get_attention_backend("triton").forward(q, k, v, k_cache, v_cache, meta, 32**-0.5)

    one = torch.ones(1, device=DEVICE)
    write_kv_cache_ref(k, v, k_ref, v_ref, meta.slot_mapping.cpu(), one, one)
    assert torch.equal(k_cache.view(torch.uint8), k_ref.view(torch.uint8))
    assert torch.equal(v_cache.view(torch.uint8), v_ref.view(torch.uint8))
    ref = paged_attention_ref(
        q, k_ref, v_ref, meta.block_tables, meta.seq_lens, meta.query_start_loc, 32**-0.5, one, one
    )
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


ARCH = ModelArch(
    model_type="llama",
    vocab_size=96,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=2,
    num_kv_heads=1,
    head_dim=32,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    max_position_embeddings=128,
)


@pytest.fixture(scope="module")
def models():
    built = {}
    for name in ("torch", "triton"):
        torch.manual_seed(0)  # identical random weights for both backends
        built[name] = LlamaForCausalLM(ARCH, get_attention_backend(name), max_positions=128).to(DEVICE).eval()
    return built


def _generate(model: LlamaForCausalLM, prompts: list[list[int]], steps: int) -> tuple[list[list[int]], list]:
    """Greedy generation over a paged cache: prompt 1 is prefilled in two chunks (13 + rest) while
    prompt 0 starts decoding; one step feeds 3 tokens to sequence 0 as a speculative verification would."""
    caches = [
        (
            torch.zeros(12, BLOCK_SIZE, ARCH.num_kv_heads, ARCH.head_dim, device=DEVICE),
            torch.zeros(12, BLOCK_SIZE, ARCH.num_kv_heads, ARCH.head_dim, device=DEVICE),
        )
        for _ in range(ARCH.num_layers)
    ]
    block_ids = [[7, 2, 10], [0, 5, 9, 3]]
    tokens = [list(p) for p in prompts]
    computed = [0, 0]
    chunk_plan = [[len(prompts[0]), 13], [1, len(prompts[1]) - 13], [1, 1], [3, 1]]
    all_logits = []
    for step in range(steps):
        chunks = chunk_plan[step] if step < len(chunk_plan) else [1, 1]
        # A 3-token step feeds the last generated token plus two tokens "drafted" as copies of it.
        if chunks[0] == 3:
            tokens[0] += [tokens[0][-1]] * 2
        specs = [
            SeqSpec(start_pos=computed[b], num_new_tokens=chunks[b], block_ids=block_ids[b]) for b in range(2)
        ]
        meta = build_attention_metadata(specs, BLOCK_SIZE, DEVICE)
        input_ids = torch.tensor(
            [t for b in range(2) for t in tokens[b][computed[b] : computed[b] + chunks[b]]], device=DEVICE
        )
        with torch.no_grad():
            hidden = model(input_ids, build_positions(specs, DEVICE), caches, meta)
            logits = model.compute_logits(hidden)
        all_logits.append(logits)
        ends = torch.cumsum(torch.tensor(chunks), 0) - 1
        for b in range(2):
            computed[b] += chunks[b]
            if chunks[0] == 3 and b == 0:
                # Verification: keep the drafts as far as the model agrees, then append its own next token.
                rows = logits[ends[0] - 2 : ends[0] + 1].argmax(-1).tolist()
                drafts, accepted = tokens[0][-2:], 0
                while accepted < 2 and rows[accepted] == drafts[accepted]:
                    accepted += 1
                del tokens[0][len(tokens[0]) - 2 + accepted :]
                computed[0] -= 2 - accepted
                tokens[0].append(rows[accepted])
            elif computed[b] == len(tokens[b]):
                tokens[b].append(int(logits[ends[b]].argmax()))
    return tokens, all_logits


def test_tiny_llama_greedy_tokens_match_torch_backend(models):
    prompts = [[3, 17, 42, 8, 8, 91, 5, 60, 33, 2, 71], [i * 7 % 96 for i in range(1, 21)]]
    ref_tokens, ref_logits = _generate(models["torch"], prompts, steps=6)
    tokens, logits = _generate(models["triton"], prompts, steps=6)
    assert tokens == ref_tokens
    assert len(tokens[0]) > len(prompts[0]) + 4 and len(tokens[1]) > len(prompts[1]) + 4
    for got, want in zip(logits, ref_logits, strict=True):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
