"""Gemma 2's decoder layer: "sandwich" norms, each a Gemma RMSNorm (scale 1 + weight).

    x = x + post_attention_layernorm(attn(input_layernorm(x)))
    x = x + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(x)))

Note HF's `post_attention_layernorm` means something else here than in Llama (where it is the norm before
the MLP). Everything else Gemma 2 changes lives in the shared model, driven by ModelArch: the attention
(query_pre_attn_scalar scale, logit soft-capping, sliding window on the layers HF marks sliding_attention),
the embedding scale, the final logit soft-capping, and the GeGLU MLP (gelu_pytorch_tanh gate).

Gemma 3 runs this same layer: what it adds lives in the attention (per-head (1 + weight) q/k norms) and
in the model (a second RoPE table for its sliding layers).

Importing this module registers the layer as `DECODER_LAYERS["gemma2"]`.
"""

from __future__ import annotations

import torch
from tokenfleet.runtime.model.arch import ModelArch
from tokenfleet.runtime.model.attention.base import AttentionBackend, AttentionMetadata
from tokenfleet.runtime.model.layers import GemmaRMSNorm
from tokenfleet.runtime.model.llama import DECODER_LAYERS, KVCache, LlamaAttention, build_mlp
from tokenfleet.runtime.model.rope import RotaryEmbedding
from torch import nn


class Gemma2DecoderLayer(nn.Module):
    def __init__(
        self, arch: ModelArch, rotary: RotaryEmbedding, backend: AttentionBackend, layer_idx: int = 0
    ):
        super().__init__()
        hidden, eps = arch.hidden_size, arch.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(hidden, eps)
        self.self_attn = LlamaAttention(arch, rotary, backend, layer_idx)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
        self.mlp = build_mlp(arch, layer_idx)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        x = x + self.post_attention_layernorm(
            self.self_attn(positions, self.input_layernorm(x), kv_cache, meta)
        )
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


DECODER_LAYERS["gemma2"] = Gemma2DecoderLayer
