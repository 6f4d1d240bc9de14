"""ModelArch: the shape of a Llama-family (or Gemma 2 / 3) model, read from a HF config.json or GGUF metadata.

One frozen description shared by the model, the KV-cache sizing and the engine (EOS ids, context length).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tokenfleet.runtime.errors import ConfigError

# model_type values whose checkpoints this implementation reproduces exactly.
SUPPORTED_MODEL_TYPES = frozenset(
    {
        "llama",
        "mistral",
        "qwen2",
        "qwen3",
        "phi3",
        "gemma2",
        "gemma3_text",
        "gemma3",
        "mixtral",
        "qwen2_moe",
        "qwen3_moe",
        "olmoe",
    }
)
# The Gemma families: GeGLU MLP, (1 + weight) norms, tied embeddings by default.
GEMMA_TYPES = frozenset({"gemma2", "gemma3_text", "gemma3"})
# Gemma 3 text-only, and the multimodal Gemma 3 whose language model is served.
GEMMA3_TYPES = frozenset({"gemma3_text", "gemma3"})
# model_types whose checkpoints store q/k/v and gate/up already fused (`qkv_proj`, `gate_up_proj`).
FUSED_CHECKPOINT_TYPES = frozenset({"phi3"})


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """Context-extension parameters of rotary embeddings (HF `rope_parameters` / `rope_scaling`)."""

    rope_type: str  # "linear" | "llama3" | "yarn"
    factor: float
    original_max_position_embeddings: int | None = None
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    attention_factor: float | None = None  # yarn, longrope; None = derived from factor
    short_factor: tuple[float, ...] = ()  # longrope: per-frequency divisors within the original context


@dataclass(frozen=True, slots=True)
class ModelArch:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2; Llama's attention_bias sets both this and o_bias
    o_bias: bool = False
    mlp_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Mixture of experts (0 = dense MLP); the MoE layer reads these.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    # --- MoE architectures (Mixtral, Qwen2-MoE, OLMoE) ---
    norm_topk_prob: bool = False  # renormalise the top-k routing weights to sum to 1 (Mixtral: always)
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE: a dense expert every token takes, sigmoid-gated
    dense_layers: frozenset[int] = frozenset()  # layers of a MoE model that keep a dense MLP (Qwen2-MoE)
    qk_norm: bool = False  # OLMoE: RMSNorm over the whole q and k projections, before RoPE
    head_qk_norm: bool = False  # Qwen3: RMSNorm over each head's q and k (head_dim wide), before RoPE
    clip_qkv: float | None = None  # OLMoE: clamp q, k, v to [-clip, clip]
    hidden_act: str = "silu"  # the MLP gate's activation: "silu" | "gelu_pytorch_tanh" (Gemma 2)
    # --- Gemma 2 ---
    gemma_norms: bool = False  # RMSNorm scaled by (1 + weight); norms after attention and after the MLP too
    embed_scale: float | None = None  # embeddings multiplied by this (sqrt(hidden_size)) in the model dtype
    query_pre_attn_scalar: float | None = None  # attention scale = this ** -0.5 instead of head_dim ** -0.5
    attn_logit_softcap: float | None = None  # scores -> cap * tanh(scores / cap) before the softmax
    final_logit_softcap: float | None = None  # the same on the LM head's logits
    # Per layer: sliding window W (a query sees W keys, itself included) or None; () = none. Gemma 2's
    # alternation, or the window a Mistral / Qwen2-family config switches on (`_configured_windows`).
    layer_windows: tuple[int | None, ...] = ()
    # --- Gemma 3 ---
    # The sliding layers' own RoPE (HF rope_local_base_freq / rope_parameters["sliding_attention"]); None:
    # every layer uses rope_theta / rope_scaling (which, in Gemma 3, describe the full-attention layers).
    sliding_rope_theta: float | None = None
    sliding_rope_scaling: RopeScaling | None = None
    # A multimodal checkpoint (model_type "gemma3"): its language model is served, its vision tower skipped.
    text_of_multimodal: bool = False
    # Which shard of a tensor-parallel model this shape describes (tensor_parallel.shard_arch); the sizes
    # above are then the shard's (its heads, KV heads, vocabulary rows, intermediate slices).
    tp_rank: int = 0
    tp_size: int = 1

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}"
            )

    def layer_window(self, layer_idx: int) -> int | None:
        return self.layer_windows[layer_idx] if self.layer_windows else None

    def uses_sliding_rope(self, layer_idx: int) -> bool:
        return self.sliding_rope_theta is not None and self.layer_window(layer_idx) is not None

    @property
    def all_layers_window(self) -> int | None:
        """The window when every layer has one (the widest), else None: only then is KV more than a window
        behind every query dead for the whole model (the KV cache can give its blocks back)."""
        windows = self.layer_windows
        if not windows or None in windows:
            return None
        return max(windows)  # type: ignore[type-var]

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def is_moe_layer(self, layer_idx: int) -> bool:
        return self.num_experts > 0 and layer_idx not in self.dense_layers

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def _ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _longrope(params: Mapping[str, Any], config: Mapping[str, Any]) -> RopeScaling:
    """Phi-3 LongRoPE, within the original context only: there HF uses `short_factor` for every position.
    Past it HF switches *every* position's frequencies to `long_factor` once a sequence is longer, which KV
    already cached at the old frequencies cannot follow, so the served context stops at the original length
    (`arch_from_hf_config` caps max_position_embeddings)."""
    original = params.get("original_max_position_embeddings") or config.get(
        "original_max_position_embeddings"
    )
    if not original or "short_factor" not in params:
        raise ConfigError("longrope needs original_max_position_embeddings and short_factor")
    # HF's default attention factor comes from the whole extension ratio, even within the original context.
    factor = params.get("factor") or int(config.get("max_position_embeddings", original)) / int(original)
    return RopeScaling(
        rope_type="longrope",
        factor=float(factor),
        original_max_position_embeddings=int(original),
        attention_factor=params.get("attention_factor"),
        short_factor=tuple(float(f) for f in params["short_factor"]),
    )


def rope_scaling_from_hf(
    params: Mapping[str, Any] | None, config: Mapping[str, Any] | None = None
) -> RopeScaling | None:
    """`rope_parameters` (transformers >= 5) or `rope_scaling` (older) -> RopeScaling; None when unscaled."""
    if not params:
        return None
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return None
    if rope_type == "longrope":
        return _longrope(params, config or {})
    if rope_type not in ("linear", "llama3", "yarn"):
        raise ConfigError(
            f"unsupported rope scaling type {rope_type!r} (supported: linear, llama3, yarn, longrope)"
        )
    return RopeScaling(
        rope_type=rope_type,
        factor=float(params["factor"]),
        original_max_position_embeddings=params.get("original_max_position_embeddings"),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        attention_factor=params.get("attention_factor"),
    )


def arch_from_hf_config(config: Mapping[str, Any], eos_token_ids: tuple[int, ...] = ()) -> ModelArch:
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(
            f"unsupported model_type {model_type!r}; supported: {sorted(SUPPORTED_MODEL_TYPES)}"
        )
    if model_type == "gemma3":
        config = _gemma3_text_config(config)
    if model_type in GEMMA3_TYPES:
        config = {**GEMMA3_TEXT_DEFAULTS, **config}  # hub configs leave Gemma3TextConfig's sizes implicit
    if model_type not in GEMMA_TYPES and config.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"unsupported hidden_act {config['hidden_act']!r} (Llama family uses silu)")
    rope_params = _rope_params(config)
    rope_theta = rope_params.get("rope_theta", config.get("rope_theta", 10000.0))
    partial_rotary = float(rope_params.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0)))
    if partial_rotary != 1.0:
        # Phi-4-mini and others rotate only part of each head; our RoPE rotates all of it.
        raise ConfigError(f"unsupported partial_rotary_factor {partial_rotary} (only 1.0 is implemented)")
    num_heads = int(config["num_attention_heads"])
    hidden = int(config["hidden_size"])
    rope_scaling = rope_scaling_from_hf(rope_params, config)
    attention_bias = bool(config.get("attention_bias", False))
    qkv_bias = model_type == "qwen2" or attention_bias
    if model_type == "qwen2_moe":
        qkv_bias = bool(config.get("qkv_bias", True))
    family = FAMILY_FIELDS.get(model_type, _no_family_fields)(config)
    if model_type in WINDOWED_TYPES:
        family["layer_windows"] = _configured_windows(config, model_type)
    fields = dict(
        model_type=model_type,
        vocab_size=int(config["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(config["intermediate_size"]),
        num_layers=int(config["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(config.get("num_key_value_heads") or num_heads),
        head_dim=int(config.get("head_dim") or hidden // num_heads),
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope_theta),
        max_position_embeddings=_served_positions(config, rope_scaling),
        rope_scaling=rope_scaling,
        tie_word_embeddings=bool(config.get("tie_word_embeddings", model_type in GEMMA_TYPES)),
        qkv_bias=qkv_bias,
        # Qwen3's attention_bias covers o_proj too (Qwen2's q/k/v bias never did).
        o_bias=(model_type in ("llama", "olmoe", "qwen3", "qwen3_moe") or model_type in GEMMA_TYPES)
        and attention_bias,
        mlp_bias=bool(config.get("mlp_bias", False)),
        bos_token_id=config.get("bos_token_id"),
        eos_token_ids=eos_token_ids or _ids(config.get("eos_token_id")),
        head_qk_norm=model_type in ("qwen3", "qwen3_moe"),
        **MOE_FIELDS.get(model_type, _no_moe)(config),
    )
    fields.update(family)  # a family may override the common reading (Gemma 3's rope_theta, rope_scaling)
    return ModelArch(**fields)


def _rope_params(config: Mapping[str, Any]) -> Mapping[str, Any]:
    return config.get("rope_parameters") or config.get("rope_scaling") or {}


def _served_positions(config: Mapping[str, Any], rope_scaling: RopeScaling | None) -> int:
    positions = int(config.get("max_position_embeddings", 2048))
    if rope_scaling is not None and rope_scaling.rope_type == "longrope":
        return min(positions, rope_scaling.original_max_position_embeddings or positions)
    return positions


# --- Sliding windows a config switches on (HF's per-layer rule for each family) ---

# Every layer slides when the config has a window (Mistral, Mixtral and Phi-3 always; Qwen3-MoE with
# use_sliding_window).
_ALL_LAYERS_WINDOWED = frozenset({"mistral", "mixtral", "phi3", "qwen3_moe"})
# The layers `layer_types` marks sliding_attention, when use_sliding_window; HF derives a missing list from
# max_window_layers (Qwen2 / Qwen3: layers at or past it slide; Qwen2-MoE: even layers before it).
_LAYER_TYPES_WINDOWED = frozenset({"qwen2", "qwen3", "qwen2_moe"})
WINDOWED_TYPES = _ALL_LAYERS_WINDOWED | _LAYER_TYPES_WINDOWED
_USE_SLIDING_WINDOW = frozenset({"qwen2", "qwen3", "qwen2_moe", "qwen3_moe"})


def _configured_windows(config: Mapping[str, Any], model_type: str) -> tuple[int | None, ...]:
    window = config.get("sliding_window")
    if model_type in _USE_SLIDING_WINDOW and not config.get("use_sliding_window", False):
        return ()  # Qwen configs carry a window they do not use
    num_layers = int(config["num_hidden_layers"])
    # A window as wide as every position the model serves never hides a key: full attention.
    if not window or int(window) >= _served_positions(
        config, rope_scaling_from_hf(_rope_params(config), config)
    ):
        return ()
    if int(window) < 1:
        raise ConfigError(f"{model_type} sliding_window must be >= 1, got {window}")
    if model_type in _ALL_LAYERS_WINDOWED:
        return (int(window),) * num_layers
    max_window_layers = int(config.get("max_window_layers", 28))
    if model_type == "qwen2_moe":
        default = [
            "sliding_attention" if (i + 1) % 2 and i < max_window_layers else "full_attention"
            for i in range(num_layers)
        ]
    else:
        default = [
            "sliding_attention" if i >= max_window_layers else "full_attention" for i in range(num_layers)
        ]
    layer_types = config.get("layer_types") or default
    if len(layer_types) != num_layers or set(layer_types) - {"sliding_attention", "full_attention"}:
        raise ConfigError(
            f"{model_type} layer_types must list sliding_attention / full_attention for each of the "
            f"{num_layers} layers, got {layer_types!r}"
        )
    if "sliding_attention" not in layer_types:
        return ()
    return tuple(int(window) if kind == "sliding_attention" else None for kind in layer_types)


# --- Gemma 2 / 3: HF config -> their ModelArch fields (defaults are HF's config classes': saved configs omit
# them) ---

GEMMA_ACTIVATIONS = frozenset({"gelu_pytorch_tanh"})
# Gemma3TextConfig's class defaults for the sizes the common reading requires (hub text_configs omit them).
GEMMA3_TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262_208,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "max_position_embeddings": 131_072,
    "rms_norm_eps": 1e-6,
    "bos_token_id": 2,
    "eos_token_id": 1,
}


def _no_family_fields(config: Mapping[str, Any]) -> dict[str, Any]:
    return {}


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


def _gemma_layer_windows(
    config: Mapping[str, Any], model_type: str, default_types: list[str], default_window: int | None
) -> tuple[int | None, ...]:
    num_layers = int(config["num_hidden_layers"])
    layer_types = config.get("layer_types") or default_types
    if len(layer_types) != num_layers or set(layer_types) - {"sliding_attention", "full_attention"}:
        raise ConfigError(
            f"{model_type} layer_types must list sliding_attention / full_attention for each of the "
            f"{num_layers} layers, got {layer_types!r}"
        )
    window = config.get("sliding_window", default_window)
    if window is not None and int(window) < 1:
        raise ConfigError(f"{model_type} sliding_window must be >= 1, got {window}")
    return tuple(
        int(window) if kind == "sliding_attention" and window is not None else None for kind in layer_types
    )


def _gemma_common(config: Mapping[str, Any], model_type: str, softcaps: tuple[Any, Any]) -> dict[str, Any]:
    """What Gemma 2 and 3 share: GeGLU, (1 + weight) sandwich norms, scaled embeddings, the attention
    scale, optional caps (`softcaps`: the config class's defaults for the attention and final caps)."""
    act = config.get("hidden_activation") or config.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in GEMMA_ACTIVATIONS:
        raise ConfigError(
            f"unsupported {model_type} hidden_activation {act!r} (supported: gelu_pytorch_tanh)"
        )
    if config.get("use_bidirectional_attention"):
        raise ConfigError(
            f"{model_type} with use_bidirectional_attention is unsupported (causal attention only)"
        )
    return {
        "hidden_act": act,
        "gemma_norms": True,
        "embed_scale": float(config["hidden_size"]) ** 0.5,
        "query_pre_attn_scalar": float(config.get("query_pre_attn_scalar", 256)),
        "attn_logit_softcap": _optional_float(config.get("attn_logit_softcapping", softcaps[0])),
        "final_logit_softcap": _optional_float(config.get("final_logit_softcapping", softcaps[1])),
    }


def _gemma2(config: Mapping[str, Any]) -> dict[str, Any]:
    num_layers = int(config["num_hidden_layers"])
    # HF's default when the config lists no layer_types: even layers slide, odd layers attend fully.
    default_types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)]
    return {
        **_gemma_common(config, "gemma2", softcaps=(50.0, 30.0)),
        "layer_windows": _gemma_layer_windows(config, "gemma2", default_types, 4096),
    }


def _gemma3_rope(config: Mapping[str, Any]) -> tuple[Mapping[str, Any], Mapping[str, Any]]:
    """(full-attention layers' RoPE parameters, sliding layers'), each with its rope_theta. transformers >= 5
    writes `rope_parameters` keyed by layer type; older configs say rope_theta (+ rope_scaling) for the full
    layers and rope_local_base_freq for the sliding ones, whose RoPE is never scaled."""
    params = config.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:
        full = params.get("full_attention") or {}
        sliding = params.get("sliding_attention") or {}
    else:
        full, sliding = params or config.get("rope_scaling") or {}, {}
    full = {"rope_theta": config.get("rope_theta", 1_000_000.0), **full}
    sliding = {"rope_theta": config.get("rope_local_base_freq", 10_000.0), **sliding}
    return full, sliding


def _gemma3(config: Mapping[str, Any]) -> dict[str, Any]:
    num_layers = int(config["num_hidden_layers"])
    # HF's default: every `sliding_window_pattern`-th layer (1-based) attends fully, the others slide.
    pattern = int(config.get("sliding_window_pattern") or config.get("_sliding_window_pattern") or 6)
    default_types = [
        "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)
    ]
    layer_types = config.get("layer_types") or default_types
    if config.get("sliding_window", 4096) is None and "sliding_attention" in layer_types:
        # Such a layer would rotate with the sliding RoPE yet see the whole context; HF cannot run it either.
        raise ConfigError("gemma3 with sliding_attention layers needs a sliding_window, got null")
    windows = _gemma_layer_windows(config, "gemma3", default_types, 4096)
    full_rope, sliding_rope = _gemma3_rope(config)
    return {
        **_gemma_common(config, "gemma3", softcaps=(None, None)),
        # Gemma3Config keeps attn_logit_softcapping but HF's Gemma 3 attention never applies it (unlike
        # Gemma 2's): a config that sets it is served uncapped, as transformers serves it.
        "attn_logit_softcap": None,
        "head_qk_norm": True,  # per-head q / k norms, (1 + weight) like every Gemma norm
        "layer_windows": windows,
        "rope_theta": float(full_rope["rope_theta"]),
        "rope_scaling": rope_scaling_from_hf(full_rope, config),
        "sliding_rope_theta": float(sliding_rope["rope_theta"]),
        "sliding_rope_scaling": rope_scaling_from_hf(sliding_rope, config),
    }


def _gemma3_text_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """A multimodal Gemma 3 (Gemma3ForConditionalGeneration) config -> its language model's config, served
    as text only (the vision tower's weights are skipped at load; image inputs are not accepted)."""
    text = config.get("text_config")
    if not isinstance(text, Mapping):
        raise ConfigError("gemma3 config has no text_config: cannot tell the language model's shape")
    if text.get("model_type", "gemma3_text") != "gemma3_text":
        raise ConfigError(
            f"gemma3 text_config of model_type {text['model_type']!r} is unsupported (expected gemma3_text)"
        )
    # The outer config's special tokens and tying are the ones its generation uses.
    inherited = {k: config[k] for k in ("eos_token_id", "bos_token_id", "tie_word_embeddings") if k in config}
    return {**text, **inherited, "model_type": "gemma3"}


FAMILY_FIELDS = {
    "gemma2": _gemma2,
    "gemma3_text": _gemma3,
    "gemma3": lambda config: {**_gemma3(config), "text_of_multimodal": True},
}


# --- MoE architectures: HF config -> the ModelArch fields the MoE layer reads (keyed by model_type) ---


def _no_moe(config: Mapping[str, Any]) -> dict[str, Any]:
    return {}


def _experts(config: Mapping[str, Any], num_experts_key: str, expert_size_key: str) -> dict[str, Any]:
    num_experts = int(config[num_experts_key])
    top_k = int(config["num_experts_per_tok"])
    if not 1 <= top_k <= num_experts:
        raise ConfigError(f"num_experts_per_tok {top_k} must be in [1, {num_experts_key}={num_experts}]")
    return {
        "num_experts": num_experts,
        "num_experts_per_tok": top_k,
        "moe_intermediate_size": int(config[expert_size_key]),
    }


def _mixtral(config: Mapping[str, Any]) -> dict[str, Any]:
    # Mixtral's experts are `intermediate_size` wide and its router always renormalises the top-k weights.
    return {**_experts(config, "num_local_experts", "intermediate_size"), "norm_topk_prob": True}


def _qwen2_moe(config: Mapping[str, Any]) -> dict[str, Any]:
    num_layers = int(config["num_hidden_layers"])
    step = int(config.get("decoder_sparse_step") or 1)
    only_mlp = set(config.get("mlp_only_layers") or ())
    # HF rule: layer i is sparse unless listed in mlp_only_layers or (i + 1) is not a multiple of the step.
    dense = frozenset(i for i in range(num_layers) if i in only_mlp or (i + 1) % step)
    return {
        **_experts(config, "num_experts", "moe_intermediate_size"),
        "norm_topk_prob": bool(config.get("norm_topk_prob", False)),
        "shared_expert_intermediate_size": int(config.get("shared_expert_intermediate_size") or 0),
        "dense_layers": dense,
    }


def _olmoe(config: Mapping[str, Any]) -> dict[str, Any]:
    hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    if config.get("head_dim") not in (None, hidden // heads):
        # HF sizes OLMoE's q/k norms from hidden_size // heads, so only that head_dim is reproducible.
        raise ConfigError(f"olmoe with head_dim {config['head_dim']} != hidden_size // heads is unsupported")
    clip = config.get("clip_qkv")
    return {
        **_experts(config, "num_experts", "intermediate_size"),
        "norm_topk_prob": bool(config.get("norm_topk_prob", False)),
        "qk_norm": True,
        "clip_qkv": float(clip) if clip is not None else None,
    }


def _qwen3_moe(config: Mapping[str, Any]) -> dict[str, Any]:
    # Qwen2-MoE's routing and layer rule without the shared expert (no size for one: `_qwen2_moe` reads 0).
    # Hub checkpoints say `num_experts`; transformers >= 5 writes the same number as `num_local_experts`.
    if "num_experts" not in config and "num_local_experts" in config:
        config = {**config, "num_experts": config["num_local_experts"]}
    return _qwen2_moe(config)


MOE_FIELDS = {"mixtral": _mixtral, "qwen2_moe": _qwen2_moe, "qwen3_moe": _qwen3_moe, "olmoe": _olmoe}
