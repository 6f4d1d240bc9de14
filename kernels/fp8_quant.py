"""FP8 (e4m3) quantisation: scale layout, torch references, and the Triton activation-quantisation kernels.

Every scale is a 2-D fp32 tensor with one entry per *group* of the quantised 2-D tensor; a group shape
``(rows, cols)`` uses ``-1`` for "the whole dimension". The same convention serves weights and activations:

    per-tensor          (-1, -1)   scale [1, 1]
    per-token / -channel (1, -1)   scale [rows, 1]
    per-token-group      (1, 128)  scale [rows, ceil(cols / 128)]   (activations of block-wise FP8)
    block                (128, 128) scale [ceil(rows / 128), ceil(cols / 128)]   (weights of block-wise FP8)

so the GEMM, the MoE kernels and the loader never need a mode-specific scale shape. The quantisation rule is
``scale = max(amax, MIN_AMAX) / 448`` and ``q = saturate(x / scale)`` with round-to-nearest-even, matching
what the GPU's ``cvt.rn.satfinite`` does; the division is the IEEE one (``tl.div_rn``) so the kernel and
the torch reference produce bit-identical codes.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from tokenfleet.kernels._utils import interpreter_active
from tokenfleet.kernels.fp8_format import FP8_DTYPE, FP8_MAX, to_fp8

# An all-zero group would give scale 0 and 0/0 = NaN codes; this floor keeps the codes 0 and the scale finite.
MIN_AMAX = 1e-12
BLOCK = 128

GroupShape = tuple[int, int]
WEIGHT_GROUPS: dict[str, GroupShape] = {
    "per_tensor": (-1, -1),
    "per_channel": (1, -1),
    "block": (BLOCK, BLOCK),
}
ACTIVATION_GROUPS: dict[str, GroupShape] = {
    "per_tensor": (-1, -1),
    "per_token": (1, -1),
    "per_group": (1, BLOCK),
}


def resolve_group(shape: tuple[int, int], group: GroupShape) -> GroupShape:
    """Replace -1 (whole dimension) by the dimension's size; keep at least 1 so empty tensors work."""
    return (
        max(shape[0], 1) if group[0] == -1 else group[0],
        max(shape[1], 1) if group[1] == -1 else group[1],
    )


def scale_shape(shape: tuple[int, int], group: GroupShape) -> tuple[int, int]:
    gr, gc = resolve_group(shape, group)
    return (math.ceil(shape[0] / gr), math.ceil(shape[1] / gc))


def expand_scale(scale: torch.Tensor, shape: tuple[int, int], group: GroupShape) -> torch.Tensor:
    """Broadcast a [groups_r, groups_c] scale to one value per element of a `shape` tensor."""
    gr, gc = resolve_group(shape, group)
    return scale.repeat_interleave(gr, 0)[: shape[0]].repeat_interleave(gc, 1)[:, : shape[1]]


def quantize_fp8_ref(x: torch.Tensor, group: GroupShape) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference: quantise a 2-D tensor group-wise; returns (codes fp8 [M, K], scale fp32 2-D)."""
    if x.dim() != 2:
        raise ValueError(f"x must be a 2-D tensor, got shape {tuple(x.shape)}")
    rows, cols = x.shape
    gr, gc = resolve_group((rows, cols), group)
    sr, sc = scale_shape((rows, cols), group)
    xf = x.float()
    padded = torch.zeros(sr * gr, sc * gc, dtype=torch.float32, device=x.device)
    padded[:rows, :cols] = xf.abs()
    amax = padded.view(sr, gr, sc, gc).amax(dim=(1, 3))
    scale = amax.clamp(min=MIN_AMAX) / FP8_MAX
    q = to_fp8(xf, expand_scale(scale, (rows, cols), group))
    return q, scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, group: GroupShape) -> torch.Tensor:
    """fp8 codes [M, K] times their group scales, in fp32."""
    return q.float() * expand_scale(scale, tuple(q.shape), group)


def quantize_weight_fp8(w: torch.Tensor, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise a linear weight [N, K] at load time; `mode` is a key of WEIGHT_GROUPS.

    Runs once per weight, on whatever device the weight is on, so it is plain torch (no kernel needed).
    """
    if mode not in WEIGHT_GROUPS:
        raise ValueError(f"mode {mode!r} is not an FP8 weight mode; expected one of {sorted(WEIGHT_GROUPS)}")
    return quantize_fp8_ref(w, WEIGHT_GROUPS[mode])


@triton.jit
def _amax_kernel(
    x_ptr,  # [M, K] fp32/fp16/bf16
    amax_ptr,  # [1] fp32, zero-initialised; receives max |x|
    M,
    K,
    stride_xm,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (rows[:, None] < M) & (cols[None, :] < K)
    x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xm + cols[None, :], mask=mask, other=0.0)
    # |x| >= 0, so the float atomic max orders like the integer one and the zero-initialised cell is neutral.
    tl.atomic_max(amax_ptr, tl.max(tl.max(tl.abs(x.to(tl.float32)), axis=1), axis=0))


@triton.jit
def _quant_fp8_kernel(
    x_ptr,  # [M, K] fp32/fp16/bf16
    q_ptr,  # [M, K] fp8 e4m3 (output)
    scale_ptr,  # [M, num_groups] fp32 (output), or [1, 1] input when STATIC_SCALE
    M,
    K,
    group_size,  # columns per scale; K for per-token
    stride_xm,
    stride_qm,
    stride_sm,
    STATIC_SCALE: tl.constexpr,
    FP8_MAX_C: tl.constexpr,
    MIN_AMAX_C: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_g = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < M
    rows64 = rows.to(tl.int64)
    k_start = pid_g * group_size
    offs = tl.arange(0, BLOCK_K)
    if STATIC_SCALE:
        scale = tl.zeros([BLOCK_M], dtype=tl.float32) + tl.load(scale_ptr)
    else:
        amax = tl.zeros([BLOCK_M], dtype=tl.float32)
        for kk in range(0, group_size, BLOCK_K):
            cols = k_start + kk + offs
            mask = row_mask[:, None] & (cols[None, :] < K) & ((kk + offs)[None, :] < group_size)
            x = tl.load(x_ptr + rows64[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0)
            amax = tl.maximum(amax, tl.max(tl.abs(x.to(tl.float32)), axis=1))
        scale = tl.maximum(amax, MIN_AMAX_C) / FP8_MAX_C
        tl.store(scale_ptr + rows64 * stride_sm + pid_g, scale, mask=row_mask)
    for kk in range(0, group_size, BLOCK_K):
        cols = k_start + kk + offs
        mask = row_mask[:, None] & (cols[None, :] < K) & ((kk + offs)[None, :] < group_size)
        x = tl.load(x_ptr + rows64[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        y = tl.div_rn(x, scale[:, None])
        # Saturate explicitly: the conversion instruction saturates on GPUs that have it, but the
        # clamp makes the contract independent of the target.
        y = tl.minimum(tl.maximum(y, -FP8_MAX_C), FP8_MAX_C)
        tl.store(q_ptr + rows64[:, None] * stride_qm + cols[None, :], y.to(q_ptr.dtype.element_ty), mask=mask)


def _check_activation(x: torch.Tensor) -> None:
    if x.dim() != 2:
        raise ValueError(f"x (activation) must be 2-D [tokens, features], got {tuple(x.shape)}")
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"x (activation) dtype must be fp32/fp16/bf16, got {x.dtype}")
    if x.shape[1] > 1 and x.stride(1) != 1:
        raise ValueError(f"x (activation) must be contiguous along its last dimension, strides {x.stride()}")


def quantize_activation_fp8(
    x: torch.Tensor, mode: str, static_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton activation quantisation: amax -> scale -> saturating cast, one pass per group.

    `mode` is a key of ACTIVATION_GROUPS. With `static_scale` (a calibrated per-tensor [1, 1] scale, only
    for "per_tensor") no amax is computed. Returns (codes fp8 [M, K], scale fp32 2-D).
    """
    _check_activation(x)
    if mode not in ACTIVATION_GROUPS:
        raise ValueError(f"mode {mode!r} is not an activation mode; expected {sorted(ACTIVATION_GROUPS)}")
    if static_scale is not None and mode != "per_tensor":
        raise ValueError(f"static_scale is per-tensor only, got mode {mode!r}")
    m, k = x.shape
    q = torch.empty((m, k), dtype=FP8_DTYPE, device=x.device)
    block_k = min(BLOCK, triton.next_power_of_2(max(k, 16)))
    if mode == "per_tensor":
        if static_scale is None:
            amax = torch.zeros(1, dtype=torch.float32, device=x.device)
            if m and k:
                grid = (triton.cdiv(m, 16), triton.cdiv(k, block_k))
                _amax_kernel[grid](x, amax, m, k, x.stride(0), BLOCK_M=16, BLOCK_K=block_k)
            scale = (amax.clamp(min=MIN_AMAX) / FP8_MAX).view(1, 1)
        else:
            scale = static_scale.to(device=x.device, dtype=torch.float32).reshape(1, 1)
        # With the scale known, every row is independent: treat the tensor as one group of K columns.
        block_m = 64 if interpreter_active() else 16
        if m and k:
            grid = (triton.cdiv(m, block_m), 1)
            _quant_fp8_kernel[grid](
                x, q, scale, m, k, k, x.stride(0), q.stride(0), 0,
                STATIC_SCALE=True, FP8_MAX_C=FP8_MAX, MIN_AMAX_C=MIN_AMAX, BLOCK_M=block_m, BLOCK_K=block_k,
            )  # fmt: skip
        return q, scale
    group_size = k if mode == "per_token" else BLOCK
    num_groups = triton.cdiv(k, group_size) if k else 1
    scale = torch.empty((m, num_groups), dtype=torch.float32, device=x.device)
    # Small row blocks spread decode-sized batches over more SMs; the interpreter prefers few programs.
    block_m = 64 if interpreter_active() else (4 if m <= 64 else 16)
    if m and k:
        grid = (triton.cdiv(m, block_m), num_groups)
        _quant_fp8_kernel[grid](
            x, q, scale, m, k, group_size, x.stride(0), q.stride(0), scale.stride(0),
            STATIC_SCALE=False, FP8_MAX_C=FP8_MAX, MIN_AMAX_C=MIN_AMAX, BLOCK_M=block_m, BLOCK_K=block_k,
        )  # fmt: skip
    return q, scale
