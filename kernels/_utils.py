"""The kernel toolkit: argument checks and small helpers shared by the kernel launchers.

Launchers validate everything a kernel silently assumes (dtype, rank, unit last-dim stride, device) and
raise ValueError / TypeError naming the offending argument: a wrong stride or dtype inside a Triton kernel
does not fail, it reads garbage.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from tokenfleet.kernels.fp8_format import FP8_DTYPE
from triton import knobs

# dtypes the attention kernels compute in. bf16 runs on GPUs only: the interpreter's bf16 arithmetic works
# on raw bits and is wrong (upstream lists bf16 as unsupported there).
COMPUTE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def interpreter_active() -> bool:
    """True when Triton runs kernels in its CPU interpreter, where cost is per program iteration (launchers
    then pick few, large tiles) and CPU tensors are accepted.

    Asks Triton itself, so `TRITON_INTERPRET` means what it means to the installed Triton (1/true/on in any
    case; 3.7 also yes/y), never "anything but 0". Triton takes the decision when the kernels are
    decorated: set the variable before importing them.
    """
    return bool(knobs.runtime.interpret)


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def check_device(name: str, t: torch.Tensor, device: torch.device) -> None:
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device} (all arguments on one device)")
    if t.device.type == "cpu" and not interpreter_active():
        raise ValueError(f"{name} is a CPU tensor: Triton kernels need CUDA tensors or TRITON_INTERPRET=1")


def check_tensor(
    name: str,
    t: object,
    *,
    ndim: int,
    dtypes: tuple[torch.dtype, ...],
    shape: tuple[int | None, ...] | None = None,
    unit_last_stride: bool = True,
) -> torch.Tensor:
    """Validate one tensor argument; `None` entries in `shape` are free dimensions."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        allowed = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise TypeError(f"{name} has dtype {t.dtype}, expected one of: {allowed}")
    if shape is not None:
        for axis, (got, want) in enumerate(zip(t.shape, shape, strict=True)):
            if want is not None and got != want:
                raise ValueError(
                    f"{name} has size {got} on dim {axis}, expected {want} (shape {tuple(t.shape)})"
                )
    # Kernels vectorise loads along the last dim and take the other strides as arguments.
    if unit_last_stride and t.numel() > 0 and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dim, got strides {t.stride()}")
    return t


def check_scale(name: str, scale: object, device: torch.device) -> torch.Tensor:
    """A per-tensor dequantisation scale: a float32 tensor with one element (kept on device, no sync)."""
    if not isinstance(scale, torch.Tensor):
        raise TypeError(f"{name} must be a float32 tensor with one element, got {type(scale).__name__}")
    if scale.numel() != 1 or scale.dtype != torch.float32:
        raise ValueError(
            f"{name} must be a float32 tensor with one element, got {scale.dtype} {tuple(scale.shape)}"
        )
    check_device(name, scale, device)
    return scale


def check_kv_cache_pair(
    k_cache: object, v_cache: object, *, num_kv_heads: int, head_dim: int, like: tuple[str, torch.dtype]
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V caches: [num_blocks, block_size, num_kv_heads, head_dim], same shape, dtype and strides (the
    kernels take one set of cache strides), in the dtype of the named tensor `like` = (name, dtype) or fp8."""
    dtypes = (*COMPUTE_DTYPES, FP8_DTYPE)
    k = check_tensor("k_cache", k_cache, ndim=4, dtypes=dtypes, shape=(None, None, num_kv_heads, head_dim))
    v = check_tensor("v_cache", v_cache, ndim=4, dtypes=dtypes, shape=tuple(k.shape))
    if v.dtype != k.dtype:
        raise TypeError(f"v_cache has dtype {v.dtype}, k_cache has {k.dtype}: they must match")
    name, dtype = like
    if k.dtype not in (dtype, FP8_DTYPE):
        raise TypeError(f"k_cache has dtype {k.dtype}: expected {dtype} (the {name} dtype) or fp8 e4m3")
    if k.stride() != v.stride():
        raise ValueError(f"k_cache strides {k.stride()} differ from v_cache strides {v.stride()}")
    block_size = k.shape[1]
    if block_size < 1 or block_size & (block_size - 1):
        raise ValueError(f"k_cache block_size (dim 1) must be a power of two, got {block_size}")
    return k, v


def fp8_scales(
    cache: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scales for an FP8 cache (required), or for a full-precision one placeholders the kernels never read
    (the cache itself: no allocation per launch)."""
    if cache.dtype == FP8_DTYPE:
        if k_scale is None or v_scale is None:
            raise ValueError("k_scale and v_scale are required with an fp8 (float8_e4m3fn) KV cache")
        return check_scale("k_scale", k_scale, cache.device), check_scale("v_scale", v_scale, cache.device)
    if k_scale is not None or v_scale is not None:
        raise ValueError(
            f"k_scale/v_scale are only meaningful with an fp8 KV cache, cache dtype is {cache.dtype}"
        )
    return cache, cache


@dataclass(frozen=True, slots=True)
class PagedArgs:
    """The paged-cache arguments of one attention launch, validated."""

    k_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D], q's dtype or fp8
    v_cache: torch.Tensor  # same shape, dtype and strides as k_cache
    block_tables: torch.Tensor  # int32 [B, max_blocks]
    seq_lens: torch.Tensor  # int32 [B]
    query_start_loc: torch.Tensor  # int32 [B + 1]
    seq_ids: torch.Tensor  # int32 [num_served]: the sequences this launch serves
    out: torch.Tensor  # [T, Hq, D], q's dtype
    k_scale: torch.Tensor  # float32 [1] with an fp8 cache, else a placeholder the kernel never reads
    v_scale: torch.Tensor


def check_paged_args(
    q: torch.Tensor,
    k_cache: object,
    v_cache: object,
    block_tables: object,
    seq_lens: object,
    query_start_loc: object,
    *,
    num_kv_heads: int,
    seq_ids: object | None,
    out: object | None,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    same_device: Sequence[tuple[str, torch.Tensor]] = (),
) -> PagedArgs:
    """What the decode and prefill launchers both assume of a (validated) q [T, Hq, D] and the paged cache.

    `seq_ids` defaults to every sequence and `out` to a new tensor like q; `same_device` names further
    tensors that must sit on q's device.
    """
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    if num_q_heads % num_kv_heads:
        raise ValueError(f"q heads ({num_q_heads}) must be a multiple of the kv heads ({num_kv_heads})")
    k_cache, v_cache = check_kv_cache_pair(
        k_cache, v_cache, num_kv_heads=num_kv_heads, head_dim=head_dim, like=("q", q.dtype)
    )
    num_seqs = seq_lens.shape[0] if isinstance(seq_lens, torch.Tensor) else -1
    seq_lens = check_tensor("seq_lens", seq_lens, ndim=1, dtypes=(torch.int32,))
    query_start_loc = check_tensor(
        "query_start_loc", query_start_loc, ndim=1, dtypes=(torch.int32,), shape=(num_seqs + 1,)
    )
    block_tables = check_tensor(
        "block_tables", block_tables, ndim=2, dtypes=(torch.int32,), shape=(num_seqs, None)
    )
    if seq_ids is None:
        seq_ids = torch.arange(num_seqs, dtype=torch.int32, device=q.device)
    seq_ids = check_tensor("seq_ids", seq_ids, ndim=1, dtypes=(torch.int32,))
    if out is None:
        out = torch.empty_like(q)
    out = check_tensor("out", out, ndim=3, dtypes=(q.dtype,), shape=tuple(q.shape))
    for name, t in (
        *same_device,
        ("k_cache", k_cache),
        ("v_cache", v_cache),
        ("block_tables", block_tables),
        ("seq_lens", seq_lens),
        ("query_start_loc", query_start_loc),
        ("seq_ids", seq_ids),
        ("out", out),
    ):
        check_device(name, t, q.device)
    k_scale, v_scale = fp8_scales(k_cache, k_scale, v_scale)
    return PagedArgs(
        k_cache, v_cache, block_tables, seq_lens, query_start_loc, seq_ids, out, k_scale, v_scale
    )


def check_tile(name: str, size: int) -> int:
    """A key/query tile that feeds tl.dot: a power of two, at least 16 (the dot's minimum)."""
    if size < 16 or size & (size - 1):
        raise ValueError(f"{name} must be a power of two >= 16 (tl.dot's minimum), got {size}")
    return size


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs get exact products; tf32 (Triton's GPU default) would be ~1e-3 off the reference."""
    return "ieee" if dtype == torch.float32 else "tf32"


def gather_kv_ref(
    cache: torch.Tensor, block_table: torch.Tensor, num_tokens: int, scale: torch.Tensor | None
) -> torch.Tensor:
    """Reference gather of one sequence's first `num_tokens` cached rows -> [num_tokens, Hkv, D] float32."""
    block_size = cache.shape[1]
    num_blocks = cdiv(num_tokens, block_size)
    blocks = cache[block_table[:num_blocks].long()].float()  # [n_blocks, block_size, Hkv, D]
    rows = blocks.reshape(-1, *cache.shape[2:])[:num_tokens]
    return rows * scale.float() if cache.dtype == FP8_DTYPE and scale is not None else rows


def check_softcap_window(softcap: float | None, sliding_window: int | None) -> None:
    """Optional attention modifiers: a positive logit cap, a window of at least one key (the query's own)."""
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be positive, got {softcap}")
    if sliding_window is not None and (isinstance(sliding_window, bool) or sliding_window < 1):
        raise ValueError(f"sliding_window must be an int >= 1, got {sliding_window!r}")


def causal_attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    context_len: int,
    softcap: float | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Reference causal GQA attention in float32: query i sits at position context_len + i, keys at 0..L-1.

    q [n, Hq, D]; k, v [L, Hkv, D]; returns [n, Hq, D] float32. `softcap`: scores become
    softcap * tanh(scores / softcap) before masking; `sliding_window` W: a query at position p sees keys
    p - W + 1 .. p (HF's `kv_idx > q_idx - sliding_window`).
    """
    group = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(group, dim=1)
    v = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    q_pos = context_len + torch.arange(q.shape[0], device=q.device)
    k_pos = torch.arange(k.shape[0], device=q.device)
    hidden = k_pos[None, None, :] > q_pos[None, :, None]
    if sliding_window is not None:
        hidden = hidden | (k_pos[None, None, :] <= q_pos[None, :, None] - sliding_window)
    scores = scores.masked_fill(hidden, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v)
