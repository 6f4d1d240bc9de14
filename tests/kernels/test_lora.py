"""Multi-LoRA shrink/expand kernels against their torch references and a per-token loop.

On CPU the Triton kernels run under the interpreter, in fp16 (its bf16 arithmetic is wrong) and fp32; on a
GPU bf16 joins them. Sizes are not multiples of any tile (K=48, N=40), and the slot maps cover a prefill's
single segment, decode's one-token segments, runs without an adapter (-1) and steps without any adapter.
"""

from __future__ import annotations

import pytest
import torch
from tokenfleet.kernels import lora
from tokenfleet.kernels.lora import (
    SEGMENTED_MIN_SEG_LEN,
    LoRABatch,
    lora_expand,
    lora_expand_ref,
    lora_shrink,
    lora_shrink_ref,
    make_lora_batch,
    make_lora_batch_from_runs,
    pick_kernel_shape,
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float16, torch.float32] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])
K, N, S = 48, 40, 5  # S: the stacks hold one slot no batch below uses

MIXED = [0] * 5 + [-1] * 3 + [2] * 17 + [1] + [-1] + [0] * 2 + [4] * 4
DECODE = [3, 0, -1, 1, 1, 2, 0, -1, 3, 2, 0, 1]
# name -> (slot of each token, rank)
CASES = {
    "prefill": ([2] * 21, 16),
    "t1": ([1], 4),
    "t1_no_adapter": ([-1], 8),
    "mixed": (MIXED, 8),
    "decode": (DECODE, 4),
    "no_adapter": ([-1] * 7, 16),
    "one_adapter_and_none": ([-1] * 2 + [2] * 5 + [-1], 16),
}


def _tol(dtype: torch.dtype) -> dict[str, float]:
    # fp32 sums in every path, in different orders; a half-precision y then rounds once (a flip of the
    # last bit is 2^-11 relative in fp16, 2^-8 in bf16).
    return {
        torch.float32: {"rtol": 1e-5, "atol": 1e-5},
        torch.float16: {"rtol": 2e-3, "atol": 2e-3},
        torch.bfloat16: {"rtol": 1.6e-2, "atol": 1.6e-2},
    }[dtype]


def _operands(rank: int, dtype: torch.dtype, n: int = N, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(S, rank, K, generator=gen) / K**0.5
    b = torch.randn(S, n, rank, generator=gen) / rank**0.5
    scale = torch.rand(S, generator=gen) * 1.5 + 0.5
    return a.to(DEVICE, dtype), b.to(DEVICE, dtype), scale.to(DEVICE)


def _randn(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 1) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)


def _naive_shrink(x, a, slots):
    h = torch.zeros(len(slots), a.shape[1], device=x.device)
    for t, s in enumerate(slots):
        if s >= 0:
            h[t] = a[s].float() @ x[t].float()
    return h


def _naive_expand(h, b, scale, slots, y):
    out = y.clone()
    for t, s in enumerate(slots):
        if s >= 0:
            out[t] = (y[t].float() + scale[s] * (b[s].float() @ h[t])).to(y.dtype)
    return out


@pytest.fixture
def small_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tiles well below the sizes: several K, R and N steps and several row blocks per segment."""

    def pick(op, shape, max_seg_len, width, rank):
        return lora._Tiles(block_m=16, block_n=16, block_k=16, block_r=16 if shape == "segmented" else 8)

    monkeypatch.setattr(lora, "_pick_tiles", pick)


@pytest.fixture
def kernel_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    """Records (op, kernel shape) of every Triton launch."""
    calls: list[tuple[str, str]] = []
    shrink, expand = lora._shrink_triton, lora._expand_triton

    def spy_shrink(x, a, batch, shape):
        calls.append(("shrink", shape))
        return shrink(x, a, batch, shape)

    def spy_expand(h, b, scale, batch, y, shape):
        calls.append(("expand", shape))
        expand(h, b, scale, batch, y, shape)

    monkeypatch.setattr(lora, "_shrink_triton", spy_shrink)
    monkeypatch.setattr(lora, "_expand_triton", spy_expand)
    return calls


def _check_op_pair(slots, rank, dtype, shape):
    """Shrink and expand of one layer through the kernel, the reference and the per-token loop."""
    batch = make_lora_batch(slots, DEVICE)
    a, b, scale = _operands(rank, dtype)
    x = _randn(len(slots), K, dtype=dtype)
    idle = torch.tensor([s < 0 for s in slots], device=DEVICE)

    h = lora_shrink(x, a, batch, backend="triton", shape=shape)
    h_ref = lora_shrink_ref(x, a, batch)
    assert h.dtype == torch.float32 and h.shape == (len(slots), rank)
    torch.testing.assert_close(h, h_ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(h, _naive_shrink(x, a, slots), rtol=1e-4, atol=1e-5)
    assert torch.all(h[idle] == 0)

    y0 = _randn(len(slots), N, dtype=dtype, seed=2)
    y, y_ref = y0.clone(), y0.clone()
    lora_expand(h_ref, b, scale, batch, y, backend="triton", shape=shape)
    lora_expand_ref(h_ref, b, scale, batch, y_ref)
    expected = _naive_expand(h_ref, b, scale, slots, y0)
    torch.testing.assert_close(y, y_ref, **_tol(dtype))
    torch.testing.assert_close(y, expected, **_tol(dtype))
    torch.testing.assert_close(y_ref, expected, **_tol(dtype))
    # Rows without an adapter keep their bits, not just their value within tolerance.
    assert torch.equal(y[idle], y0[idle])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", lora.KERNEL_SHAPES)
@pytest.mark.parametrize("case", sorted(CASES))
def test_kernels_match_reference_and_per_token_loop(case, shape, dtype):
    slots, rank = CASES[case]
    _check_op_pair(slots, rank, dtype, shape)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("shape", lora.KERNEL_SHAPES)
@pytest.mark.parametrize(
    ("slots", "rank"), [(MIXED, 16), (DECODE, 8), ([3] * 20, 24)], ids=["mix", "dec", "pre"]
)
def test_kernels_with_small_tiles(small_tiles, slots, rank, shape, dtype):
    # 3 K steps (the last partial), 3 column blocks, 2 row blocks of a segment and 1-3 rank steps (the
    # segmented kernels' second one partial at R=24): every tile loop and mask of the kernels.
    _check_op_pair(slots, rank, dtype, shape)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("shape", lora.KERNEL_SHAPES)
def test_fused_projection_slices(shape, dtype):
    """One shrink with the slices' A stacked along the rank, one expand per column slice of the output."""
    slots, rank = MIXED, 8
    sizes = (40, 24, 24)  # q, k, v output columns
    num_tokens = len(slots)
    batch = make_lora_batch(slots, DEVICE)
    a = _operands(3 * rank, dtype)[0]
    bs = [_operands(rank, dtype, n=n, seed=i)[1] for i, n in enumerate(sizes)]
    scales = _randn(3, S, seed=3).abs() + 0.5
    # x itself a column slice (row stride > K) of a wider activation.
    x = _randn(num_tokens, K + 16, dtype=dtype)[:, 8 : 8 + K]
    out0 = _randn(num_tokens, sum(sizes), dtype=dtype, seed=4)

    h = lora_shrink(x, a, batch, backend="triton", shape=shape)
    torch.testing.assert_close(h, _naive_shrink(x, a, slots), rtol=1e-4, atol=1e-5)

    out, out_ref = out0.clone(), out0.clone()
    expected = out0.clone()
    start = 0
    for i, n in enumerate(sizes):
        cols = slice(start, start + n)
        h_i = h[:, i * rank : (i + 1) * rank]
        assert not h_i.is_contiguous() and not out[:, cols].is_contiguous()
        lora_expand(h_i, bs[i], scales[i], batch, out[:, cols], backend="triton", shape=shape)
        lora_expand_ref(h_i, bs[i], scales[i], batch, out_ref[:, cols])
        expected[:, cols] = _naive_expand(h_i, bs[i], scales[i], slots, out0[:, cols])
        # Only this slice's columns changed so far; every later slice still holds its original bits.
        assert torch.equal(out[:, start + n :], out0[:, start + n :])
        start += n
    torch.testing.assert_close(out, expected, **_tol(dtype))
    torch.testing.assert_close(out_ref, expected, **_tol(dtype))
    idle = torch.tensor([s < 0 for s in slots], device=DEVICE)
    assert torch.equal(out[idle], out0[idle])


def test_expand_into_one_middle_slice_leaves_the_others_alone():
    slots = [1, 1, -1, 0, 2]
    batch = make_lora_batch(slots, DEVICE)
    _, b, scale = _operands(8, torch.float16, n=24)
    h = _randn(5, 24, seed=5)[:, 8:16]
    out0 = _randn(5, 40 + 24 + 24, dtype=torch.float16, seed=6)
    for shape in lora.KERNEL_SHAPES:
        out = out0.clone()
        lora_expand(h, b, scale, batch, out[:, 40:64], backend="triton", shape=shape)
        assert torch.equal(out[:, :40], out0[:, :40]) and torch.equal(out[:, 64:], out0[:, 64:])
        expected = _naive_expand(h, b, scale, slots, out0[:, 40:64])
        torch.testing.assert_close(out[:, 40:64], expected, **_tol(torch.float16))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("case", ["prefill", "one_adapter_and_none", "mixed", "decode", "no_adapter"])
def test_torch_backend_matches_per_token_loop(kernel_calls, case, dtype):
    # The CPU serving path, bf16 included (torch's bf16 is right on CPU); "prefill" takes the no-gather path.
    slots, rank = CASES[case]
    batch = make_lora_batch(slots, DEVICE)
    a, b, scale = _operands(rank, dtype)
    x = _randn(len(slots), K, dtype=dtype)
    h = lora_shrink(x, a, batch, backend="torch")
    torch.testing.assert_close(h, _naive_shrink(x, a, slots), rtol=1e-4, atol=1e-5)
    y0 = _randn(len(slots), N, dtype=dtype, seed=2)
    y = y0.clone()
    lora_expand(h, b, scale, batch, y, backend="torch")
    torch.testing.assert_close(y, _naive_expand(h, b, scale, slots, y0), **_tol(dtype))
    assert kernel_calls == []


def test_dispatch_by_longest_segment(kernel_calls):
    a, b, scale = _operands(8, torch.float16)
    below, at = SEGMENTED_MIN_SEG_LEN - 1, SEGMENTED_MIN_SEG_LEN
    cases = [
        ([0] * below + [1], "gathered"),
        ([0] * at + [1], "segmented"),
        ([-1] * 2 + [2] * at, "segmented"),
        (DECODE, "gathered"),
        # Adjacent requests on one adapter merge into one segment: a decode step of 16 of them is one run.
        ([3] * at, "segmented"),
    ]
    for slots, expected in cases:
        batch = make_lora_batch(slots, DEVICE)
        assert pick_kernel_shape(batch) == expected
        kernel_calls.clear()
        x = _randn(len(slots), K, dtype=torch.float16)
        h = lora_shrink(x, a, batch)
        y0 = _randn(len(slots), N, dtype=torch.float16, seed=2)
        y = y0.clone()
        lora_expand(h, b, scale, batch, y)
        expected_calls = [("shrink", expected), ("expand", expected)]
        if DEVICE.type == "cpu":
            expected_calls = []  # "auto" on CPU is the torch path, interpreter or not
        assert kernel_calls == expected_calls
        torch.testing.assert_close(h, _naive_shrink(x, a, slots), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(y, _naive_expand(h, b, scale, slots, y0), **_tol(torch.float16))


def test_batch_from_token_slots():
    batch = make_lora_batch(MIXED, "cpu")
    assert batch.token_slots.dtype == batch.seg_starts.dtype == batch.seg_slots.dtype == torch.int32
    assert batch.token_slots.tolist() == MIXED
    assert batch.seg_starts.tolist() == [0, 5, 8, 25, 26, 27, 29, 33]
    assert batch.seg_slots.tolist() == [0, -1, 2, 1, -1, 0, 4]
    assert (batch.max_seg_len, batch.num_tokens, batch.slots) == (17, 33, (0, 1, 2, 4))
    same = make_lora_batch(torch.tensor(MIXED), "cpu")
    assert same.token_slots.tolist() == MIXED and same.seg_starts.tolist() == batch.seg_starts.tolist()


def test_batch_from_runs_merges_adjacent_runs_of_one_slot():
    batch = make_lora_batch_from_runs([(1, 3), (1, 2), (-1, 0), (2, 0), (1, 1), (0, 4), (-1, 2)], DEVICE)
    assert batch.token_slots.device.type == DEVICE.type
    assert batch.token_slots.tolist() == [1] * 6 + [0] * 4 + [-1] * 2
    assert batch.seg_starts.tolist() == [0, 6, 10, 12]
    assert batch.seg_slots.tolist() == [1, 0, -1]
    assert (batch.max_seg_len, batch.num_tokens, batch.slots) == (6, 12, (0, 1))

    empty = make_lora_batch_from_runs([], DEVICE)
    assert empty.token_slots.numel() == 0 and empty.seg_starts.tolist() == [0]
    assert (empty.max_seg_len, empty.num_tokens, empty.slots) == (0, 0, ())
    with pytest.raises(ValueError, match="slot -2"):
        make_lora_batch_from_runs([(-2, 1)], DEVICE)
    with pytest.raises(ValueError, match="negative"):
        make_lora_batch_from_runs([(0, -1)], DEVICE)


@pytest.mark.parametrize("backend", lora.BACKENDS)
def test_empty_step(backend):
    batch = make_lora_batch([], DEVICE)
    a, b, scale = _operands(8, torch.float16)
    h = lora_shrink(torch.empty(0, K, dtype=torch.float16, device=DEVICE), a, batch, backend=backend)
    assert h.shape == (0, 8) and h.dtype == torch.float32
    y = torch.empty(0, N, dtype=torch.float16, device=DEVICE)
    lora_expand(h, b, scale, batch, y, backend=backend)


def _bad_calls(backend: str) -> dict:
    a, b, scale = _operands(8, torch.float16)
    batch = make_lora_batch([0, 1, -1], DEVICE)
    x = _randn(3, K, dtype=torch.float16)
    h = _randn(3, 8)
    y = _randn(3, N, dtype=torch.float16)

    def shrink(x, a, **kw):
        return lambda: lora_shrink(x, a, batch, **{"backend": backend, **kw})

    def expand(h, b, scale, y, **kw):
        return lambda: lora_expand(h, b, scale, batch, y, **{"backend": backend, **kw})

    return {
        "a_k": (shrink(x, a[:, :, :32]), "K=48"),
        "a_dtype": (shrink(x, a.float()), "A stack must be in x's dtype"),
        "x_dtype": (shrink(x.to(torch.int32), a), "x has dtype"),
        "x_rows": (shrink(x[:2], a), "2 rows but the batch has 3 tokens"),
        "x_ndim": (shrink(x[0], a), "x must have 2 dims"),
        "a_slots": (shrink(x, a[:1]), "uses slot 1 but the stacks hold 1 slots"),
        "h_rank": (expand(h[:, :4], b, scale, y), "R=4 columns"),
        "y_cols": (expand(h, b, scale, y[:, :32]), "N=32 columns of y"),
        "b_dtype": (expand(h, b.float(), scale, y), "B stack must be in y's dtype"),
        "h_dtype": (expand(h.half(), b, scale, y), "h has dtype"),
        "h_rows": (expand(h[:2], b, scale, y), "h has 2 rows but y has 3"),
        "y_rows": (expand(h[:2], b, scale, y[:2]), "2 rows but the batch has 3"),
        "scale_len": (expand(h, b, scale[:3], y), "scale has 3 entries"),
        "scale_dtype": (expand(h, b, scale.half(), y), "scale has dtype"),
        "y_stride": (expand(h, b, scale, y.t().contiguous().t()), "contiguous"),
        "backend": (shrink(x, a, backend="cuda"), "backend 'cuda'"),
        "shape": (expand(h, b, scale, y, shape="dense"), "shape 'dense'"),
    }


@pytest.mark.parametrize("backend", lora.BACKENDS)
@pytest.mark.parametrize("name", sorted(_bad_calls("torch")))
def test_bad_arguments_raise_value_error(name, backend):
    # Both backends check everything before computing anything, with the same messages.
    call, message = _bad_calls(backend)[name]
    with pytest.raises(ValueError, match=message):
        call()


def test_batch_type_is_checked():
    a = _operands(8, torch.float16)[0]
    with pytest.raises(TypeError, match="LoRABatch"):
        lora_shrink(_randn(3, K, dtype=torch.float16), a, [0, 1, 2])  # type: ignore[arg-type]
    assert isinstance(make_lora_batch([0], DEVICE), LoRABatch)
