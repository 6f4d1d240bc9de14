"""MoE kernels (gating, alignment, grouped expert GEMMs) against their torch references.

On CPU the Triton kernels run under the interpreter, in fp16 (its bf16 arithmetic is wrong). The FP8
cases quantise activations inside a kernel, so they use the `fp8_cast` fixture (tests/kernels/conftest.py)
that gives the interpreter the GPU's saturating round-to-nearest-even fp32 -> e4m3 conversion.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tokenfleet.kernels.moe import fused_experts, fused_experts_ref, fused_moe, quantize_experts_fp8
from tokenfleet.kernels.moe_align import moe_align_block_size
from tokenfleet.kernels.moe_gating import moe_gating, moe_gating_ref

H, INTER = 48, 40  # neither is a multiple of the kernels' tiles


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize(("num_tokens", "num_experts", "top_k"), [(1, 4, 1), (13, 8, 2), (6, 60, 4)])
def test_gating_matches_reference(num_tokens, num_experts, top_k, renormalize, scoring):
    torch.manual_seed(0)
    logits = torch.randn(num_tokens, num_experts, dtype=torch.float16)
    weights, ids = moe_gating(logits, top_k, renormalize, scoring)
    ref_weights, ref_ids = moe_gating_ref(logits, top_k, renormalize, scoring)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_weights, rtol=1e-6, atol=1e-7)
    if renormalize:
        torch.testing.assert_close(weights.sum(-1), torch.ones(num_tokens), rtol=1e-6, atol=1e-6)


def test_gating_breaks_ties_towards_the_lowest_expert():
    logits = torch.tensor(
        [
            [0.0, 0.0, 0.0, 0.0, 0.0, 0.0],  # all equal: experts 0, 1, 2
            [1.0, 3.0, 3.0, 0.0, 3.0, -1.0],  # three-way tie at the top
            [-5.0, 2.0, -5.0, 2.0, 9.0, 2.0],  # clear winner, then a tie
        ]
    )
    for backend in (moe_gating, moe_gating_ref):
        weights, ids = backend(logits, 3, renormalize=True, scoring="softmax")
        assert ids.tolist() == [[0, 1, 2], [1, 2, 4], [4, 1, 3]]
        torch.testing.assert_close(weights[0], torch.full((3,), 1 / 3))


@pytest.mark.parametrize(
    ("num_tokens", "top_k", "num_experts", "block_m"), [(1, 1, 4, 16), (37, 2, 8, 16), (50, 4, 8, 32)]
)
def test_alignment_invariants(num_tokens, top_k, num_experts, block_m):
    torch.manual_seed(1)
    # Expert 0 gets no tokens at all: it must get no block either.
    scores = torch.rand(num_tokens, num_experts - 1)
    topk_ids = scores.topk(top_k, dim=-1).indices.int() + 1
    align = moe_align_block_size(topk_ids, num_experts, block_m)
    flat = topk_ids.reshape(-1).long()
    sentinel = flat.numel()
    assert align.num_assignments == sentinel

    used = int(align.num_padded.item())
    counts = torch.bincount(flat, minlength=num_experts)
    assert used == int(((counts + block_m - 1) // block_m * block_m).sum())
    assert used % block_m == 0 and used <= align.sorted_ids.numel()

    ids = align.sorted_ids[:used].long()
    real = ids[ids != sentinel]
    # Every (token, slot) assignment exactly once; everything past the used rows is padding.
    assert torch.equal(torch.sort(real).values, torch.arange(sentinel))
    assert torch.all(align.sorted_ids[used:] == sentinel)
    # Each row block holds one expert's assignments only, in ascending (token, slot) order.
    block_experts = align.expert_ids[: used // block_m].long()
    assert torch.all(align.expert_ids[used // block_m :] == -1)
    assert 0 not in block_experts.tolist()
    for b, expert in enumerate(block_experts.tolist()):
        rows = ids[b * block_m : (b + 1) * block_m]
        rows = rows[rows != sentinel]
        assert rows.numel() > 0 and torch.all(flat[rows] == expert)
        assert torch.all(rows[1:] > rows[:-1])
    assert block_experts.tolist() == sorted(block_experts.tolist())


def _experts(num_experts: int, seed: int = 0):
    torch.manual_seed(seed)
    w13 = (torch.randn(num_experts, 2 * INTER, H) / H**0.5).half()
    w2 = (torch.randn(num_experts, H, INTER) / INTER**0.5).half()
    return w13, w2


@pytest.mark.parametrize("fp8", [False, True], ids=["fp16", "fp8"])
@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("num_experts", [4, 8])
def test_fused_moe_matches_reference(fp8_cast, num_experts, top_k, renormalize, fp8):
    w13, w2 = _experts(num_experts)
    hidden = torch.randn(5, H).half()
    logits = torch.randn(5, num_experts)
    scales = {}
    if fp8:
        w13, scales["w13_scale"] = quantize_experts_fp8(w13.float(), "per_channel")
        w2, scales["w2_scale"] = quantize_experts_fp8(w2.float(), "per_tensor")
    out = fused_moe(hidden, w13, w2, logits, top_k, renormalize, **scales, backend="triton")
    ref = fused_moe(hidden, w13, w2, logits, top_k, renormalize, **scales, backend="torch")
    assert out.shape == hidden.shape and out.dtype == torch.float16
    # fp32 accumulation in both; they differ in summation order, then in fp16 rounding of the SiLU·up
    # intermediate and of the output (2^-11 relative each).
    torch.testing.assert_close(out, ref, rtol=2e-3, atol=2e-3 * ref.abs().max().item())


def test_fp8_experts_stay_close_to_fp16_experts(fp8_cast):
    w13, w2 = _experts(8, seed=2)
    hidden = torch.randn(9, H).half()
    logits = torch.randn(9, 8)
    exact = fused_moe(hidden, w13, w2, logits, 2, True, "sigmoid", backend="torch").float()
    q13, s13 = quantize_experts_fp8(w13.float())
    q2, s2 = quantize_experts_fp8(w2.float())
    out = fused_moe(hidden, q13, q2, logits, 2, True, "sigmoid", w13_scale=s13, w2_scale=s2, backend="triton")
    # e4m3 weights and activations through two GEMMs: measured ~6% relative error on random data.
    assert ((out.float() - exact).norm() / exact.norm()).item() < 0.1


def test_identical_experts_reproduce_the_dense_mlp():
    """A dense model 'upcycled' into identical experts: any routing, renormalised, gives the dense MLP."""
    torch.manual_seed(3)
    w13, w2 = _experts(1, seed=3)
    hidden = torch.randn(6, H).half()
    dense_in = hidden.float() @ w13[0].float().t()
    dense = ((F.silu(dense_in[:, :INTER]) * dense_in[:, INTER:]).half().float() @ w2[0].float().t()).half()
    num_experts = 4
    logits = torch.randn(6, num_experts)
    out = fused_moe(
        hidden,
        w13.expand(num_experts, -1, -1),
        w2.expand(num_experts, -1, -1),
        logits,
        2,
        True,
        backend="triton",
    )
    torch.testing.assert_close(out, dense, rtol=2e-3, atol=2e-3 * dense.abs().max().item())


def test_experts_with_explicit_routing_and_empty_batch():
    w13, w2 = _experts(4)
    hidden = torch.randn(3, H).half()
    topk_ids = torch.tensor([[3, 3], [0, 3], [3, 0]], dtype=torch.int32)  # one expert takes most rows
    topk_weights = torch.tensor([[0.5, 0.5], [0.9, 0.1], [1.0, 0.0]])
    out = fused_experts(hidden, w13, w2, topk_weights, topk_ids)
    ref = fused_experts_ref(hidden, w13, w2, topk_weights, topk_ids)
    torch.testing.assert_close(out, ref, rtol=2e-3, atol=2e-3 * ref.abs().max().item())
    empty = fused_experts(hidden[:0], w13, w2, topk_weights[:0], topk_ids[:0])
    assert empty.shape == (0, H)


def test_invalid_inputs_are_rejected():
    w13, w2 = _experts(4)
    hidden = torch.randn(3, H).half()
    logits = torch.randn(3, 4)
    q13, s13 = quantize_experts_fp8(w13.float())
    q2, s2 = quantize_experts_fp8(w2.float())
    # Every case is a wrong value (ValueError) whose message starts with the offending argument's name.
    cases = {
        "top_k": lambda: fused_moe(hidden, w13, w2, logits, 5, True),
        "scoring": lambda: fused_moe(hidden, w13, w2, logits, 2, True, "relu"),
        "router_logits": lambda: fused_moe(hidden, w13, w2, logits[:, :3], 2, True),
        "w13": lambda: fused_moe(hidden, w13[:, :-1], w2, logits, 2, True),
        "w13_scale": lambda: fused_moe(hidden, q13, q2, logits, 2, True, w13_scale=s13[:, :3], w2_scale=s2),
        "backend": lambda: fused_moe(hidden, w13, w2, logits, 2, True, backend="cuda"),
        "mode": lambda: quantize_experts_fp8(w13.float(), "block"),
    }
    for param, call in cases.items():
        with pytest.raises(ValueError, match=rf"^{param}\b"):
            call()
    with pytest.raises(TypeError, match=r"^hidden"):
        fused_moe(hidden.int(), w13, w2, logits, 2, True)
    with pytest.raises(TypeError, match=r"^topk_ids"):
        moe_align_block_size(torch.zeros(3, 2), 4, 16)
