"""Argument checks and small helpers shared by the kernel launchers.

Launchers validate everything a kernel silently assumes (dtype, rank, unit last-dim stride, device) and
raise ValueError / TypeError naming the offending argument: a wrong stride or dtype inside a Triton kernel
does not fail, it reads garbage.
"""

from __future__ import annotations

import os

import torch

# dtypes the attention kernels compute in. bf16 runs on GPUs only: the interpreter's bf16 arithmetic works
# on raw bits and is wrong (shared/ARCHITECTURE.md §7).
COMPUTE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# The FP8 KV-cache format: e4m3 without infinities (Triton's float8e4nv), the one Hopper converts natively.
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0


def interpreter_active() -> bool:
    """True when Triton runs kernels in its CPU interpreter (decided when kernels are decorated)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


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
    k_cache: object, v_cache: object, *, num_kv_heads: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V caches: [num_blocks, block_size, num_kv_heads, head_dim], same shape and dtype."""
    dtypes = (*COMPUTE_DTYPES, FP8_DTYPE)
    k = check_tensor("k_cache", k_cache, ndim=4, dtypes=dtypes, shape=(None, None, num_kv_heads, head_dim))
    v = check_tensor("v_cache", v_cache, ndim=4, dtypes=dtypes, shape=tuple(k.shape))
    if v.dtype != k.dtype:
        raise TypeError(f"v_cache has dtype {v.dtype}, k_cache has {k.dtype}: they must match")
    block_size = k.shape[1]
    if block_size < 1 or block_size & (block_size - 1):
        raise ValueError(f"k_cache block_size (dim 1) must be a power of two, got {block_size}")
    return k, v


def fp8_scales(
    cache_dtype: torch.dtype, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scales for an FP8 cache (required) or placeholders for a full-precision one (ignored by kernels)."""
    if cache_dtype == FP8_DTYPE:
        if k_scale is None or v_scale is None:
            raise ValueError("k_scale and v_scale are required with an fp8 (float8_e4m3fn) KV cache")
        return check_scale("k_scale", k_scale, device), check_scale("v_scale", v_scale, device)
    if k_scale is not None or v_scale is not None:
        raise ValueError(
            f"k_scale/v_scale are only meaningful with an fp8 KV cache, cache dtype is {cache_dtype}"
        )
    one = torch.ones(1, dtype=torch.float32, device=device)
    return one, one


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


def causal_attention_ref(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, context_len: int
) -> torch.Tensor:
    """Reference causal GQA attention in float32: query i sits at position context_len + i, keys at 0..L-1.

    q [n, Hq, D]; k, v [L, Hkv, D]; returns [n, Hq, D] float32.
    """
    group = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(group, dim=1)
    v = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    q_pos = context_len + torch.arange(q.shape[0], device=q.device)
    k_pos = torch.arange(k.shape[0], device=q.device)
    scores = scores.masked_fill(k_pos[None, None, :] > q_pos[None, :, None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v)
