"""Multi-LoRA kernels: every token of a step runs through its own adapter's low-rank update.

Adapter slot s holds A[s] [R, K] and B[s] [N, R] inside preallocated stacks A [S, R, K], B [S, N, R] (one
stack per projection, in the model dtype) and a scaling scale[s] (fp32). Token t uses slot[t], or no
adapter (-1). A LoRA projection is two launches:

    shrink   h[t] = A[slot[t]] · x[t]                          h [T, R] fp32; 0 where slot[t] = -1
    expand   y[t] = y[t] + scale[slot[t]] · B[slot[t]] · h[t]  in place, fp32 sum cast once to y's dtype

R is small (8-64) against K and N (thousands), so both launches are memory bound: what matters is how often
an adapter's weights are read. Each op has two kernel shapes:

- segmented (SGMV): tokens come in runs of one slot (a prefill's tokens share its request's adapter). A
  program takes BLOCK_M rows of one run and a tile of the output, reads the slot's weight tile once for all
  of them, and multiplies with tl.dot. The grid covers (run, row block, column block) for the longest run;
  programs past the end of a shorter run exit at once.
- gathered (BGMV): one program per token (and output tile) looks up that token's slot and does a
  matrix-vector product by broadcasting and tl.sum: no padding to 16 rows when each token may carry a
  different adapter, as in a decode step.

`lora_shrink` / `lora_expand` pick the shape from the step's longest run (`pick_kernel_shape`). h and y may be
column slices of wider tensors (the slices of a fused projection's output), so every row stride is an
argument and only the last dim must be contiguous. The torch references gather the rows that use an
adapter once, grouped by slot (`LoRABatch.order`, built with the batch), and run one matmul per distinct
slot on its contiguous block; they are the CPU serving path.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from tokenfleet.kernels._utils import (
    COMPUTE_DTYPES,
    cdiv,
    check_device,
    check_tensor,
    dot_precision,
    interpreter_active,
    next_power_of_2,
)

BACKENDS = ("triton", "torch")
KERNEL_SHAPES = ("segmented", "gathered")

# The segmented kernels take a step whose longest run has at least this many tokens. 16 is tl.dot's
# smallest row tile: below it a segmented program computes a mostly masked tile to save a few re-reads of
# the slot's weights (which hit L2: the tokens of one adapter read the same tiles), while the gathered
# kernel's program per token spreads a decode step over more SMs. From 16 rows on, one weight read serves a
# full tensor-core row tile, where per-token programs would make every token of a prefill stream its
# adapter's whole A (or B) again.
SEGMENTED_MIN_SEG_LEN = 16


@dataclass(frozen=True, slots=True)
class LoRABatch:
    """Which adapter slot each token of a step uses, in both shapes the kernels read."""

    token_slots: torch.Tensor  # int32 [T], -1 = no adapter
    seg_starts: torch.Tensor  # int32 [G + 1]: segment g is rows seg_starts[g] .. seg_starts[g+1]
    seg_slots: torch.Tensor  # int32 [G]
    max_seg_len: int  # host int: the longest segment, runs of -1 included (the segmented grid covers it)
    num_tokens: int
    slots: tuple[int, ...]  # distinct slots >= 0 in the batch, sorted (host; the torch reference loops)
    # For the torch reference: the rows that use an adapter, grouped by slot (int64 [T'], the order
    # index ops need), and each slot's (slot, start, end) range in that order (host).
    order: torch.Tensor
    slot_ranges: tuple[tuple[int, int, int], ...]


def make_lora_batch_from_runs(runs: Sequence[tuple[int, int]], device: torch.device | str) -> LoRABatch:
    """A batch from (slot, num_tokens) runs in token order (one per scheduled request).

    Adjacent runs of one slot merge into one segment and empty runs vanish. The three index tensors are
    built on the host in one (pinned, for CUDA) buffer and reach the device in a single non-blocking copy.
    """
    device = torch.device(device)
    seg_slots: list[int] = []
    seg_lens: list[int] = []
    for slot, n in runs:
        slot, n = int(slot), int(n)
        if slot < -1:
            raise ValueError(f"slot {slot} is invalid: slots are >= 0, or -1 for no adapter")
        if n < 0:
            raise ValueError(f"run ({slot}, {n}) has a negative token count")
        if n == 0:
            continue
        if seg_slots and seg_slots[-1] == slot:
            seg_lens[-1] += n
        else:
            seg_slots.append(slot)
            seg_lens.append(n)
    num_tokens, num_segs = sum(seg_lens), len(seg_slots)
    lens = torch.tensor(seg_lens, dtype=torch.int32)
    slots_t = torch.tensor(seg_slots, dtype=torch.int32)
    # Layout: token_slots [T] | seg_starts [G + 1] | seg_slots [G].
    host = torch.empty(num_tokens + 2 * num_segs + 1, dtype=torch.int32, pin_memory=device.type == "cuda")
    host[:num_tokens] = torch.repeat_interleave(slots_t, lens)
    host[num_tokens] = 0
    torch.cumsum(lens, 0, dtype=torch.int32, out=host[num_tokens + 1 : num_tokens + 1 + num_segs])
    host[num_tokens + 1 + num_segs :] = slots_t
    dev = host.to(device, non_blocking=True)
    # The rows of each slot, slot by slot: the torch reference multiplies each slot's rows as one
    # contiguous block of a single gather instead of finding and gathering them per slot and projection.
    starts: dict[int, list[tuple[int, int]]] = {}
    pos = 0
    for slot, n in zip(seg_slots, seg_lens, strict=True):
        if slot >= 0:
            starts.setdefault(slot, []).append((pos, n))
        pos += n
    order: list[int] = []
    ranges = []
    for slot in sorted(starts):
        first = len(order)
        for p, n in starts[slot]:
            order.extend(range(p, p + n))
        ranges.append((slot, first, len(order)))
    order_t = torch.tensor(order, dtype=torch.int64).to(device, non_blocking=True)
    return LoRABatch(
        token_slots=dev[:num_tokens],
        seg_starts=dev[num_tokens : num_tokens + 1 + num_segs],
        seg_slots=dev[num_tokens + 1 + num_segs :],
        max_seg_len=max(seg_lens, default=0),
        num_tokens=num_tokens,
        slots=tuple(sorted({s for s in seg_slots if s >= 0})),
        order=order_t,
        slot_ranges=tuple(ranges),
    )


def make_lora_batch(slots_per_token: Sequence[int], device: torch.device | str) -> LoRABatch:
    """A batch from each token's slot (-1 = no adapter); segments are the maximal runs of equal slot."""
    if isinstance(slots_per_token, torch.Tensor):
        slots_per_token = slots_per_token.tolist()
    runs = [(slot, sum(1 for _ in group)) for slot, group in itertools.groupby(slots_per_token)]
    return make_lora_batch_from_runs(runs, device)


def pick_kernel_shape(batch: LoRABatch) -> str:
    """The kernel shape for a step: segmented from a run of SEGMENTED_MIN_SEG_LEN tokens on, else gathered."""
    return "segmented" if batch.max_seg_len >= SEGMENTED_MIN_SEG_LEN else "gathered"


# ---------------------------------------------------------------------------------------------- kernels


@triton.jit
def _sgmv_shrink_kernel(
    x_ptr,  # [T, K] fp16/bf16/fp32, K contiguous
    a_ptr,  # [S, R, K] x's dtype, K contiguous
    h_ptr,  # [T, R] fp32 out, R contiguous
    seg_starts_ptr,  # [G + 1] int32
    seg_slots_ptr,  # [G] int32, -1 = no adapter
    R,
    K,
    stride_xt,
    stride_as,
    stride_ar,
    stride_ht,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    seg = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_r = tl.program_id(2)
    seg_end = tl.load(seg_starts_ptr + seg + 1)
    row0 = tl.load(seg_starts_ptr + seg) + pid_m * BLOCK_M
    # The grid is sized for the longest segment: row blocks past this one's end have nothing to do.
    if row0 >= seg_end:
        return
    rows = row0 + tl.arange(0, BLOCK_M)
    row_mask = rows < seg_end
    rows64 = rows.to(tl.int64)
    rr = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    r_mask = rr < R
    rk = tl.arange(0, BLOCK_K)
    slot = tl.load(seg_slots_ptr + seg).to(tl.int64)
    # A segment without an adapter runs no K steps and stores the zeros its rows must read as.
    k_end = tl.where(slot >= 0, K, 0)
    x_ptrs = x_ptr + rows64[:, None] * stride_xt + rk[None, :]
    a_ptrs = a_ptr + slot * stride_as + rr.to(tl.int64)[None, :] * stride_ar + rk[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    for k0 in range(0, k_end, BLOCK_K):
        k_mask = (k0 + rk) < K
        x = tl.load(x_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        a = tl.load(a_ptrs, mask=k_mask[:, None] & r_mask[None, :], other=0.0)
        acc = tl.dot(x, a, acc, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K
        a_ptrs += BLOCK_K
    h_ptrs = h_ptr + rows64[:, None] * stride_ht + rr[None, :]
    tl.store(h_ptrs, acc, mask=row_mask[:, None] & r_mask[None, :])


@triton.jit
def _bgmv_shrink_kernel(
    x_ptr,  # [T, K] fp16/bf16/fp32, K contiguous
    a_ptr,  # [S, R, K] x's dtype, K contiguous
    h_ptr,  # [T, R] fp32 out, R contiguous
    token_slots_ptr,  # [T] int32, -1 = no adapter
    R,
    K,
    stride_xt,
    stride_as,
    stride_ar,
    stride_ht,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    rr = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_mask = rr < R
    rk = tl.arange(0, BLOCK_K)
    slot = tl.load(token_slots_ptr + t).to(tl.int64)
    k_end = tl.where(slot >= 0, K, 0)
    x_ptrs = x_ptr + t * stride_xt + rk
    a_ptrs = a_ptr + slot * stride_as + rr.to(tl.int64)[:, None] * stride_ar + rk[None, :]
    # Elementwise products accumulate in a [BLOCK_R, BLOCK_K] tile, reduced over K once at the end.
    acc = tl.zeros([BLOCK_R, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, k_end, BLOCK_K):
        k_mask = (k0 + rk) < K
        x = tl.load(x_ptrs, mask=k_mask, other=0.0).to(tl.float32)
        a = tl.load(a_ptrs, mask=r_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
        acc += a * x[None, :]
        x_ptrs += BLOCK_K
        a_ptrs += BLOCK_K
    tl.store(h_ptr + t * stride_ht + rr, tl.sum(acc, axis=1), mask=r_mask)


@triton.jit
def _sgmv_expand_kernel(
    h_ptr,  # [T, R] fp32, R contiguous (a column slice of a wider h is fine)
    b_ptr,  # [S, N, R] y's dtype, R contiguous
    scale_ptr,  # [S] fp32
    y_ptr,  # [T, N] fp16/bf16/fp32, N contiguous, updated in place
    seg_starts_ptr,  # [G + 1] int32
    seg_slots_ptr,  # [G] int32, -1 = no adapter
    N,
    R,
    stride_ht,
    stride_bs,
    stride_bn,
    stride_yt,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    seg = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_n = tl.program_id(2)
    slot = tl.load(seg_slots_ptr + seg).to(tl.int64)
    if slot < 0:
        return
    seg_end = tl.load(seg_starts_ptr + seg + 1)
    row0 = tl.load(seg_starts_ptr + seg) + pid_m * BLOCK_M
    if row0 >= seg_end:
        return
    rows = row0 + tl.arange(0, BLOCK_M)
    row_mask = rows < seg_end
    rows64 = rows.to(tl.int64)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rn < N
    rr = tl.arange(0, BLOCK_R)
    h_ptrs = h_ptr + rows64[:, None] * stride_ht + rr[None, :]
    b_ptrs = b_ptr + slot * stride_bs + rn.to(tl.int64)[None, :] * stride_bn + rr[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for r0 in range(0, R, BLOCK_R):
        r_mask = (r0 + rr) < R
        h = tl.load(h_ptrs, mask=row_mask[:, None] & r_mask[None, :], other=0.0)
        # h stays fp32: B is widened rather than h narrowed to the model dtype (tf32 keeps 10 mantissa
        # bits of h, where a bf16 cast would keep 7), and the dot is cheap next to the y round trip.
        b = tl.load(b_ptrs, mask=r_mask[:, None] & n_mask[None, :], other=0.0).to(tl.float32)
        acc = tl.dot(h, b, acc, input_precision=DOT_PRECISION)
        h_ptrs += BLOCK_R
        b_ptrs += BLOCK_R
    acc = acc * tl.load(scale_ptr + slot)
    y_ptrs = y_ptr + rows64[:, None] * stride_yt + rn[None, :]
    y_mask = row_mask[:, None] & n_mask[None, :]
    y = tl.load(y_ptrs, mask=y_mask, other=0.0).to(tl.float32)
    tl.store(y_ptrs, (y + acc).to(y_ptr.dtype.element_ty), mask=y_mask)


@triton.jit
def _bgmv_expand_kernel(
    h_ptr,  # [T, R] fp32, R contiguous (a column slice of a wider h is fine)
    b_ptr,  # [S, N, R] y's dtype, R contiguous
    scale_ptr,  # [S] fp32
    y_ptr,  # [T, N] fp16/bf16/fp32, N contiguous, updated in place
    token_slots_ptr,  # [T] int32, -1 = no adapter
    N,
    R,
    stride_ht,
    stride_bs,
    stride_bn,
    stride_yt,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(token_slots_ptr + t).to(tl.int64)
    if slot < 0:
        return
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rn < N
    rr = tl.arange(0, BLOCK_R)
    h_ptrs = h_ptr + t * stride_ht + rr
    b_ptrs = b_ptr + slot * stride_bs + rn.to(tl.int64)[:, None] * stride_bn + rr[None, :]
    acc = tl.zeros([BLOCK_N, BLOCK_R], dtype=tl.float32)
    for r0 in range(0, R, BLOCK_R):
        r_mask = (r0 + rr) < R
        h = tl.load(h_ptrs, mask=r_mask, other=0.0)
        b = tl.load(b_ptrs, mask=n_mask[:, None] & r_mask[None, :], other=0.0).to(tl.float32)
        acc += b * h[None, :]
        h_ptrs += BLOCK_R
        b_ptrs += BLOCK_R
    delta = tl.sum(acc, axis=1) * tl.load(scale_ptr + slot)
    y_ptrs = y_ptr + t * stride_yt + rn
    y = tl.load(y_ptrs, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(y_ptrs, (y + delta).to(y_ptr.dtype.element_ty), mask=n_mask)


# -------------------------------------------------------------------------------------------- launchers


@dataclass(frozen=True, slots=True)
class _Tiles:
    block_m: int  # segmented: rows of one segment per program
    block_n: int  # expand: output columns per program
    block_k: int  # shrink: reduction step over K
    block_r: int  # shrink: rank columns per program; expand: reduction step over R
    num_warps: int = 4


def _pick_tiles(op: str, shape: str, max_seg_len: int, width: int, rank: int) -> _Tiles:
    """Tiles for `op` ("shrink": width = K, "expand": width = N). A fixed table: no tuning sweep on the
    first request. tl.dot needs every dim >= 16, so the segmented rank tile is padded up to 16."""
    seg = shape == "segmented"
    r_tile = min(64, max(16 if seg else 1, next_power_of_2(rank)))
    if interpreter_active():
        # Few, large programs: the interpreter's cost is per program iteration, not per element.
        return _Tiles(
            block_m=min(64, max(16, next_power_of_2(max_seg_len))),
            block_n=min(128, max(16, next_power_of_2(width))),
            block_k=min(128, max(16, next_power_of_2(width))),
            block_r=r_tile,
        )
    if seg:
        block_m = 16 if max_seg_len <= 16 else (32 if max_seg_len <= 64 else 64)
        # Shrink's output tile is the whole (padded) rank up to 128: x is read once per rank tile.
        block_r = min(128, max(16, next_power_of_2(rank))) if op == "shrink" else r_tile
        return _Tiles(block_m=block_m, block_n=64, block_k=64, block_r=block_r)
    # Gathered: a [BLOCK_R, BLOCK_K] (shrink) or [BLOCK_N, BLOCK_R] (expand) fp32 tile of ~4k elements
    # keeps the per-thread accumulator at 32 registers with 4 warps.
    wide = max(32, min(256, 4096 // r_tile))
    return _Tiles(block_m=1, block_n=wide, block_k=wide, block_r=r_tile)


def _shrink_triton(x: torch.Tensor, a: torch.Tensor, batch: LoRABatch, shape: str) -> torch.Tensor:
    num_tokens, k = x.shape
    rank = a.shape[1]
    h = torch.empty((num_tokens, rank), dtype=torch.float32, device=x.device)
    if num_tokens == 0 or rank == 0:
        return h
    if k == 0:
        return h.zero_()
    tiles = _pick_tiles("shrink", shape, batch.max_seg_len, k, rank)
    if shape == "segmented":
        grid = (batch.seg_slots.shape[0], cdiv(batch.max_seg_len, tiles.block_m), cdiv(rank, tiles.block_r))
        _sgmv_shrink_kernel[grid](
            x, a, h, batch.seg_starts, batch.seg_slots,
            rank, k, x.stride(0), a.stride(0), a.stride(1), h.stride(0),
            DOT_PRECISION=dot_precision(x.dtype),
            BLOCK_M=tiles.block_m, BLOCK_R=tiles.block_r, BLOCK_K=tiles.block_k,
            num_warps=tiles.num_warps,
        )  # fmt: skip
    else:
        _bgmv_shrink_kernel[(num_tokens, cdiv(rank, tiles.block_r))](
            x, a, h, batch.token_slots,
            rank, k, x.stride(0), a.stride(0), a.stride(1), h.stride(0),
            BLOCK_R=tiles.block_r, BLOCK_K=tiles.block_k,
            num_warps=tiles.num_warps,
        )  # fmt: skip
    return h


def _expand_triton(
    h: torch.Tensor, b: torch.Tensor, scale: torch.Tensor, batch: LoRABatch, y: torch.Tensor, shape: str
) -> None:
    num_tokens, n = y.shape
    rank = h.shape[1]
    if num_tokens == 0 or n == 0 or rank == 0:
        return
    tiles = _pick_tiles("expand", shape, batch.max_seg_len, n, rank)
    if shape == "segmented":
        grid = (batch.seg_slots.shape[0], cdiv(batch.max_seg_len, tiles.block_m), cdiv(n, tiles.block_n))
        _sgmv_expand_kernel[grid](
            h, b, scale, y, batch.seg_starts, batch.seg_slots,
            n, rank, h.stride(0), b.stride(0), b.stride(1), y.stride(0),
            DOT_PRECISION=dot_precision(y.dtype),
            BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_R=tiles.block_r,
            num_warps=tiles.num_warps,
        )  # fmt: skip
    else:
        _bgmv_expand_kernel[(num_tokens, cdiv(n, tiles.block_n))](
            h, b, scale, y, batch.token_slots,
            n, rank, h.stride(0), b.stride(0), b.stride(1), y.stride(0),
            BLOCK_N=tiles.block_n, BLOCK_R=tiles.block_r,
            num_warps=tiles.num_warps,
        )  # fmt: skip


# ------------------------------------------------------------------------------------------ validation


def _dtype_names(dtypes: tuple[torch.dtype, ...]) -> str:
    return ", ".join(str(d).removeprefix("torch.") for d in dtypes)


def _check(name: str, t: object, *, ndim: int, dtypes: tuple[torch.dtype, ...]) -> torch.Tensor:
    """check_tensor, with a wrong dtype reported as a ValueError like every other bad LoRA argument."""
    if isinstance(t, torch.Tensor) and t.dtype not in dtypes:
        raise ValueError(f"{name} has dtype {t.dtype}, expected {_dtype_names(dtypes)}")
    return check_tensor(name, t, ndim=ndim, dtypes=dtypes)


def _check_batch(batch: LoRABatch, num_tokens: int, num_slots: int, what: str) -> None:
    if not isinstance(batch, LoRABatch):
        raise TypeError(f"batch must be a LoRABatch, got {type(batch).__name__}")
    if num_tokens != batch.num_tokens:
        raise ValueError(f"{what} has {num_tokens} rows but the batch has {batch.num_tokens} tokens")
    if batch.slots and batch.slots[-1] >= num_slots:
        raise ValueError(f"the batch uses slot {batch.slots[-1]} but the stacks hold {num_slots} slots")


def _check_devices(tensors: Sequence[tuple[str, torch.Tensor]], batch: LoRABatch, triton_path: bool) -> None:
    device = tensors[0][1].device
    named = (
        *tensors,
        ("batch.token_slots", batch.token_slots),
        ("batch.seg_starts", batch.seg_starts),
        ("batch.seg_slots", batch.seg_slots),
    )
    for name, t in named:
        if triton_path:
            check_device(name, t, device)
        elif t.device != device:
            raise ValueError(f"{name} is on {t.device}, expected {device} (all arguments on one device)")


def _check_shrink(
    x: object, a: object, batch: LoRABatch, triton_path: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    x = _check("x", x, ndim=2, dtypes=COMPUTE_DTYPES)
    a = _check("a", a, ndim=3, dtypes=COMPUTE_DTYPES)
    if a.dtype != x.dtype:
        raise ValueError(f"a has dtype {a.dtype} but x has {x.dtype}: the A stack must be in x's dtype")
    if a.shape[2] != x.shape[1]:
        raise ValueError(
            f"a {tuple(a.shape)} must be [S, R, K] with the K={x.shape[1]} of x {tuple(x.shape)}, "
            f"got K={a.shape[2]}"
        )
    _check_batch(batch, x.shape[0], a.shape[0], "x")
    _check_devices((("x", x), ("a", a)), batch, triton_path)
    return x, a


def _check_expand(
    h: object, b: object, scale: object, batch: LoRABatch, y: object, triton_path: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    y = _check("y", y, ndim=2, dtypes=COMPUTE_DTYPES)
    b = _check("b", b, ndim=3, dtypes=COMPUTE_DTYPES)
    h = _check("h", h, ndim=2, dtypes=(torch.float32,))
    scale = _check("scale", scale, ndim=1, dtypes=(torch.float32,))
    if b.dtype != y.dtype:
        raise ValueError(f"b has dtype {b.dtype} but y has {y.dtype}: the B stack must be in y's dtype")
    num_slots, n, rank = b.shape
    if n != y.shape[1]:
        raise ValueError(
            f"b {tuple(b.shape)} must be [S, N, R] with the N={y.shape[1]} columns of y {tuple(y.shape)}, "
            f"got N={n}"
        )
    if h.shape[1] != rank:
        raise ValueError(
            f"h {tuple(h.shape)} has R={h.shape[1]} columns but b {tuple(b.shape)} is [S, N, R={rank}]"
        )
    if h.shape[0] != y.shape[0]:
        raise ValueError(f"h has {h.shape[0]} rows but y has {y.shape[0]}: one row per token in both")
    if scale.shape[0] != num_slots:
        raise ValueError(f"scale has {scale.shape[0]} entries but b holds {num_slots} slots")
    _check_batch(batch, y.shape[0], num_slots, "y")
    _check_devices((("y", y), ("h", h), ("b", b), ("scale", scale)), batch, triton_path)
    return h, b, scale, y


def _resolve(backend: str, shape: str, t: object) -> str:
    if shape not in ("auto", *KERNEL_SHAPES):
        raise ValueError(f"shape {shape!r} is unknown; expected {KERNEL_SHAPES} or 'auto'")
    if backend == "auto":
        # The model's CPU path is the reference even when the interpreter is on (tests set it for the
        # kernel tests): interpreting the kernels in every projection of a served step would take minutes.
        return "triton" if isinstance(t, torch.Tensor) and t.is_cuda else "torch"
    if backend not in BACKENDS:
        raise ValueError(f"backend {backend!r} is unknown; expected {BACKENDS} or 'auto'")
    return backend


# ------------------------------------------------------------------------------------------ public ops


def lora_shrink(
    x: torch.Tensor,
    a: torch.Tensor,
    batch: LoRABatch,
    backend: str = "auto",
    shape: str = "auto",
    validate: bool = True,
) -> torch.Tensor:
    """h[t] = x[t] @ a[slot[t]].T as a new fp32 [T, R] tensor; rows without an adapter are 0.

    x [T, K] fp16/bf16/fp32 and a [S, R, K] in x's dtype, both contiguous in their last dim. backend "auto"
    runs Triton on CUDA tensors and the torch reference elsewhere (backend "triton" runs the interpreter on CPU); `shape`
    forces the segmented or gathered kernel (default: `pick_kernel_shape`). `validate=False` skips the
    argument checks, for a caller whose tensors are right by construction (see `lora_expand`).
    """
    backend = _resolve(backend, shape, x)
    if backend == "torch":
        return lora_shrink_ref(x, a, batch, validate)
    if validate:
        x, a = _check_shrink(x, a, batch, triton_path=True)
    return _shrink_triton(x, a, batch, pick_kernel_shape(batch) if shape == "auto" else shape)


def lora_expand(
    h: torch.Tensor,
    b: torch.Tensor,
    scale: torch.Tensor,
    batch: LoRABatch,
    y: torch.Tensor,
    backend: str = "auto",
    shape: str = "auto",
    validate: bool = True,
) -> None:
    """y[t] += scale[slot[t]] * (h[t] @ b[slot[t]].T), in place; rows without an adapter are untouched.

    h [T, R] fp32, b [S, N, R] in y's dtype, scale [S] fp32, y [T, N] fp16/bf16/fp32. h and y may be
    column slices of wider tensors (any row stride, last dim contiguous). The sum is fp32 and is cast to
    y's dtype once. backend/shape as for lora_shrink (backend "auto" follows y's device).

    `validate=False` skips the argument checks. The model's LoRA hooks pass it: they call the ops for every
    targeted projection of every layer in every step with adapters, on stacks they allocated themselves and
    the runner's batch for the step's own tokens, and the checks (~3 us per shrink, ~8 us per expand on a
    CPU core) were about half of what a step with one adapter added on a model whose forward is nearly free
    — on a GPU, host time no kernel hides.
    """
    backend = _resolve(backend, shape, y)
    if backend == "torch":
        lora_expand_ref(h, b, scale, batch, y, validate)
        return
    if validate:
        h, b, scale, y = _check_expand(h, b, scale, batch, y, triton_path=True)
    _expand_triton(h, b, scale, batch, y, pick_kernel_shape(batch) if shape == "auto" else shape)


def _single_slot(batch: LoRABatch) -> bool:
    """Every token uses the same adapter (one segment covers the step): no gather needed."""
    return len(batch.slots) == 1 and batch.max_seg_len == batch.num_tokens


def _mm_t(m: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """m @ w.T in fp32 (m fp32). `.float()` of an fp32 tensor is the tensor itself, so fp32 weights are
    used as views; fp16/bf16 ones are widened, one slot at a time, because CPU matmul has no mixed
    half x fp32 form (fp32 is the CPU serving dtype, so that copy stays off the serving path)."""
    return m @ w.float().t()


def lora_shrink_ref(
    x: torch.Tensor, a: torch.Tensor, batch: LoRABatch, validate: bool = True
) -> torch.Tensor:
    """Torch lora_shrink: one gather of the adapter rows, one matmul per distinct slot on its block."""
    if validate:
        x, a = _check_shrink(x, a, batch, triton_path=False)
    if _single_slot(batch):
        return _mm_t(x.float(), a[batch.slots[0]])
    h = torch.zeros((x.shape[0], a.shape[1]), dtype=torch.float32, device=x.device)
    # One gather of the adapter rows, grouped by slot; one matmul per slot on its contiguous block.
    xs = x.index_select(0, batch.order).float()
    hs = torch.empty((xs.shape[0], a.shape[1]), dtype=torch.float32, device=x.device)
    for slot, start, end in batch.slot_ranges:
        torch.mm(xs[start:end], a[slot].float().t(), out=hs[start:end])  # _mm_t, written in place
    return h.index_copy_(0, batch.order, hs)


def lora_expand_ref(
    h: torch.Tensor,
    b: torch.Tensor,
    scale: torch.Tensor,
    batch: LoRABatch,
    y: torch.Tensor,
    validate: bool = True,
) -> None:
    """Torch lora_expand, in place. `y.add_(delta)` with fp32 delta computes y.float() + delta and casts
    once, as the kernels do."""
    if validate:
        h, b, scale, y = _check_expand(h, b, scale, batch, y, triton_path=False)
    if _single_slot(batch):
        slot = batch.slots[0]
        y.add_(_mm_t(h, b[slot]).mul_(scale[slot]))
        return
    order = batch.order
    hs = h.index_select(0, order)
    ys = y.index_select(0, order).float()  # y.float() + delta, cast once: as the kernels do
    for slot, start, end in batch.slot_ranges:
        ys[start:end].add_(_mm_t(hs[start:end], b[slot]).mul_(scale[slot]))
    y.index_copy_(0, order, ys.to(y.dtype))
