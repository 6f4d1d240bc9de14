"""The paged KV cache's memory: one K and one V tensor per layer, [num_blocks, block_size, kv_heads, head_dim]."""

from __future__ import annotations

import torch
from tokenfleet.runtime import startup_timing


def allocate_kv_caches(
    num_layers: int, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    with startup_timing.timed("kv_alloc"):
        return [
            (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(num_layers)
        ]
