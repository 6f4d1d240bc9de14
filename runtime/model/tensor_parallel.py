"""Megatron-style tensor parallelism for the Llama family: what each rank holds and how partials combine.

One model is split over `size` ranks (one process and one device each); every rank runs the same forward
on its shard:
- q/k/v and gate/up are column-parallel: rank r holds its heads' rows of q (heads / size each) and of k/v
  (KV heads / size each, or one replicated KV head when there are fewer KV heads than ranks: rank r then
  uses KV head r // (size / KV heads), the one its query heads belong to); the same for gate/up rows;
- o and down are row-parallel: the matching input columns; each rank's output is a partial sum, and one
  all-reduce per projection gives every rank the full hidden state;
- the embedding and the LM head are vocab-parallel: rank r holds rows [r V/size, (r+1) V/size); a token
  outside the range embeds to zeros (all-reduce), and the logits' vocabulary slices are all-gathered;
- MoE experts are sharded by their intermediate dimension (every rank holds a slice of every expert, so
  routing is unchanged): w13 rows and w2 columns, one all-reduce after the block (shared expert included);
- norms, the MoE router and biases of column-parallel layers follow their rows; OLMoE's q/k norms over all
  heads follow the heads (their mean square is all-reduced, `layers.RMSNorm`); Qwen3's and Gemma 3's
  per-head norms are replicated; the bias of a row-parallel layer (o, down) is held by rank 0 only (zeros
  elsewhere), so the all-reduce adds it once. Everything else is replicated. Each rank's KV cache holds only its KV heads;
  block tables are shared.

Weights are sliced as they are read (`shard_slice`): a rank never materialises the full model. Collectives
use the default torch.distributed process group (one per process, initialised by the engine's workers).
"""

from __future__ import annotations

import dataclasses
import re

import torch
import torch.distributed as dist
from tokenfleet.runtime.errors import ConfigError
from tokenfleet.runtime.model.arch import FUSED_CHECKPOINT_TYPES, ModelArch
from tokenfleet.runtime.model.multimodal_names import text_weight_name

# (dim, start, length): the part of a checkpoint tensor one rank reads; None = the whole tensor.
Slice = tuple[int, int, int] | None

_LAYER = r"model\.layers\.\d+\."
# HF name pattern -> (what its split follows, the split dimension: 0 = rows / column-parallel, 1 = columns).
_RULES: tuple[tuple[re.Pattern[str], str, int], ...] = tuple(
    (re.compile(pattern), kind, dim)
    for pattern, kind, dim in (
        (_LAYER + r"self_attn\.q_proj\.(weight|bias)", "q", 0),
        (_LAYER + r"self_attn\.(k_proj|v_proj)\.(weight|bias)", "kv", 0),
        (_LAYER + r"self_attn\.o_proj\.weight", "q", 1),
        (_LAYER + r"self_attn\.q_norm\.weight", "q_norm", 0),
        (_LAYER + r"self_attn\.k_norm\.weight", "k_norm", 0),
        (_LAYER + r"mlp\.(gate_proj|up_proj)\.(weight|bias)", "ffn", 0),
        (_LAYER + r"mlp\.down_proj\.weight", "ffn", 1),
        (_LAYER + r"mlp\.shared_expert\.(gate_proj|up_proj)\.weight", "shared", 0),
        (_LAYER + r"mlp\.shared_expert\.down_proj\.weight", "shared", 1),
        (_LAYER + r"mlp\.experts\.\d+\.(w1|w3|gate_proj|up_proj)\.weight", "expert", 0),
        (_LAYER + r"mlp\.experts\.\d+\.(w2|down_proj)\.weight", "expert", 1),
        (r"model\.embed_tokens\.weight", "vocab", 0),
        (r"lm_head\.weight", "vocab", 0),
    )
)


def check_tensor_parallel(arch: ModelArch, size: int) -> None:
    """Refuse, with the reason, a model that cannot be split `size` ways (raised at start-up)."""
    if size == 1:
        return
    problems = []
    if arch.num_heads % size:
        problems.append(f"{arch.num_heads} attention heads")
    kv = arch.num_kv_heads
    if kv % size and size % kv:
        problems.append(f"{kv} KV heads (must divide by it, or divide it to be replicated)")
    if arch.vocab_size % size:
        problems.append(f"a vocabulary of {arch.vocab_size}")
    if any(not arch.is_moe_layer(i) for i in range(arch.num_layers)) and arch.intermediate_size % size:
        problems.append(f"an MLP intermediate size of {arch.intermediate_size}")
    if arch.num_experts and arch.moe_intermediate_size % size:
        problems.append(f"an expert intermediate size of {arch.moe_intermediate_size}")
    if arch.shared_expert_intermediate_size % size:
        problems.append(f"a shared-expert intermediate size of {arch.shared_expert_intermediate_size}")
    if problems:
        raise ConfigError(f"tensor_parallel_size {size} does not divide this model's " + ", ".join(problems))
    if arch.model_type in FUSED_CHECKPOINT_TYPES:
        # A fused q/k/v tensor interleaves what each rank needs (its q rows, its k rows, its v rows).
        raise ConfigError(
            f"tensor parallelism does not support {arch.model_type} checkpoints (fused qkv_proj) yet"
        )


def shard_arch(arch: ModelArch, rank: int, size: int) -> ModelArch:
    """The shape of rank `rank`'s shard: its heads, KV heads, vocabulary rows and intermediate slices."""
    check_tensor_parallel(arch, size)
    if size == 1:
        return arch
    return dataclasses.replace(
        arch,
        num_heads=arch.num_heads // size,
        num_kv_heads=max(arch.num_kv_heads // size, 1),
        vocab_size=arch.vocab_size // size,
        intermediate_size=arch.intermediate_size // size,
        moe_intermediate_size=arch.moe_intermediate_size // size,
        shared_expert_intermediate_size=arch.shared_expert_intermediate_size // size,
        tp_rank=rank,
        tp_size=size,
    )


def shard_slice(name: str, full: ModelArch, rank: int, size: int) -> Slice:
    """Which part of the HF-named checkpoint tensor `name` rank `rank` holds (None: all of it)."""
    if size == 1:
        return None
    if full.text_of_multimodal:
        name = text_weight_name(name) or name  # the language model's name (a skipped tensor: read whole)
    for pattern, kind, dim in _RULES:
        if pattern.fullmatch(name) is None:
            continue
        d = full.head_dim
        if kind in ("q_norm", "k_norm"):
            if not full.qk_norm:
                return None  # Qwen3's per-head norm: head_dim wide, the same on every rank
            kind = kind[0] if kind == "q_norm" else "kv"
        if kind == "q":
            per = full.num_heads // size * d
            return dim, rank * per, per
        if kind == "kv":
            if full.num_kv_heads >= size:
                per = full.num_kv_heads // size * d
                return dim, rank * per, per
            return dim, rank // (size // full.num_kv_heads) * d, d
        per = {
            "ffn": full.intermediate_size,
            "shared": full.shared_expert_intermediate_size,
            "expert": full.moe_intermediate_size,
            "vocab": full.vocab_size,
        }[kind] // size
        return dim, rank * per, per
    return None


@torch.no_grad()
def keep_row_parallel_biases_on_rank_0(model: torch.nn.Module, rank: int) -> None:
    """Zero the o_proj / down_proj biases on every rank but 0: each rank's output is a partial sum that the
    all-reduce adds up, and the bias belongs in that sum once (after loading: every rank read it whole)."""
    if rank == 0:
        return
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in ("o_proj", "down_proj") and getattr(module, "bias", None) is not None:
            module.bias.zero_()


# ---- collectives (default process group) -------------------------------------------------------------------


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum the ranks' partial results in place (row-parallel outputs, the vocab-parallel embedding)."""
    dist.all_reduce(x)
    return x


def all_gather_last_dim(x: torch.Tensor, size: int) -> torch.Tensor:
    """[N, V/size] per rank -> [N, V] on every rank, rank order (the vocab-parallel LM head's logits)."""
    parts = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)


def vocab_parallel_embedding(ids: torch.Tensor, weight: torch.Tensor, rank: int) -> torch.Tensor:
    """Rows of this rank's vocabulary slice; zeros for tokens of other ranks; summed over ranks."""
    rows = weight.shape[0]
    local = ids - rank * rows
    mine = (local >= 0) & (local < rows)
    out = torch.nn.functional.embedding(torch.where(mine, local, 0), weight)
    out = out * mine.unsqueeze(-1).to(out.dtype)
    return all_reduce(out)
