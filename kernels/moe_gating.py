"""Fused MoE gating: router logits -> scores (softmax or sigmoid) -> top-k experts -> optional renormalisation.

Experts are *selected* on the raw logits, not on the scores: both score functions are monotonic, so the
choice is the same, but comparisons of the exact inputs cannot be flipped by a last-bit difference
between the kernel's and torch's exp. Ties go to the lowest expert index, in the kernel and in the
reference alike, so routing is deterministic across backends and batch compositions.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from tokenfleet.kernels._utils import interpreter_active

SCORINGS = ("softmax", "sigmoid")


@triton.jit
def _moe_gating_kernel(
    logits_ptr,  # [T, E] fp32/fp16/bf16
    weights_ptr,  # [T, TOP_K] fp32 (output)
    ids_ptr,  # [T, TOP_K] int32 (output)
    T,
    E,
    stride_lt,
    stride_wt,
    stride_it,
    TOP_K: tl.constexpr,
    SOFTMAX: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    row_mask = rows < T
    valid = row_mask[:, None] & (cols[None, :] < E)
    rows64 = rows.to(tl.int64)
    x = tl.load(logits_ptr + rows64[:, None] * stride_lt + cols[None, :], mask=valid, other=float("-inf"))
    x = x.to(tl.float32)
    if SOFTMAX:
        # Rows past T are all -inf: give them a finite max and a unit sum so they stay NaN-free.
        row_max = tl.where(row_mask, tl.max(x, axis=1), 0.0)
        p = tl.where(valid, tl.exp(x - row_max[:, None]), 0.0)
        scores = p / tl.where(row_mask, tl.sum(p, axis=1), 1.0)[:, None]
    else:
        scores = tl.sigmoid(x)

    slots = tl.arange(0, BLOCK_K)
    top_w = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.float32)
    top_i = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.int32)
    remaining = x
    for j in tl.static_range(TOP_K):
        best = tl.max(remaining, axis=1)
        # Lowest index among the maxima: the deterministic tie-break.
        idx = tl.min(tl.where(remaining == best[:, None], cols[None, :], BLOCK_E), axis=1)
        hit = cols[None, :] == idx[:, None]
        w = tl.sum(tl.where(hit, scores, 0.0), axis=1)
        top_w = tl.where(slots[None, :] == j, w[:, None], top_w)
        top_i = tl.where(slots[None, :] == j, idx[:, None], top_i)
        remaining = tl.where(hit, float("-inf"), remaining)
    if RENORMALIZE:
        top_w = top_w / tl.where(row_mask, tl.sum(top_w, axis=1), 1.0)[:, None]
    out_mask = row_mask[:, None] & (slots[None, :] < TOP_K)
    tl.store(weights_ptr + rows64[:, None] * stride_wt + slots[None, :], top_w, mask=out_mask)
    tl.store(ids_ptr + rows64[:, None] * stride_it + slots[None, :], top_i, mask=out_mask)


def _check(router_logits: torch.Tensor, top_k: int, scoring: str) -> None:
    if router_logits.dim() != 2 or not router_logits.is_floating_point():
        raise TypeError(
            f"router_logits must be a float [tokens, experts] tensor, got {router_logits.dtype} "
            f"{tuple(router_logits.shape)}"
        )
    if not 1 <= top_k <= router_logits.shape[1]:
        raise ValueError(f"top_k={top_k} must be in [1, num_experts={router_logits.shape[1]}]")
    if scoring not in SCORINGS:
        raise ValueError(f"scoring {scoring!r} is unknown; expected one of {SCORINGS}")


def moe_gating(
    router_logits: torch.Tensor, top_k: int, renormalize: bool, scoring: str = "softmax"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton gating: returns (topk_weights fp32 [T, top_k], topk_ids int32 [T, top_k]), best expert first."""
    _check(router_logits, top_k, scoring)
    t, e = router_logits.shape
    weights = torch.empty((t, top_k), dtype=torch.float32, device=router_logits.device)
    ids = torch.empty((t, top_k), dtype=torch.int32, device=router_logits.device)
    if t == 0:
        return weights, ids
    logits = router_logits if router_logits.stride(1) == 1 else router_logits.contiguous()
    block_e = triton.next_power_of_2(e)
    # One row per warp-sized slice of the tile on GPU; the interpreter prefers a single program.
    block_t = min(triton.next_power_of_2(t), 64 if interpreter_active() else max(1, 4096 // block_e))
    _moe_gating_kernel[(triton.cdiv(t, block_t),)](
        logits, weights, ids, t, e, logits.stride(0), weights.stride(0), ids.stride(0),
        TOP_K=top_k, SOFTMAX=scoring == "softmax", RENORMALIZE=renormalize,
        BLOCK_T=block_t, BLOCK_E=block_e, BLOCK_K=triton.next_power_of_2(top_k),
    )  # fmt: skip
    return weights, ids


def moe_gating_ref(
    router_logits: torch.Tensor, top_k: int, renormalize: bool, scoring: str = "softmax"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference with the same selection rule (raw logits, stable sort: lowest index wins ties)."""
    _check(router_logits, top_k, scoring)
    logits = router_logits.float()
    scores = torch.softmax(logits, dim=-1) if scoring == "softmax" else torch.sigmoid(logits)
    ids = torch.sort(logits, dim=-1, descending=True, stable=True).indices[:, :top_k]
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)
