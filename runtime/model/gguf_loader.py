"""Load a Llama-family GGUF file: architecture from `<arch>.*` metadata, dequantized HF-named weights,
tokenizer and chat template from `tokenizer.*` metadata."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from tokenfleet.runtime import startup_timing
from tokenfleet.runtime.errors import ConfigError
from tokenfleet.runtime.model.arch import ModelArch, RopeScaling
from tokenfleet.runtime.model.checkpoint import Checkpoint, Selector
from tokenfleet.runtime.model.dequant import dequantize
from tokenfleet.runtime.model.gguf_file import GGUFFile, GGUFTensor
from tokenfleet.runtime.model.gguf_tokenizer import build_gguf_tokenizer, gguf_eos_token_ids
from tokenfleet.runtime.model.tokenizer import Tokenizer

# GGUF `general.architecture` -> HF model_type. llama.cpp converts Mistral checkpoints as "llama".
_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2"}

# GGUF tensor name (after `blk.N.`) -> HF name (after `model.layers.N.`).
_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def hf_tensor_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    if gguf_name.startswith("blk."):
        _, layer, rest = gguf_name.split(".", 2)
        if rest in _LAYER_TENSORS:
            return f"model.layers.{layer}.{_LAYER_TENSORS[rest]}"
    return None


def unpermute_rope_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation (interleaved RoPE pairs -> HF's rotate-half halves)."""
    rows = weight.shape[0]
    head_dim = rows // num_heads
    return (
        weight.reshape(num_heads, head_dim // 2, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)
    )


def _rope_scaling(md: dict, prefix: str) -> RopeScaling | None:
    kind = md.get(f"{prefix}.rope.scaling.type")
    factor = md.get(f"{prefix}.rope.scaling.factor")
    if kind in (None, "none") or not factor:
        return None
    if kind not in ("linear", "yarn"):
        raise ConfigError(f"GGUF rope scaling {kind!r} is not supported")
    original = md.get(f"{prefix}.rope.scaling.original_context_length")
    return RopeScaling(rope_type=kind, factor=float(factor), original_max_position_embeddings=original)


def gguf_arch(md: dict, tensors: dict[str, GGUFTensor]) -> ModelArch:
    arch_name = md.get("general.architecture")
    model_type = _ARCHITECTURES.get(arch_name)
    if model_type is None:
        raise ConfigError(
            f"GGUF architecture {arch_name!r} is not supported; supported: {sorted(_ARCHITECTURES)}"
        )
    if "rope_freqs.weight" in tensors:
        # Llama 3.1 GGUFs bake the llama3 RoPE scaling into per-frequency factors we do not apply yet.
        raise ConfigError(
            "GGUF files with rope_freqs (Llama 3.1 RoPE scaling) are not supported; use the HF checkpoint"
        )
    p = arch_name
    num_heads = int(md[f"{p}.attention.head_count"])
    hidden = int(md[f"{p}.embedding_length"])
    head_dim = int(md.get(f"{p}.attention.key_length") or hidden // num_heads)
    vocab = md.get(f"{p}.vocab_size") or len(md["tokenizer.ggml.tokens"])
    bos = md.get("tokenizer.ggml.bos_token_id")
    return ModelArch(
        model_type=model_type,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(md[f"{p}.feed_forward_length"]),
        num_layers=int(md[f"{p}.block_count"]),
        num_heads=num_heads,
        num_kv_heads=int(md.get(f"{p}.attention.head_count_kv") or num_heads),
        head_dim=head_dim,
        rms_norm_eps=float(md[f"{p}.attention.layer_norm_rms_epsilon"]),
        rope_theta=float(md.get(f"{p}.rope.freq_base", 10000.0)),
        max_position_embeddings=int(md[f"{p}.context_length"]),
        rope_scaling=_rope_scaling(md, p),
        tie_word_embeddings="output.weight" not in tensors,
        qkv_bias="blk.0.attn_q.bias" in tensors,
        bos_token_id=int(bos) if bos is not None else None,
        eos_token_ids=gguf_eos_token_ids(md),
    )


# Float tensors are stored as typed values [rows, cols], the rest as raw quantisation blocks [rows, bytes].
_TYPED = (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16)


def _dequantize_part(tensor: GGUFTensor, part: tuple[int, int, int] | None) -> torch.Tensor:
    """fp32 values of the tensor, or of the rows / columns `part` names, dequantising only those when the
    quantisation blocks allow (rows always; columns when the range falls on block boundaries)."""
    if part is None:
        return dequantize(tensor.data, tensor.qtype, tensor.shape)
    dim, start, length = part
    shape = list(tensor.shape)
    shape[dim] = length
    if dim == 0:
        return dequantize(tensor.data[start : start + length], tensor.qtype, tuple(shape))
    block, block_bytes = GGML_QUANT_SIZES[tensor.qtype]
    if tensor.qtype in _TYPED:
        return dequantize(tensor.data[:, start : start + length], tensor.qtype, tuple(shape))
    if start % block == 0 and length % block == 0:
        raw = tensor.data[:, start // block * block_bytes : (start + length) // block * block_bytes]
        return dequantize(raw, tensor.qtype, tuple(shape))
    return dequantize(tensor.data, tensor.qtype, tensor.shape)[:, start : start + length].contiguous()


def gguf_weights(
    gguf: GGUFFile, arch: ModelArch, select: Selector | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """HF-named fp32 tensors, dequantized one at a time (peak memory: one tensor beyond the model); with
    `select`, only each tensor's selected part (a tensor-parallel shard) is dequantized."""
    for name, tensor in gguf.tensors.items():
        hf_name = hf_tensor_name(name)
        if hf_name is None:
            raise ConfigError(f"GGUF tensor {name!r} has no place in a {arch.model_type} model")
        part = select(hf_name) if select is not None else None
        weight = _dequantize_part(tensor, part)
        # llama.cpp permutes rows within each head; a shard holds whole heads, so undo it per shard.
        head_rows = weight.shape[0] // arch.head_dim
        if arch.model_type == "llama" and name.endswith(("attn_q.weight", "attn_k.weight")):
            with startup_timing.timed("dequant"):
                weight = unpermute_rope_rows(weight, head_rows)
        yield hf_name, weight


def load_gguf(path: Path) -> Checkpoint:
    gguf = GGUFFile(path)
    md = gguf.metadata
    arch = gguf_arch(md, gguf.tensors)
    tokens = md["tokenizer.ggml.tokens"]
    startup_timing.mark("gguf_header")

    def token(key: str) -> str | None:
        token_id = md.get(f"tokenizer.ggml.{key}")
        return tokens[token_id] if token_id is not None else None

    tokenizer = Tokenizer(
        build_gguf_tokenizer(md),
        eos_token_ids=arch.eos_token_ids,
        bos_token=token("bos_token_id"),
        eos_token=token("eos_token_id"),
        chat_template=md.get("tokenizer.chat_template"),
    )
    startup_timing.mark("tokenizer_build")
    return Checkpoint(
        arch=arch,
        tokenizer=tokenizer,
        weights=lambda select=None: gguf_weights(gguf, arch, select),
        num_weights=len(gguf.tensors),
        name=path.stem,
    )
