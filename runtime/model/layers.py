"""Building blocks of the Llama family: RMSNorm and the SiLU-gated MLP with a fused gate/up projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from tokenfleet.runtime.model import tensor_parallel
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32, scale in the model dtype: the order HF uses, so bf16 results match it bit for bit.
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)); gate and up are one [2 * I, H] matmul (one pass over x)."""

    def __init__(
        self, hidden_size: int, intermediate_size: int, bias: bool = False, all_reduce: bool = False
    ):
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        # Tensor parallel: this is one rank's intermediate slice, and down's output a partial sum.
        self.all_reduce = all_reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        out = self.down_proj(F.silu(gate) * up)
        return tensor_parallel.all_reduce(out) if self.all_reduce else out
