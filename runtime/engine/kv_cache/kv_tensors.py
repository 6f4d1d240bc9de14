"""The paged KV cache's memory: one K and one V tensor per layer, [num_blocks, block_size, kv_heads, head_dim].

The cache starts zeroed (a slot no request wrote reads as 0, never as NaN/Inf garbage that a zero
attention weight would still turn into NaN). On CUDA that is torch.zeros (a memset kernel, fast). On the
CPU, torch.zeros writes every byte of a budget of a GiB or more — seconds of page faults and memset at
start-up for memory that mostly stays unused: the cache is instead an anonymous private mmap, which the
kernel hands out as zero pages and backs with real memory only when a page is first written. Same
contents, nothing touched up front.

Sleep mode (`release_kv_caches` / `restore_kv_caches`) frees that memory while keeping every tensor object
(and on the CPU its address): the model, a compiled step, a draft and the host tier all hold references to
these tensors. On the CPU the pages go back to the kernel (MADV_DONTNEED: they read as zero pages again,
exactly the fresh state); on CUDA the storage is resized to nothing and re-allocated zeroed on wake.
"""

from __future__ import annotations

import math
import mmap

import torch
from tokenfleet.runtime import startup_timing


def zeroed_cpu_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero tensor in fresh anonymous memory, paged in lazily (the tensor keeps the mapping alive)."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    tensor = torch.frombuffer(buf, dtype=torch.uint8).view(dtype).view(shape)
    tensor._kv_mmap = buf  # how release_kv_caches hands its pages back
    return tensor


def allocate_kv_caches(
    num_layers: int, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    with startup_timing.timed("kv_alloc"):
        if device.type == "cpu":
            return [
                (zeroed_cpu_tensor(shape, dtype), zeroed_cpu_tensor(shape, dtype)) for _ in range(num_layers)
            ]
        return [
            (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(num_layers)
        ]


def kv_cache_bytes(kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> int:
    return sum(t.numel() * t.element_size() for pair in kv_caches for t in pair)


def release_kv_caches(kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> int:
    """Give the caches' memory back (sleep mode); the tensors stay, their contents are gone. Bytes freed."""
    for pair in kv_caches:
        for t in pair:
            buf = getattr(t, "_kv_mmap", None)
            if buf is not None:
                buf.madvise(mmap.MADV_DONTNEED)  # private anonymous: the range reads as zero pages again
            else:
                t.untyped_storage().resize_(0)
    if any(t.is_cuda for pair in kv_caches for t in pair):
        torch.cuda.empty_cache()  # the caching allocator would keep the freed blocks reserved
    return kv_cache_bytes(kv_caches)


def restore_kv_caches(kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Undo `release_kv_caches`: the same tensors, zeroed, backed by memory again."""
    for pair in kv_caches:
        for t in pair:
            if getattr(t, "_kv_mmap", None) is not None:
                continue  # zero pages, backed again on first write
            storage = t.untyped_storage()
            nbytes = t.numel() * t.element_size()
            if storage.nbytes() < nbytes:
                storage.resize_(nbytes)
                t.zero_()
