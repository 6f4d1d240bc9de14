"""Building blocks of the Llama family: RMSNorm (and Gemma's (1 + weight) variant) and the gated MLP with a
fused gate/up projection (SiLU, or Gemma's tanh-approximated GELU)."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from tokenfleet.runtime.model import tensor_parallel
from torch import nn


class RMSNorm(nn.Module):
    """`tp_size` > 1: this rank holds a slice of the normalised vector (OLMoE's norm over all q / k heads
    when the heads are split), so the mean square is all-reduced. A slice replicated on several ranks (a
    KV head shared by them) is counted once per holder, which dividing by width x tp_size compensates:
    every rank's slice has the same width."""

    def __init__(self, hidden_size: int, eps: float, tp_size: int = 1):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.tp_size = tp_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32, scale in the model dtype: the order HF uses, so bf16 results match it bit for bit.
        dtype = x.dtype
        x32 = x.float()
        if self.tp_size > 1:
            square_sum = tensor_parallel.all_reduce(x32.pow(2).sum(-1, keepdim=True))
            mean_square = square_sum / (x32.shape[-1] * self.tp_size)
        else:
            mean_square = x32.pow(2).mean(-1, keepdim=True)
        x32 = x32 * torch.rsqrt(mean_square + self.eps)
        return self.weight * x32.to(dtype)


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: the weight is stored zero-centred and scales by (1 + weight), in fp32 before the cast
    back (HF's order, unlike Llama's), so bf16 results match HF's."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).to(x.dtype)


# HF hidden_act name -> the gate's activation.
ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh")}


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)); gate and up are one [2 * I, H] matmul (one pass over x)."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        bias: bool = False,
        all_reduce: bool = False,
        activation: str = "silu",
    ):
        super().__init__()
        self.act = ACTIVATIONS[activation]
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        # Tensor parallel: this is one rank's intermediate slice, and down's output a partial sum.
        self.all_reduce = all_reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        out = self.down_proj(self.act(gate) * up)
        return tensor_parallel.all_reduce(out) if self.all_reduce else out
