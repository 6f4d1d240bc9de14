"""LlamaForCausalLM over a paged KV cache: Llama, SmolLM, Mistral, Qwen2 (QKV bias), Qwen3 (per-head q/k
norms), Phi-3 (checkpoints with q/k/v and gate/up already fused), the MoE variants (moe.py) and Gemma 2 / 3's
model-level differences (scaled embeddings, attention scale / soft-capping / per-layer windows, capped
logits; Gemma 3's per-head (1 + weight) q/k norms and a second RoPE for its sliding layers; the decoder
layer both share is in gemma2.py).

Inputs are flattened token batches (no padding): T = all new tokens of all sequences in the step, with their
positions and an AttentionMetadata telling the backend where each sequence's context lives. Weights arrive
under HF names (`load_weights`); q/k/v and gate/up are concatenated into fused projections at load.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Protocol

import torch
from tokenfleet.runtime.errors import ConfigError
from tokenfleet.runtime.model import tensor_parallel
from tokenfleet.runtime.model.arch import ModelArch
from tokenfleet.runtime.model.attention.base import AttentionBackend, AttentionMetadata
from tokenfleet.runtime.model.layers import GatedMLP, GemmaRMSNorm, RMSNorm
from tokenfleet.runtime.model.multimodal_names import text_weight_name
from tokenfleet.runtime.model.rope import RotaryEmbedding
from torch import nn

KVCache = tuple[torch.Tensor, torch.Tensor]  # K and V: [num_blocks, block_size, Hkv, D] each


def _dense_mlp(arch: ModelArch) -> nn.Module:
    return GatedMLP(
        arch.hidden_size,
        arch.intermediate_size,
        bias=arch.mlp_bias,
        all_reduce=arch.tp_size > 1,
        activation=arch.hidden_act,
    )


# "dense" | "moe" -> builder. The MoE layer registers itself here with one entry.
MLP_BUILDERS: dict[str, Callable[[ModelArch], nn.Module]] = {"dense": _dense_mlp}

# HF name fragments renamed before mapping: Mixtral stores its MoE block as `block_sparse_moe`.
_RENAMES = ((".block_sparse_moe.", ".mlp."),)


class WeightOwner(Protocol):
    """A module that places the HF tensors under its prefix itself (the MoE block's stacked experts).

    Names are relative to the module. `weight_target` returns (own parameter name, the slice of it the
    tensor fills), or None to leave the tensor to the default mapping; `weight_shards` says how many
    tensors fill one of its parameters.
    """

    def weight_target(self, suffix: str) -> tuple[str, torch.Tensor] | None: ...

    def weight_shards(self, param: str) -> int: ...


# HF parameter suffix -> (fused parameter suffix, shard index). Shards are stacked in index order.
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}


def _num_shards(param_name: str) -> int:
    """How many HF tensors fill this parameter (3 for fused q/k/v, 2 for fused gate/up)."""
    return sum(1 for fused, _ in _FUSED.values() if f".{fused}." in f".{param_name}") or 1


def _owner_of(name: str, owners: dict[str, WeightOwner]) -> tuple[str, WeightOwner] | None:
    """(name relative to the innermost owning module, that module), or None when no module owns it."""
    parts = name.split(".")
    for i in range(len(parts) - 1, 0, -1):
        owner = owners.get(".".join(parts[:i]))
        if owner is not None:
            return ".".join(parts[i:]), owner
    return None


def build_mlp(arch: ModelArch, layer_idx: int = 0) -> nn.Module:
    kind = "moe" if arch.is_moe_layer(layer_idx) else "dense"
    builder = MLP_BUILDERS.get(kind)
    if builder is None:
        raise ConfigError(f"no {kind} MLP implementation is registered")
    return builder(arch)


class LlamaAttention(nn.Module):
    def __init__(
        self, arch: ModelArch, rotary: RotaryEmbedding, backend: AttentionBackend, layer_idx: int = 0
    ):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = arch.num_heads, arch.num_kv_heads, arch.head_dim
        self.q_size, self.kv_size = arch.q_size, arch.kv_size
        self.scale = arch.attention_scale
        # Gemma 2: capped scores, and this layer's sliding window (None: full context).
        self.softcap = arch.attn_logit_softcap
        self.sliding_window = arch.layer_window(layer_idx)
        self.qkv_proj = nn.Linear(arch.hidden_size, self.q_size + 2 * self.kv_size, bias=arch.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, arch.hidden_size, bias=arch.o_bias)
        self.rotary = rotary  # shared by every layer: one cos/sin table
        self.backend = backend
        # OLMoE: RMSNorm over the whole q / k projections (all heads at once) and a clamp of q, k, v.
        # Under tensor parallelism each rank holds its heads' slice of q and k, and the norms all-reduce.
        self.q_norm = RMSNorm(self.q_size, arch.rms_norm_eps, arch.tp_size) if arch.qk_norm else None
        self.k_norm = RMSNorm(self.kv_size, arch.rms_norm_eps, arch.tp_size) if arch.qk_norm else None
        # Qwen3, Gemma 3: one RMSNorm per head (weights head_dim wide, shared by all heads), so a
        # tensor-parallel shard holding whole heads needs no communication for it. Gemma's scale by 1 + weight.
        if arch.head_qk_norm:
            head_norm = GemmaRMSNorm if arch.gemma_norms else RMSNorm
            self.q_norm = head_norm(self.head_dim, arch.rms_norm_eps)
            self.k_norm = head_norm(self.head_dim, arch.rms_norm_eps)
        self.head_qk_norm = arch.head_qk_norm
        self.clip_qkv = arch.clip_qkv
        self.all_reduce = arch.tp_size > 1  # o_proj is row-parallel: its output is a partial sum

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.q_norm is not None and not self.head_qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip_qkv is not None:  # after the norms, as HF does
            q, k, v = (t.clamp(-self.clip_qkv, self.clip_qkv) for t in (q, k, v))
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.head_qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        if self.softcap is None and self.sliding_window is None:
            out = self.backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale)
        else:
            out = self.backend.forward(
                q, k, v, kv_cache[0], kv_cache[1], meta, self.scale, self.softcap, self.sliding_window
            )
        out = self.o_proj(out.reshape(num_tokens, self.q_size))
        return tensor_parallel.all_reduce(out) if self.all_reduce else out


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self, arch: ModelArch, rotary: RotaryEmbedding, backend: AttentionBackend, layer_idx: int = 0
    ):
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.self_attn = LlamaAttention(arch, rotary, backend, layer_idx)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.mlp = build_mlp(arch, layer_idx)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        x = x + self.self_attn(positions, self.input_layernorm(x), kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


# "llama" | "gemma2" -> decoder layer class. Gemma 2's layer registers itself (gemma2.py) with one entry.
DECODER_LAYERS: dict[str, type[nn.Module]] = {"llama": LlamaDecoderLayer}


class LlamaModel(nn.Module):
    def __init__(self, arch: ModelArch, backend: AttentionBackend, max_positions: int):
        super().__init__()
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        # One cos/sin table, shared by every layer's attention (non-persistent buffers: never in checkpoints);
        # Gemma 3's sliding layers share a second one, with their own base.
        self.rotary = RotaryEmbedding(arch.head_dim, max_positions, arch.rope_theta, arch.rope_scaling)
        self.sliding_rotary = None
        if arch.sliding_rope_theta is not None:
            self.sliding_rotary = RotaryEmbedding(
                arch.head_dim, max_positions, arch.sliding_rope_theta, arch.sliding_rope_scaling
            )
        kind = "gemma2" if arch.gemma_norms else "llama"  # Gemma 3 has Gemma 2's layer
        layer_cls = DECODER_LAYERS.get(kind)
        if layer_cls is None:
            raise ConfigError(
                f"no {kind} decoder layer is registered (import tokenfleet.runtime.model.gemma2)"
            )
        self.layers = nn.ModuleList(
            layer_cls(arch, self.sliding_rotary if arch.uses_sliding_rope(i) else self.rotary, backend, i)
            for i in range(arch.num_layers)
        )
        self.norm = (GemmaRMSNorm if arch.gemma_norms else RMSNorm)(arch.hidden_size, arch.rms_norm_eps)


def _rounded_embed_scales(scale: float) -> dict[torch.dtype, float]:
    """The scale rounded to each model dtype, as HF multiplies by it (sqrt(3584) is not a bf16 number).
    A plain dict looked up by dtype: nothing for a compiled step to trace."""
    dtypes = (torch.float32, torch.bfloat16, torch.float16)
    # device="cpu": the model may be built under torch.device("meta").
    return {d: float(torch.tensor(scale, dtype=torch.float32, device="cpu").to(d)) for d in dtypes}


class LlamaForCausalLM(nn.Module):
    """`forward(input_ids [T], positions [T], kv_caches, attn_meta) -> hidden [T, H]`; `compute_logits`."""

    def __init__(self, arch: ModelArch, backend: AttentionBackend, max_positions: int | None = None):
        super().__init__()
        self.arch = arch
        self.model = LlamaModel(arch, backend, max_positions or arch.max_position_embeddings)
        self.lm_head = nn.Linear(arch.hidden_size, arch.vocab_size, bias=False)
        self.embed_scales = None if arch.embed_scale is None else _rounded_embed_scales(arch.embed_scale)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the embedding with the LM head; call again after `to_empty`, which unties parameters."""
        if self.arch.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def max_positions(self) -> int:
        return int(self.model.rotary.cos.shape[0])

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        attn_meta: AttentionMetadata,
        num_layers: int | None = None,
    ) -> torch.Tensor:
        """`num_layers` runs only the first layers (self-speculative drafting); default all."""
        if self.arch.tp_size > 1:
            x = tensor_parallel.vocab_parallel_embedding(
                input_ids, self.model.embed_tokens.weight, self.arch.tp_rank
            )
        else:
            x = self.model.embed_tokens(input_ids)
        if self.embed_scales is not None:
            x = x * self.embed_scales[x.dtype]
        for layer, kv_cache in zip(
            self.model.layers[: num_layers or len(self.model.layers)], kv_caches, strict=False
        ):
            x = layer(positions, x, kv_cache, attn_meta)
        return self.model.norm(x)

    @property
    def logits_into_buffer(self) -> bool:
        """Whether `compute_logits` writes into a given `out`: one rank's plain fp32 linear head, unhooked."""
        head = self.lm_head
        plain = type(head) is nn.Linear and not head._forward_hooks and not head._forward_pre_hooks
        return self.arch.tp_size == 1 and plain and head.weight.dtype == torch.float32

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """fp32 logits [rows, vocab]. `out`: an fp32 tensor of that shape to write them into, a buffer the
        caller keeps across steps; used where the head is one rank's plain fp32 linear (the same matmul
        `nn.Linear` runs, the same bits), otherwise ignored."""
        into = out is not None and self.logits_into_buffer and hidden.dtype == out.dtype == torch.float32
        if into:
            logits = torch.matmul(hidden, self.lm_head.weight.t(), out=out)
        else:
            logits = self.lm_head(hidden).float()
            if self.arch.tp_size > 1:  # each rank holds a slice of the vocabulary
                logits = tensor_parallel.all_gather_last_dim(logits, self.arch.tp_size)
        cap = self.arch.final_logit_softcap
        if cap is not None:  # Gemma 2; in fp32 (HF caps in the model dtype: identical in fp32, finer in bf16)
            logits = logits.div_(cap).tanh_().mul_(cap) if into else torch.tanh(logits / cap) * cap
        return logits

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors in; every parameter must be written exactly once (fused shards per shard)."""
        params = dict(self.named_parameters(remove_duplicate=False))
        owners = {prefix: m for prefix, m in self.named_modules() if hasattr(m, "weight_target")}
        expected = {}
        for name in params:
            owner = _owner_of(name, owners)
            expected[name] = owner[1].weight_shards(owner[0]) if owner else _num_shards(name)
        if self.arch.tie_word_embeddings:
            del expected["lm_head.weight"]  # the embedding, written under its own name
        seen: dict[str, int] = {}
        for hf_name, tensor in weights:
            if "rotary_emb.inv_freq" in hf_name:
                continue  # derived from the config, never trusted from a checkpoint
            if self.arch.text_of_multimodal:
                hf_name = text_weight_name(hf_name)
                if hf_name is None:
                    continue  # the vision tower / projector of a multimodal checkpoint
            if self.arch.tie_word_embeddings and hf_name == "lm_head.weight":
                continue  # some tied checkpoints store the copy anyway
            for old, new in _RENAMES:
                hf_name = hf_name.replace(old, new)
            name, target, shards = self._target(hf_name, params, owners, expected)
            if target.shape != tensor.shape:
                raise ConfigError(
                    f"{hf_name}: checkpoint shape {tuple(tensor.shape)} != model {tuple(target.shape)} "
                    f"(the config.json does not describe these weights)"
                )
            target.copy_(tensor)
            seen[name] = seen.get(name, 0) + shards
        missing = sorted(n for n, count in expected.items() if seen.get(n, 0) < count)
        if missing:
            raise ConfigError(
                f"checkpoint lacks weights for {missing[:5]}{' ...' if len(missing) > 5 else ''}"
            )

    def _target(
        self,
        hf_name: str,
        params: dict[str, nn.Parameter],
        owners: dict[str, WeightOwner],
        expected: dict[str, int],
    ) -> tuple[str, torch.Tensor, int]:
        """The parameter (or the rows of a fused parameter) that the HF tensor `hf_name` fills, and how many
        of that parameter's shards it writes (all of them for a checkpoint that stores it fused, as Phi-3)."""
        owner = _owner_of(hf_name, owners)
        if owner is not None and (found := owner[1].weight_target(owner[0])) is not None:
            prefix = hf_name[: len(hf_name) - len(owner[0])]
            return prefix + found[0], found[1], 1
        for hf_part, (fused_part, shard) in _FUSED.items():
            if f".{hf_part}." not in hf_name:
                continue
            name = hf_name.replace(hf_part, fused_part)
            param = params.get(name)
            if param is None:
                break
            sizes = self._shard_sizes(fused_part)
            start = sum(sizes[:shard])
            return name, param.narrow(0, start, sizes[shard]), 1
        param = params.get(hf_name)
        if param is None:
            raise ConfigError(f"unexpected weight {hf_name!r} in checkpoint")
        return hf_name, param, expected.get(hf_name, 1)

    def _shard_sizes(self, fused_part: str) -> list[int]:
        if fused_part == "self_attn.qkv_proj":
            return [self.arch.q_size, self.arch.kv_size, self.arch.kv_size]
        return [self.arch.intermediate_size, self.arch.intermediate_size]
