"""FP8 quantisation and GEMM kernels against their torch references.

On CPU these run under the Triton interpreter. Tests that quantise inside a kernel use the `fp8_cast`
fixture (tests/kernels/conftest.py), which gives the interpreter the GPU's saturating round-to-nearest-even
fp32 -> e4m3 conversion; its own drops the rounding carry and does not saturate. bf16 outputs are not checked
here because the interpreter's bf16 arithmetic is wrong; fp16 and fp32 outputs are, and the benchmark
checks bf16 against the reference on the GPU.
"""

from __future__ import annotations

import pytest
import torch
from tokenfleet.kernels.fp8_format import FP8_DTYPE, FP8_MAX, to_fp8
from tokenfleet.kernels.fp8_gemm import ACTIVATION_MODE, SCALINGS, fp8_gemm, fp8_gemm_ref, fp8_linear
from tokenfleet.kernels.fp8_quant import (
    ACTIVATION_GROUPS,
    WEIGHT_GROUPS,
    dequantize_fp8,
    expand_scale,
    quantize_activation_fp8,
    quantize_fp8_ref,
    quantize_weight_fp8,
)

# (M, N, K): M = 1 (decode), odd M, N and K that are not multiples of the tiles nor of the 128 scale block.
SHAPES = [(1, 80, 200), (37, 130, 300), (70, 48, 128)]


def _codes(q: torch.Tensor) -> torch.Tensor:
    return q.view(torch.uint8)


@pytest.mark.parametrize("mode", sorted(ACTIVATION_GROUPS))
@pytest.mark.parametrize(
    ("shape", "dtype"), [((1, 40), torch.float32), ((37, 300), torch.float16), ((5, 128), torch.float32)]
)
def test_activation_quantisation_is_bit_exact(fp8_cast, shape, dtype, mode):
    torch.manual_seed(1)
    x = (torch.randn(shape) * 3).to(dtype)
    x[0, 0] = 300.0  # an outlier that sets its group's scale
    if shape[0] > 1:
        x[-1] = 0.0  # an all-zero row: scale stays finite, codes stay 0
    q, scale = quantize_activation_fp8(x, mode)
    q_ref, scale_ref = quantize_fp8_ref(x, ACTIVATION_GROUPS[mode])
    assert q.dtype == FP8_DTYPE and scale.dtype == torch.float32
    assert torch.equal(scale, scale_ref)
    assert torch.equal(_codes(q), _codes(q_ref))
    # The group holding the outlier maps it to exactly ±448, the largest e4m3 code.
    assert q[0, 0].float().item() == FP8_MAX


def test_static_scale_saturates_instead_of_overflowing(fp8_cast):
    x = torch.tensor([[1000.0, -1000.0, 3.0, 0.0] * 8])
    q, scale = quantize_activation_fp8(x, "per_tensor", static_scale=torch.tensor(0.5))
    assert scale.item() == 0.5
    assert q.float()[0, :4].tolist() == [FP8_MAX, -FP8_MAX, 6.0, 0.0]


@pytest.mark.parametrize("mode", ["per_tensor", "per_channel", "block"])
def test_weight_quantisation_error_is_within_half_an_e4m3_step(mode):
    torch.manual_seed(2)
    w = torch.randn(200, 300) * torch.logspace(-3, 1, 200).unsqueeze(1)  # rows of very different magnitude
    q, scale = quantize_weight_fp8(w, mode)
    expected_shape = {"per_tensor": (1, 1), "per_channel": (200, 1), "block": (2, 3)}[mode]
    assert tuple(scale.shape) == expected_shape
    s = expand_scale(scale, (200, 300), WEIGHT_GROUPS[mode])
    err = (dequantize_fp8(q, scale, WEIGHT_GROUPS[mode]) - w).abs()
    # e4m3 keeps 3 mantissa bits: round-to-nearest is off by at most 2^-4 relative in the normal range and
    # half the subnormal step (2^-10 in units of the scale) below it.
    assert torch.all(err <= w.abs() * 2**-4 + s * 2**-10 + 1e-12)


def _quantised_operands(m, n, k, scaling, seed=0):
    torch.manual_seed(seed)
    a = torch.randn(m, k)
    # Weight blocks of very different magnitude: a scale applied to the wrong block shows at once.
    w = torch.randn(n, k) * torch.logspace(-2, 1, n).unsqueeze(1)
    a_q, a_scale = quantize_fp8_ref(a, ACTIVATION_GROUPS[ACTIVATION_MODE[scaling]])
    w_q, w_scale = quantize_weight_fp8(w, scaling)
    return a, w, a_q, a_scale, w_q, w_scale


@pytest.mark.parametrize(("out_dtype", "with_bias"), [(torch.float32, False), (torch.float16, True)])
@pytest.mark.parametrize("scaling", SCALINGS)
@pytest.mark.parametrize("shape", SHAPES)
def test_fp8_gemm_matches_reference(shape, scaling, out_dtype, with_bias):
    m, n, k = shape
    _, _, a_q, a_scale, w_q, w_scale = _quantised_operands(m, n, k, scaling)
    bias = torch.randn(n) if with_bias else None
    out = fp8_gemm(a_q, a_scale, w_q, w_scale, scaling, bias=bias, out_dtype=out_dtype)
    ref = fp8_gemm_ref(a_q, a_scale, w_q, w_scale, scaling, bias=bias, out_dtype=torch.float32)
    assert out.shape == (m, n) and out.dtype == out_dtype
    # Same products, different fp32 summation order: fp32 agrees to ~1e-6 relative; fp16 adds its own
    # output rounding (2^-11 relative).
    tol = {torch.float32: 1e-5, torch.float16: 1e-3}[out_dtype]
    torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol * ref.abs().max().item())


def test_per_token_scales_with_per_tensor_activation_broadcast():
    # per_channel mode also takes a single static activation scale ([1, 1]) with per-channel weights.
    _, _, _, _, w_q, w_scale = _quantised_operands(9, 64, 96, "per_channel")
    a = torch.randn(9, 96)
    a_scale = torch.tensor([[0.02]])
    a_q = to_fp8(a, a_scale)
    out = fp8_gemm(a_q, a_scale, w_q, w_scale, "per_channel", out_dtype=torch.float32)
    ref = fp8_gemm_ref(a_q, a_scale, w_q, w_scale, "per_channel", out_dtype=torch.float32)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


@pytest.mark.parametrize("scaling", SCALINGS)
def test_fp8_linear_end_to_end(fp8_cast, scaling):
    """In-kernel activation quantisation + GEMM: equal to the torch backend, close to full precision."""
    torch.manual_seed(3)
    x = torch.randn(2, 5, 160, dtype=torch.float16)
    w = torch.randn(96, 160) * 0.05
    bias = torch.randn(96, dtype=torch.float16)
    w_q, w_scale = quantize_weight_fp8(w, scaling)
    y = fp8_linear(x, w_q, w_scale, scaling, bias=bias, backend="triton")
    y_torch = fp8_linear(x, w_q, w_scale, scaling, bias=bias, backend="torch")
    assert y.shape == (2, 5, 96) and y.dtype == torch.float16
    torch.testing.assert_close(y, y_torch, rtol=1e-3, atol=1e-3)
    exact = x.float() @ w.t() + bias.float()
    # e4m3 on both operands: ~3% relative error over a dot product of random data (measured ~0.03).
    assert ((y.float() - exact).norm() / exact.norm()).item() < 0.05


def test_empty_batch_returns_empty_output():
    _, _, _, _, w_q, w_scale = _quantised_operands(1, 32, 64, "per_channel")
    a_q = torch.empty(0, 64, dtype=FP8_DTYPE)
    out = fp8_gemm(a_q, torch.ones(1, 1), w_q, w_scale, "per_channel", out_dtype=torch.float16)
    assert out.shape == (0, 32)


def test_launcher_rejects_bad_inputs_naming_them():
    _, _, a_q, a_scale, w_q, w_scale = _quantised_operands(4, 32, 64, "per_channel")
    # argument -> (error type, call): wrong types and dtypes are TypeErrors, wrong values ValueErrors, and
    # the message starts with the argument's name.
    cases = {
        "a": (TypeError, lambda: fp8_gemm(a_q.float(), a_scale, w_q, w_scale, "per_channel")),
        "b": (ValueError, lambda: fp8_gemm(a_q, a_scale, w_q[:, :32], w_scale, "per_channel")),
        "b_scale": (ValueError, lambda: fp8_gemm(a_q, a_scale, w_q, w_scale[:5], "per_channel")),
        "a_scale": (ValueError, lambda: fp8_gemm(a_q, torch.ones(4, 3), w_q, torch.ones(1, 1), "block")),
        "out_dtype": (
            TypeError,
            lambda: fp8_gemm(a_q, a_scale, w_q, w_scale, "per_channel", out_dtype=torch.int8),
        ),
        "scaling": (ValueError, lambda: fp8_gemm(a_q, a_scale, w_q, w_scale, "per_row")),
        "bias": (
            ValueError,
            lambda: fp8_gemm(a_q, a_scale, w_q, w_scale, "per_channel", bias=torch.zeros(31)),
        ),
        "x": (TypeError, lambda: quantize_activation_fp8(torch.zeros(4, 8, dtype=torch.int32), "per_token")),
        "mode": (ValueError, lambda: quantize_weight_fp8(w_q.float(), "per_row")),
    }
    for param, (error, call) in cases.items():
        with pytest.raises(error, match=rf"^{param}\b"):
            call()
    with pytest.raises(ValueError, match="contiguous along K"):
        fp8_gemm(a_q, a_scale, w_q.t().contiguous().t(), w_scale, "per_channel")
