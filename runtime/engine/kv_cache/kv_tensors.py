"""The paged KV cache's memory: one K and one V tensor per layer, [num_blocks, block_size, kv_heads, head_dim].

The cache starts zeroed (a slot no request wrote reads as 0, never as NaN/Inf garbage that a zero
attention weight would still turn into NaN). On CUDA that is torch.zeros (a memset kernel, fast). On the
CPU, torch.zeros writes every byte of a budget of a GiB or more — seconds of page faults and memset at
start-up for memory that mostly stays unused: the cache is instead an anonymous private mmap, which the
kernel hands out as zero pages and backs with real memory only when a page is first written. Same
contents, nothing touched up front.
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
    return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).view(shape)


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
