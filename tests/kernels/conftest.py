"""Kernel test setup: an honest fix for the Triton interpreter's fp32 -> fp8 cast.

The interpreter converts floats to fp8 bit by bit and drops the rounding carry into the exponent and does
not saturate (a fix is open upstream), so a kernel that quantises in-kernel would produce codes
no GPU produces. The `fp8_cast` fixture replaces only that conversion, for the duration of one test, with
torch's round-to-nearest-even conversion after saturation to ±448 — what `cvt.rn.satfinite` does on
Hopper/Ada. The kernels under test are untouched; on a GPU (no interpreter) the fixture does nothing.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tokenfleet.kernels._utils import interpreter_active
from tokenfleet.kernels.fp8_format import FP8_DTYPE, FP8_MAX


@pytest.fixture
def fp8_cast(monkeypatch: pytest.MonkeyPatch) -> None:
    if not interpreter_active():
        return
    import triton.language as tl
    from triton.runtime import interpreter

    original = interpreter.InterpreterBuilder.create_fp_to_fp

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        src_ty = src.dtype.scalar
        if dst_type.scalar != tl.float8e4nv or src_ty not in (tl.float32, tl.float16):
            return original(self, src, dst_type, rounding_mode)
        data = np.clip(src.data.astype(np.float32), -FP8_MAX, FP8_MAX)
        codes = torch.from_numpy(np.ascontiguousarray(data)).to(FP8_DTYPE).view(torch.uint8)
        return interpreter.TensorHandle(codes.numpy().reshape(src.data.shape), dst_type.scalar)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_fp_to_fp", create_fp_to_fp)
