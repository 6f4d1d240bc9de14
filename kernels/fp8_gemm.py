"""FP8 GEMM: C = (A_q · s_a)(B_q · s_b)ᵀ + bias with e4m3 inputs and fp32 accumulation.

A is the activation [M, K], B the weight [N, K] (nn.Linear layout: K contiguous, the K-major operand the
Hopper fp8 tensor-core instruction wants). Scaling modes (scales follow fp8_quant's 2-D group convention):

    per_tensor   s_a [1, 1]              s_b [1, 1]
    per_channel  s_a [M, 1] or [1, 1]    s_b [N, 1] or [1, 1]      (dynamic per-token × per-channel)
    block        s_a [M, ceil(K/128)]    s_b [ceil(N/128), ceil(K/128)]   (DeepSeek-style 128×128)

Per-tensor and per-channel scales are constant along K, so they are applied once in the epilogue; block
scales change every 128 columns of K, so each K step's partial product is scaled before it is accumulated.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from tokenfleet.kernels._utils import interpreter_active
from tokenfleet.kernels.fp8_format import FP8_DTYPE, to_fp8
from tokenfleet.kernels.fp8_quant import (
    ACTIVATION_GROUPS,
    BLOCK,
    WEIGHT_GROUPS,
    dequantize_fp8,
    quantize_activation_fp8,
    quantize_fp8_ref,
)

SCALINGS = ("per_tensor", "per_channel", "block")
# Activation quantisation that pairs with each weight scaling in fp8_linear.
ACTIVATION_MODE = {"per_tensor": "per_tensor", "per_channel": "per_token", "block": "per_group"}
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _fp8_gemm_kernel(
    a_ptr,  # [M, K] fp8 e4m3, K contiguous
    b_ptr,  # [N, K] fp8 e4m3, K contiguous
    c_ptr,  # [M, N] bf16/fp16/fp32
    a_scale_ptr,  # [M | 1, 1] or [M, ceil(K/128)] fp32
    b_scale_ptr,  # [N | 1, 1] or [ceil(N/128), ceil(K/128)] fp32
    bias_ptr,  # [N] or a dummy when not HAS_BIAS
    M,
    N,
    K,
    stride_am,
    stride_bn,
    stride_cm,
    stride_asm,  # 0 when s_a is per-tensor
    stride_ask,
    stride_bsn,  # 0 when s_b is per-tensor
    stride_bsk,
    BLOCKWISE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,
    SCALE_BLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    # Grouped program order: GROUP_M row tiles share each column tile while it is hot in L2.
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    group_id = pid // (GROUP_M * num_pid_n)
    first_m = group_id * GROUP_M
    group_rows = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * num_pid_n)) % group_rows
    pid_n = (pid % (GROUP_M * num_pid_n)) // group_rows

    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_mask = rm < M
    n_mask = rn < N
    rm64 = rm.to(tl.int64)
    rn64 = rn.to(tl.int64)
    a_ptrs = a_ptr + rm64[:, None] * stride_am + rk[None, :]
    b_ptrs = b_ptr + rn64[None, :] * stride_bn + rk[:, None]

    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=m_mask[:, None], other=0.0)
            b = tl.load(b_ptrs, mask=n_mask[None, :], other=0.0)
        else:
            k_mask = (k0 + rk) < K
            a = tl.load(a_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if BLOCKWISE:
            kb = k0 // SCALE_BLOCK
            sa = tl.load(a_scale_ptr + rm64 * stride_asm + kb * stride_ask, mask=m_mask, other=0.0)
            sb = tl.load(
                b_scale_ptr + (rn64 // SCALE_BLOCK) * stride_bsn + kb * stride_bsk, mask=n_mask, other=0.0
            )
            acc += tl.dot(a, b) * sa[:, None] * sb[None, :]
        else:
            acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K

    if not BLOCKWISE:
        sa = tl.load(a_scale_ptr + rm64 * stride_asm, mask=m_mask, other=0.0)
        sb = tl.load(b_scale_ptr + rn64 * stride_bsn, mask=n_mask, other=0.0)
        acc = acc * sa[:, None] * sb[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn64, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    c_ptrs = c_ptr + rm64[:, None] * stride_cm + rn64[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@dataclass(frozen=True, slots=True)
class GemmConfig:
    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int


def pick_config(m: int, n: int, scaling: str) -> GemmConfig:
    """Tile sizes by M bucket (decode-sized M gets narrow row tiles, prefill gets 128-wide tensor-core tiles).

    A fixed table rather than autotuning: the first request must not pay a tuning sweep, and the
    interpreter accepts a single configuration only. BLOCK_K stays 128 so block scales change at most
    once per K step and the fp8 dot always has K >= 32.
    """
    if interpreter_active():
        # Few, large programs: the interpreter's cost is per program iteration, not per element.
        return GemmConfig(
            min(64, max(16, triton.next_power_of_2(m))),
            min(64, max(16, triton.next_power_of_2(n))),
            BLOCK,
            1,
            4,
            1,
        )
    if m <= 16:
        return GemmConfig(16, 64 if n >= 8192 else 32, BLOCK, 1, 4, 5)
    if m <= 64:
        return GemmConfig(64, 64, BLOCK, 4, 4, 4)
    if m <= 128 or scaling == "block":
        # Block scaling keeps a second [BM, BN] fp32 tile live (dot result before scaling): stay at 128.
        return GemmConfig(64 if m <= 128 else 128, 128, BLOCK, 8, 4 if m <= 128 else 8, 3)
    return GemmConfig(128, 256 if n >= 4096 else 128, BLOCK, 8, 8, 3)


def _check_scales(scaling: str, a_scale: torch.Tensor, b_scale: torch.Tensor, m: int, n: int, k: int) -> None:
    for name, s in (("a_scale", a_scale), ("b_scale", b_scale)):
        if s.dtype != torch.float32:
            raise TypeError(f"{name} must be a fp32 tensor, got {s.dtype}")
        if s.dim() != 2:
            raise ValueError(f"{name} must be 2-D, got shape {tuple(s.shape)}")
    kb = triton.cdiv(k, BLOCK)
    allowed = {
        "per_tensor": ({(1, 1)}, {(1, 1)}),
        "per_channel": ({(1, 1), (m, 1)}, {(1, 1), (n, 1)}),
        "block": ({(m, kb)}, {(triton.cdiv(n, BLOCK), kb)}),
    }[scaling]
    for name, s, ok in (("a_scale", a_scale, allowed[0]), ("b_scale", b_scale, allowed[1])):
        if tuple(s.shape) not in ok:
            raise ValueError(
                f"{name} must have shape {' or '.join(map(str, sorted(ok)))} for {scaling} scaling, "
                f"got {tuple(s.shape)}"
            )


def _check_operands(a: torch.Tensor, b: torch.Tensor) -> None:  # a [M, K] and b [N, K], fp8
    for name, t in (("a", a), ("b", b)):
        if t.dtype != FP8_DTYPE:
            raise TypeError(f"{name} must be {FP8_DTYPE}, got {t.dtype}")
        if t.dim() != 2:
            raise ValueError(f"{name} must be 2-D, got shape {tuple(t.shape)}")
        if t.shape[1] > 1 and t.stride(1) != 1:
            raise ValueError(f"{name} must be contiguous along K (stride {t.stride()})")
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"b {tuple(b.shape)} must be [N, K] with the K of a {tuple(a.shape)}")
    if a.device != b.device:
        raise ValueError(f"b is on {b.device}, a on {a.device}: they must share a device")


def _check_gemm(a, a_scale, b, b_scale, scaling: str) -> None:
    """What the kernel and its reference both require of their operands."""
    _check_scaling(scaling)
    _check_operands(a, b)
    _check_scales(scaling, a_scale, b_scale, a.shape[0], b.shape[0], a.shape[1])


def _check_scaling(scaling: str) -> None:
    if scaling not in SCALINGS:
        raise ValueError(f"scaling {scaling!r} is unknown; expected one of {SCALINGS}")


def fp8_gemm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    scaling: str,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Triton FP8 GEMM: returns (a·s_a)(b·s_b)ᵀ + bias as [M, N] `out_dtype`."""
    _check_gemm(a, a_scale, b, b_scale, scaling)
    if out_dtype not in OUT_DTYPES:
        raise TypeError(f"out_dtype must be one of {OUT_DTYPES}, got {out_dtype}")
    m, k = a.shape
    n = b.shape[0]
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != n or not bias.is_floating_point()):
        raise ValueError(f"bias must be a float [N={n}] vector, got {bias.dtype} {tuple(bias.shape)}")
    c = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if m == 0 or n == 0:
        return c
    if k == 0:
        return c.copy_(bias.expand(m, n)) if bias is not None else c.zero_()
    a_scale, b_scale = a_scale.contiguous(), b_scale.contiguous()
    cfg = pick_config(m, n, scaling)
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n),)
    _fp8_gemm_kernel[grid](
        a, b, c, a_scale, b_scale, bias if bias is not None else c,
        m, n, k, a.stride(0), b.stride(0), c.stride(0),
        a_scale.stride(0) if a_scale.shape[0] > 1 else 0, a_scale.stride(1),
        b_scale.stride(0) if b_scale.shape[0] > 1 else 0, b_scale.stride(1),
        BLOCKWISE=scaling == "block", HAS_BIAS=bias is not None, EVEN_K=k % cfg.block_k == 0,
        SCALE_BLOCK=BLOCK, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return c


def fp8_gemm_ref(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    scaling: str,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Torch reference: dequantise both operands to fp32, matmul, add bias, cast."""
    _check_gemm(a, a_scale, b, b_scale, scaling)
    if scaling == "block":
        a_f = dequantize_fp8(a, a_scale, ACTIVATION_GROUPS["per_group"])
        b_f = dequantize_fp8(b, b_scale, WEIGHT_GROUPS["block"])
    else:  # [M|1, 1] and [N|1, 1] scales broadcast along K as they are
        a_f, b_f = a.float() * a_scale, b.float() * b_scale
    c = a_f @ b_f.t()
    if bias is not None:
        c = c + bias.float()
    return c.to(out_dtype)


def _linear_triton(x2d, w, w_scale, scaling, bias, input_scale):
    x_q, x_scale = quantize_activation_fp8(
        x2d.contiguous(), ACTIVATION_MODE[scaling], static_scale=input_scale
    )
    return fp8_gemm(x_q, x_scale, w, w_scale, scaling, bias, out_dtype=x2d.dtype)


def _linear_torch(x2d, w, w_scale, scaling, bias, input_scale):
    if input_scale is not None:
        x_scale = input_scale.float().reshape(1, 1)
        x_q = to_fp8(x2d, x_scale)
    else:
        x_q, x_scale = quantize_fp8_ref(x2d, ACTIVATION_GROUPS[ACTIVATION_MODE[scaling]])
    return fp8_gemm_ref(x_q, x_scale, w, w_scale, scaling, bias, out_dtype=x2d.dtype)


LINEAR_BACKENDS = {"triton": _linear_triton, "torch": _linear_torch}


def fp8_linear(
    x: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    scaling: str,
    bias: torch.Tensor | None = None,
    input_scale: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """y = x · Wᵀ (+ bias) with an FP8 weight from `quantize_weight_fp8(W, scaling)`.

    Activations are quantised on the fly to match the weight's scheme (per-tensor — static when
    `input_scale` is given —, per-token, or per-128-group). Both backends quantise identically, so the
    torch path (CPU) and the Triton path (CUDA) agree up to fp32 summation order.
    """
    _check_scaling(scaling)
    if backend == "auto":
        backend = "triton" if x.is_cuda else "torch"
    if backend not in LINEAR_BACKENDS:
        raise ValueError(f"backend {backend!r} is unknown; expected {sorted(LINEAR_BACKENDS)} or 'auto'")
    if x.shape[-1] != w.shape[1]:
        raise ValueError(f"x has {x.shape[-1]} features but the weight expects {w.shape[1]}")
    x2d = x.reshape(-1, x.shape[-1])
    y = LINEAR_BACKENDS[backend](x2d, w, w_scale, scaling, bias, input_scale)
    return y.reshape(*x.shape[:-1], w.shape[0])
