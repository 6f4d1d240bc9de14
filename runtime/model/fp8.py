"""Quantise-on-load FP8 (`quantization: fp8`): e4m3 weights with per-output-channel scales.

Decode is bandwidth bound: one byte per weight instead of two halves the bytes read per token. After the
checkpoint is loaded in high precision, the projections that carry almost all of the weights (qkv, o,
gate/up, down, and MoE experts) are quantised in place; embeddings, norms, the LM head and the MoE router
stay in the model dtype, because their errors are not averaged out by a following matmul (the head's
logits, the router's expert choice). Activations are quantised per token on the fly, so no calibration
data is needed. On CUDA the projections run the Triton FP8 GEMM; elsewhere the torch reference.
"""

from __future__ import annotations

import torch
from tokenfleet.kernels.fp8_gemm import fp8_linear
from tokenfleet.kernels.fp8_quant import quantize_weight_fp8
from tokenfleet.runtime.model.moe import MoEBlock
from torch import nn

# Child names of the nn.Linear layers that are quantised, wherever they sit (attention, dense MLP, the
# Qwen2-MoE shared expert). The router (`gate`), `shared_expert_gate` and `lm_head` are not in the list.
QUANTIZED_LINEARS = frozenset({"qkv_proj", "o_proj", "gate_up_proj", "down_proj"})
# Per-output-channel weights x per-token dynamic activations: no calibration data, one scale per row and
# per token, and no per-K-block rescaling in the GEMM's inner loop (layouts: kernels/fp8_quant.py).
WEIGHT_SCALING = "per_channel"
# Tensor parallelism: each rank quantises its own shard after loading it. Column-parallel layers (qkv,
# gate/up) hold whole rows and see the whole input, so their codes and scales equal one process's. The
# row-parallel ones (o, down) hold a slice of each row and see the matching slice of each token: a rank's
# weight scale covers its slice of the row, and the per-token activation scale its slice of the token.
# Each such group is a subset of the whole, so the scales are at least as fine as one process's (no less
# accurate), but not bit-identical to them. Identical results would need full-row weight scales (reading
# every row-parallel tensor whole) and an all-reduce(max) of every token's activation range before each
# row-parallel GEMM — one more collective per projection on the decode path, which is not worth paying.


class Fp8Linear(nn.Module):
    """y = x · Wᵀ + b with W as e4m3 codes [N, K] and fp32 scales [N, 1]; same call signature as nn.Linear."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        codes, scale = quantize_weight_fp8(linear.weight.detach(), WEIGHT_SCALING)
        self.weight = nn.Parameter(codes, requires_grad=False)
        self.register_buffer("weight_scale", scale)
        self.bias = linear.bias  # kept in the model dtype; fp8_linear adds it in fp32
        self.kernel_backend = "auto"  # Triton on CUDA tensors, torch elsewhere

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(
            x, self.weight, self.weight_scale, WEIGHT_SCALING, self.bias, backend=self.kernel_backend
        )

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8={WEIGHT_SCALING}"


@torch.no_grad()
def quantize_model_fp8(model: nn.Module) -> int:
    """Quantise the model's projections in place; returns how many weight bytes were saved."""
    before = _weight_bytes(model)
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if name in QUANTIZED_LINEARS and type(child) is nn.Linear:
                setattr(module, name, Fp8Linear(child))
        if isinstance(module, MoEBlock):
            module.quantize_experts_fp8()
    return before - _weight_bytes(model)


def _weight_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())
