"""Sort token->expert assignments by expert and pad each expert's run to the grouped GEMM's row block.

After this, every BLOCK_M-row block of `sorted_ids` belongs to a single expert, so one GEMM program
loads one expert's weights and multiplies a dense block of rows; the padding slots hold the sentinel
`num_assignments` (= T * top_k, never a valid row) and are masked by the kernel.

It is a handful of vectorised torch ops (a stable argsort and prefix sums) on the tensors' device. The
output buffers have their worst-case size, `T*top_k + E*(BLOCK_M-1)` rows, so nothing is read back to the
host: the GEMM grid is fixed by that bound and surplus blocks exit on `expert_ids == -1`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class MoEAlignment:
    sorted_ids: torch.Tensor  # int32 [max_padded]: flat assignment index t*top_k + j, or the sentinel
    expert_ids: torch.Tensor  # int32 [max_padded // block_m]: expert of each row block, -1 past the end
    num_padded: torch.Tensor  # int32 [1]: rows in use (sum over experts of their padded counts)
    block_m: int
    num_assignments: int  # T * top_k, also the padding sentinel


def moe_align_block_size(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> MoEAlignment:
    """Group the flattened (token, slot) assignments of `topk_ids` [T, top_k] by expert, padded to block_m.

    Within an expert, assignments keep ascending (token, slot) order, so the layout is deterministic.
    """
    if topk_ids.dim() != 2 or topk_ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(
            f"topk_ids must be an int32/int64 [T, top_k] tensor, got {topk_ids.dtype} {tuple(topk_ids.shape)}"
        )
    if block_m < 1 or num_experts < 1:
        raise ValueError(f"block_m={block_m} and num_experts={num_experts} must be >= 1")
    device = topk_ids.device
    flat = topk_ids.reshape(-1).long()
    num_assignments = flat.numel()
    max_padded = num_assignments + num_experts * (block_m - 1)
    max_padded = -(-max_padded // block_m) * block_m
    num_blocks = max_padded // block_m

    counts = torch.bincount(flat, minlength=num_experts)[:num_experts]
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    padded_start = padded_end - padded
    count_start = torch.cumsum(counts, 0) - counts

    order = torch.sort(flat, stable=True).indices  # assignment indices grouped by expert
    sorted_experts = flat[order]
    rank = torch.arange(num_assignments, device=device) - count_start[sorted_experts]
    sorted_ids = torch.full((max_padded,), num_assignments, dtype=torch.int32, device=device)
    sorted_ids[padded_start[sorted_experts] + rank] = order.to(torch.int32)

    block_start = torch.arange(num_blocks, device=device) * block_m
    expert_ids = torch.searchsorted(padded_end, block_start, right=True).to(torch.int32)
    total = padded_end[-1:]
    expert_ids = torch.where(block_start < total, expert_ids, torch.full_like(expert_ids, -1))
    return MoEAlignment(sorted_ids, expert_ids, total.to(torch.int32), block_m, num_assignments)
