"""The sparse MoE block of Mixtral, Qwen2-MoE and OLMoE: router -> top-k SiLU-gated experts (+ shared expert).

Experts live in two stacked parameters, w13 [E, 2I, H] (gate rows, then up rows) and w2 [E, H, I], the
layout `kernels.moe.fused_moe` consumes without a copy: on CUDA one grouped GEMM per projection runs only the
experts each token was routed to; elsewhere the torch reference loops over experts. HF checkpoints store one
tensor per expert and projection; `weight_target` places each into its slice of the stacked parameters.

Importing this module registers the block as `MLP_BUILDERS["moe"]`.
"""

from __future__ import annotations

import re

import torch
from tokenfleet.kernels.moe import fused_moe, quantize_experts_fp8
from tokenfleet.runtime.model import tensor_parallel
from tokenfleet.runtime.model.arch import ModelArch
from tokenfleet.runtime.model.layers import GatedMLP
from tokenfleet.runtime.model.llama import MLP_BUILDERS
from torch import nn

# Per-expert HF names -> (stacked parameter, shard: 0 = gate rows of w13, 1 = up rows, None = all of w2).
# Mixtral calls them w1 / w3 / w2; Qwen2-MoE and OLMoE gate_proj / up_proj / down_proj.
_EXPERT_NAME = re.compile(r"experts\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight")
_EXPERT_SHARD = {
    "w1": ("w13", 0),
    "gate_proj": ("w13", 0),
    "w3": ("w13", 1),
    "up_proj": ("w13", 1),
    "w2": ("w2", None),
    "down_proj": ("w2", None),
}
_SHARED_SHARD = {"shared_expert.gate_proj.weight": 0, "shared_expert.up_proj.weight": 1}


class MoEBlock(nn.Module):
    """`forward(x [T, H]) -> [T, H]`: Σ_top-k w · expert(x), plus sigmoid(gate(x)) · shared_expert(x)."""

    def __init__(self, arch: ModelArch):
        super().__init__()
        hidden, inter, num_experts = arch.hidden_size, arch.moe_intermediate_size, arch.num_experts
        self.num_experts, self.intermediate_size = num_experts, inter
        self.top_k = arch.num_experts_per_tok
        self.renormalize = arch.norm_topk_prob
        # The router stays in the model dtype even under FP8: it is tiny, and its rounding decides routing.
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, inter))
        # Per-output-channel fp32 scales once the experts are quantised to FP8 (buffers: they follow `.to`).
        self.register_buffer("w13_scale", None)
        self.register_buffer("w2_scale", None)
        self.shared_expert: GatedMLP | None = None
        self.shared_expert_gate: nn.Linear | None = None
        if arch.shared_expert_intermediate_size:
            self.shared_expert = GatedMLP(hidden, arch.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)
        # "auto": Triton on CUDA tensors, the torch reference elsewhere; the loader aligns it with attention.
        self.kernel_backend = "auto"
        # Tensor parallel: every expert (and the shared one) holds this rank's intermediate slice, so the
        # block's output is a partial sum, reduced once.
        self.all_reduce = arch.tp_size > 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = fused_moe(
            x,
            self.w13,
            self.w2,
            self.gate(x),
            self.top_k,
            self.renormalize,
            w13_scale=self.w13_scale,
            w2_scale=self.w2_scale,
            backend=self.kernel_backend,
        )
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return tensor_parallel.all_reduce(out) if self.all_reduce else out

    @torch.no_grad()
    def quantize_experts_fp8(self) -> None:
        """Replace w13 / w2 by e4m3 codes with per-output-channel scales; the high-precision copies are freed."""
        for name in ("w13", "w2"):
            codes, scale = quantize_experts_fp8(getattr(self, name).data, "per_channel")
            setattr(self, name, nn.Parameter(codes, requires_grad=False))
            setattr(self, f"{name}_scale", scale)

    # --- WeightOwner (llama.py): HF per-expert tensors -> slices of the stacked parameters ---

    def weight_target(self, suffix: str) -> tuple[str, torch.Tensor] | None:
        match = _EXPERT_NAME.fullmatch(suffix)
        if match is not None:
            expert = int(match.group(1))
            if expert >= self.num_experts:
                return None  # the default mapping reports it as an unexpected weight
            param, shard = _EXPERT_SHARD[match.group(2)]
            rows = getattr(self, param)[expert]
            if shard is None:
                return param, rows
            return param, rows.narrow(0, shard * self.intermediate_size, self.intermediate_size)
        shard = _SHARED_SHARD.get(suffix)
        if shard is not None and self.shared_expert is not None:
            size = self.shared_expert.intermediate_size
            return "shared_expert.gate_up_proj.weight", self.shared_expert.gate_up_proj.weight.narrow(
                0, shard * size, size
            )
        return None  # router, shared-expert down projection and gate: names match the parameters

    def weight_shards(self, param: str) -> int:
        if param == "w13":
            return 2 * self.num_experts
        if param == "w2":
            return self.num_experts
        return 2 if param == "shared_expert.gate_up_proj.weight" else 1


def _build_moe(arch: ModelArch) -> nn.Module:
    return MoEBlock(arch)


MLP_BUILDERS["moe"] = _build_moe
