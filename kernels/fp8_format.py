"""The FP8 format of tokenfleet's weights, activations and KV cache: e4m3 without infinities.

One definition for the Triton kernels, their torch references and the torch attention backend, so a cache
written by one path is read identically by the other. e4m3fn is Triton's float8e4nv, the format Hopper and
Ada convert natively; its largest finite value is where every quantising cast saturates (the GPU's
`cvt.rn.satfinite`). This module needs only torch: the CPU serving path imports it without Triton.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448.0


def to_fp8(x: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """Codes of x / scale: divided in fp32, saturated to ±FP8_MAX, rounded to nearest even — the torch
    twin of the kernels' saturating cast (the plain cast would turn out-of-range values into NaN)."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
