"""Kernel test setup: an honest fix for the Triton interpreter's fp32 -> fp8 cast.

The interpreter converts floats to fp8 bit by bit and drops the rounding carry into the exponent and does
not saturate (a fix is open upstream), so a kernel that quantises in-kernel would produce codes
no GPU produces. The `fp8_cast` fixture replaces only that conversion, for the duration of one test, with
torch's round-to-nearest-even conversion after saturation to ±448 — what `cvt.rn.satfinite` does on
Hopper/Ada. The kernels under test are untouched; on a GPU (no interpreter) the fixture does nothing.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

FP8_E4M3_MAX = 448.0


@pytest.fixture
def fp8_cast(monkeypatch: pytest.MonkeyPatch) -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    import triton.language as tl
    from triton.runtime import interpreter

    original = interpreter.InterpreterBuilder.create_fp_to_fp

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        src_ty = src.dtype.scalar
        if dst_type.scalar != tl.float8e4nv or src_ty not in (tl.float32, tl.float16):
            return original(self, src, dst_type, rounding_mode)
        data = np.clip(src.data.astype(np.float32), -FP8_E4M3_MAX, FP8_E4M3_MAX)
        codes = torch.from_numpy(np.ascontiguousarray(data)).to(torch.float8_e4m3fn).view(torch.uint8)
        return interpreter.TensorHandle(codes.numpy().reshape(src.data.shape), dst_type.scalar)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_fp_to_fp", create_fp_to_fp)
