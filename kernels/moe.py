"""Fused mixture-of-experts for SiLU-gated experts: gating -> align -> gate/up GEMM -> down GEMM -> combine.

    out[t] = Σ_j w[t, j] · W2[e_tj] · (silu(W1[e_tj] x_t) ⊙ W3[e_tj] x_t)

with w13 = [W1; W3] stacked per expert as [E, 2I, H] (gate rows first) and w2 [E, H, I]. The Triton path
runs two grouped GEMMs over the expert-sorted, block-padded assignments from moe_align: the first one
computes the gate and the up tiles of the same rows side by side and applies SiLU·up in its epilogue, so
the [T·top_k, 2I] pre-activation never reaches memory; the second applies the routing weight in its
epilogue. FP8 experts (e4m3 weights with a per-output-channel or per-expert scale) take activations
quantised per token, before each GEMM, by fp8_quant's kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from tokenfleet.kernels._utils import interpreter_active
from tokenfleet.kernels.fp8_format import FP8_DTYPE
from tokenfleet.kernels.fp8_quant import ACTIVATION_GROUPS, quantize_activation_fp8, quantize_fp8_ref
from tokenfleet.kernels.moe_align import MoEAlignment, moe_align_block_size
from tokenfleet.kernels.moe_gating import moe_gating, moe_gating_ref

EXPERT_FP8_MODES = ("per_channel", "per_tensor")


@triton.jit
def _moe_gemm_kernel(
    a_ptr,  # [rows_a, K]: tokens [T, K] (first GEMM) or assignments [T*top_k, K] (second); fp16/bf16/fp8
    b_ptr,  # [E, N_b, K] expert weights; N_b = 2N when GATED (gate rows [0, N), up rows [N, 2N))
    c_ptr,  # [T*top_k, N] output rows indexed by assignment
    a_scale_ptr,  # [rows_a, 1] fp32 per-token scales when FP8, else a dummy
    b_scale_ptr,  # [E, N_b] or [E, 1] fp32 when FP8, else a dummy
    topk_weights_ptr,  # [T*top_k] fp32
    sorted_ids_ptr,  # [max_padded] int32
    expert_ids_ptr,  # [max_padded // BLOCK_M] int32
    num_padded_ptr,  # [1] int32
    N,
    K,
    num_assignments,
    stride_am,
    stride_be,
    stride_bn,
    stride_cm,
    stride_bse,
    stride_bsn,  # 0 for a per-expert (per-tensor) weight scale
    A_ROW_DIV: tl.constexpr,  # top_k when A holds tokens, 1 when A holds assignments
    GATED: tl.constexpr,
    MUL_ROUTED_WEIGHT: tl.constexpr,
    FP8: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    # The grid covers the worst-case padding; blocks past the used rows have nothing to do.
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    if expert < 0:
        return
    ids = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_mask = ids < num_assignments
    a_rows = (ids // A_ROW_DIV).to(tl.int64)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rn < N
    rn64 = rn.to(tl.int64)
    rk = tl.arange(0, BLOCK_K)

    a_ptrs = a_ptr + a_rows[:, None] * stride_am + rk[None, :]
    g_ptrs = b_ptr + expert * stride_be + rn64[None, :] * stride_bn + rk[:, None]
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = (k0 + rk) < K
        a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        b_mask = k_mask[:, None] & n_mask[None, :]
        acc_g = tl.dot(a, tl.load(g_ptrs, mask=b_mask, other=0.0), acc_g)
        if GATED:
            acc_u = tl.dot(a, tl.load(g_ptrs + N * stride_bn, mask=b_mask, other=0.0), acc_u)
        a_ptrs += BLOCK_K
        g_ptrs += BLOCK_K

    if FP8:
        sa = tl.load(a_scale_ptr + a_rows, mask=row_mask, other=0.0)
        s_base = b_scale_ptr + expert * stride_bse
        acc_g = acc_g * sa[:, None] * tl.load(s_base + rn64 * stride_bsn, mask=n_mask, other=0.0)[None, :]
        if GATED:
            su = tl.load(s_base + (rn64 + N) * stride_bsn, mask=n_mask, other=0.0)
            acc_u = acc_u * sa[:, None] * su[None, :]
    out = acc_g * tl.sigmoid(acc_g) * acc_u if GATED else acc_g
    if MUL_ROUTED_WEIGHT:
        out = out * tl.load(topk_weights_ptr + ids, mask=row_mask, other=0.0)[:, None]
    c_ptrs = c_ptr + ids.to(tl.int64)[:, None] * stride_cm + rn64[None, :]
    tl.store(c_ptrs, out.to(c_ptr.dtype.element_ty), mask=row_mask[:, None] & n_mask[None, :])


@dataclass(frozen=True, slots=True)
class MoEGemmConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def pick_moe_config(num_assignments: int, num_experts: int, n: int, k: int, fp8: bool) -> MoEGemmConfig:
    """Row block sized to the expected rows per expert: small blocks waste less padding at decode."""
    block_k = min(128, max(32, triton.next_power_of_2(k)))
    if interpreter_active():
        return MoEGemmConfig(16, min(64, max(16, triton.next_power_of_2(n))), block_k, 4, 1)
    rows_per_expert = num_assignments / num_experts
    block_m = 16 if rows_per_expert <= 16 else (32 if rows_per_expert <= 64 else 64)
    return MoEGemmConfig(
        block_m, 64 if block_m < 64 else 128, 128 if fp8 else 64, 4, 4 if block_m < 64 else 3
    )


def _launch_gemm(
    a, a_scale, b, b_scale, c, topk_weights, align: MoEAlignment, cfg, *, a_row_div, gated, mul_w
):
    n = c.shape[1]
    k = a.shape[1]
    fp8 = b.dtype == FP8_DTYPE
    grid = (align.expert_ids.numel(), triton.cdiv(n, cfg.block_n))
    _moe_gemm_kernel[grid](
        a, b, c, a_scale if fp8 else a, b_scale if fp8 else b, topk_weights,
        align.sorted_ids, align.expert_ids, align.num_padded,
        n, k, align.num_assignments,
        a.stride(0), b.stride(0), b.stride(1), c.stride(0),
        b_scale.stride(0) if fp8 else 0, (b_scale.stride(1) if b_scale.shape[1] > 1 else 0) if fp8 else 0,
        A_ROW_DIV=a_row_div, GATED=gated, MUL_ROUTED_WEIGHT=mul_w, FP8=fp8,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip


def _check_experts(hidden, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale) -> None:
    if hidden.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"hidden must be a fp16/bf16/fp32 tensor, got {hidden.dtype}")
    if hidden.dim() != 2:
        raise ValueError(f"hidden must be [T, H], got shape {tuple(hidden.shape)}")
    if w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(
            f"w13 must be [E, 2I, H] and w2 [E, H, I], got {tuple(w13.shape)} / {tuple(w2.shape)}"
        )
    e, two_i, h = w13.shape
    if two_i % 2 or h != hidden.shape[1] or tuple(w2.shape) != (e, h, two_i // 2):
        raise ValueError(
            f"w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)} and hidden {tuple(hidden.shape)} disagree: "
            "expected w13 [E, 2I, H], w2 [E, H, I], hidden [T, H]"
        )
    fp8 = w13.dtype == FP8_DTYPE
    if w2.dtype != w13.dtype or (not fp8 and w13.dtype != hidden.dtype):
        raise TypeError(f"w13/w2 dtypes {w13.dtype}/{w2.dtype} do not match hidden {hidden.dtype}")
    for name, w, s in (("w13_scale", w13, w13_scale), ("w2_scale", w2, w2_scale)):
        if not fp8:
            if s is not None:
                raise ValueError(f"{name} is given for non-FP8 experts")
            continue
        if s is None or s.dtype != torch.float32 or tuple(s.shape) not in ((e, w.shape[1]), (e, 1)):
            raise ValueError(f"{name} must be a fp32 [E, N] or [E, 1] tensor for FP8 experts")
    for name, t in (("hidden", hidden), ("w13", w13), ("w2", w2)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous along its last dimension, strides {t.stride()}")
    if topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != hidden.shape[0]:
        raise ValueError(
            f"topk_ids {tuple(topk_ids.shape)} / topk_weights {tuple(topk_weights.shape)} must be [T, top_k]"
        )


def fused_experts(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton expert computation for given routing (topk_weights fp32 / topk_ids [T, top_k]) -> [T, H]."""
    _check_experts(hidden, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale)
    t, h = hidden.shape
    e, two_i, _ = w13.shape
    inter = two_i // 2
    top_k = topk_ids.shape[1]
    if t == 0:
        return torch.empty_like(hidden)
    fp8 = w13.dtype == FP8_DTYPE
    cfg1 = pick_moe_config(t * top_k, e, inter, h, fp8)
    cfg2 = pick_moe_config(t * top_k, e, h, inter, fp8)
    # Both GEMMs walk the same assignment order, so one alignment serves both when their row blocks agree.
    align1 = moe_align_block_size(topk_ids, e, cfg1.block_m)
    align2 = align1 if cfg2.block_m == cfg1.block_m else moe_align_block_size(topk_ids, e, cfg2.block_m)
    weights = topk_weights.reshape(-1).float().contiguous()

    a, a_scale = quantize_activation_fp8(hidden, "per_token") if fp8 else (hidden, None)
    act = torch.empty((t * top_k, inter), dtype=hidden.dtype, device=hidden.device)
    _launch_gemm(
        a, a_scale, w13, w13_scale, act, weights, align1, cfg1, a_row_div=top_k, gated=True, mul_w=False
    )
    a, a_scale = quantize_activation_fp8(act, "per_token") if fp8 else (act, None)
    # fp32 per-assignment outputs: the top_k partial results are summed once, at full precision.
    out = torch.empty((t * top_k, h), dtype=torch.float32, device=hidden.device)
    _launch_gemm(a, a_scale, w2, w2_scale, out, weights, align2, cfg2, a_row_div=1, gated=False, mul_w=True)
    return out.view(t, top_k, h).sum(dim=1).to(hidden.dtype)


def fused_experts_ref(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Torch reference looping over experts; FP8 experts quantise activations per token like the kernel."""
    _check_experts(hidden, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale)
    fp8 = w13.dtype == FP8_DTYPE
    inter = w13.shape[1] // 2
    per_token = ACTIVATION_GROUPS["per_token"]

    def activation(x: torch.Tensor) -> torch.Tensor:
        if not fp8:
            return x.float()
        q, s = quantize_fp8_ref(x, per_token)
        return q.float() * s

    def weight(w: torch.Tensor, s: torch.Tensor | None, e: int) -> torch.Tensor:
        return w[e].float() * s[e].unsqueeze(1) if fp8 else w[e].float()

    x = activation(hidden)
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    for e in range(w13.shape[0]):
        tok, slot = (topk_ids == e).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        gate_up = x[tok] @ weight(w13, w13_scale, e).t()
        # The kernel stores SiLU(gate)·up in the activation dtype before the down projection: so does this.
        act = (F.silu(gate_up[:, :inter]) * gate_up[:, inter:]).to(hidden.dtype)
        y = activation(act) @ weight(w2, w2_scale, e).t()
        out.index_add_(0, tok, y * topk_weights[tok, slot].float().unsqueeze(1))
    return out.to(hidden.dtype)


def quantize_experts_fp8(w: torch.Tensor, mode: str = "per_channel") -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise stacked expert weights [E, N, K] -> (e4m3 [E, N, K], scale fp32 [E, N] or [E, 1])."""
    if w.dim() != 3:
        raise ValueError(f"w (expert weights) must be [E, N, K], got {tuple(w.shape)}")
    if mode not in EXPERT_FP8_MODES:
        raise ValueError(f"mode {mode!r} is not an expert FP8 mode; expected {EXPERT_FP8_MODES}")
    e, n, k = w.shape
    if mode == "per_channel":
        q, s = quantize_fp8_ref(w.reshape(e * n, k), (1, -1))
        return q.view(e, n, k), s.view(e, n)
    pairs = [quantize_fp8_ref(w[i], (-1, -1)) for i in range(e)]
    return torch.stack([q for q, _ in pairs]), torch.cat([s for _, s in pairs]).view(e, 1)


EXPERT_BACKENDS = {"triton": fused_experts, "torch": fused_experts_ref}
GATING_BACKENDS = {"triton": moe_gating, "torch": moe_gating_ref}


def fused_moe(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    router_logits: torch.Tensor,
    top_k: int,
    renormalize: bool,
    scoring: str = "softmax",
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """The model's MoE entry point: [T, H] hidden states and [T, E] router logits -> [T, H].

    backend "auto" runs the Triton kernels on CUDA tensors and the torch reference elsewhere.
    """
    if backend == "auto":
        backend = "triton" if hidden.is_cuda else "torch"
    if backend not in EXPERT_BACKENDS:
        raise ValueError(f"backend {backend!r} is unknown; expected {sorted(EXPERT_BACKENDS)} or 'auto'")
    if router_logits.shape[0] != hidden.shape[0] or router_logits.shape[-1] != w13.shape[0]:
        raise ValueError(
            f"router_logits {tuple(router_logits.shape)} must be [T={hidden.shape[0]}, E={w13.shape[0]}]"
        )
    topk_weights, topk_ids = GATING_BACKENDS[backend](router_logits, top_k, renormalize, scoring)
    return EXPERT_BACKENDS[backend](hidden, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale)
