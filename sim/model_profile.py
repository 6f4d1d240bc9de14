"""What the cost model needs to know about a model: shapes, parameter counts, bytes per weight and per KV token.

Read from any HF `config.json` (dense and MoE: Llama, Mistral, Qwen2, Mixtral, Qwen2-MoE, OLMoE key names),
from a GGUF file's header (its tensors' real byte sizes, so quantised files cost what they weigh), or taken
from a named preset. Parameter counts are computed from the shapes; MoE models have `active_params` (what a
token multiplies through: shared layers + top-k experts) next to `total_params` (what must sit in memory).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from tokenfleet.sim.errors import SimInputError

DTYPE_BYTES = {"float32": 4.0, "bfloat16": 2.0, "float16": 2.0, "fp8": 1.0}


@dataclass(frozen=True, slots=True)
class ModelProfile:
    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int  # dense MLP width (per expert for MoE when moe_intermediate_size is 0)
    vocab_size: int
    num_experts: int = 0  # 0: dense
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    tie_embeddings: bool = False
    weight_bytes_per_param: float = 2.0  # bf16; 1.0 for fp8 weights
    kv_bytes_per_element: float = 2.0  # bf16 KV; 1.0 for an fp8 KV cache
    max_model_len: int = 8192
    file_weight_bytes: float | None = None  # a GGUF's real tensor bytes (quantised), overrides params x bytes

    # ---- derived -----------------------------------------------------------------------------------------

    @property
    def attn_params_per_layer(self) -> int:
        q = self.num_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        return self.hidden_size * (q + 2 * kv) + q * self.hidden_size

    @property
    def expert_params(self) -> int:
        width = self.moe_intermediate_size or self.intermediate_size
        return 3 * self.hidden_size * width

    @property
    def mlp_params_per_layer(self) -> int:
        if self.num_experts:
            return self.num_experts * self.expert_params + self.hidden_size * self.num_experts
        return 3 * self.hidden_size * self.intermediate_size

    @property
    def active_mlp_params_per_layer(self) -> int:
        if self.num_experts:
            return self.experts_per_token * self.expert_params + self.hidden_size * self.num_experts
        return self.mlp_params_per_layer

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size * (1 if self.tie_embeddings else 2)

    @property
    def total_params(self) -> int:
        return (
            self.num_layers * (self.attn_params_per_layer + self.mlp_params_per_layer) + self.embedding_params
        )

    @property
    def active_params(self) -> int:
        """Parameters one token multiplies through (the LM head included, the embedding lookup not)."""
        per_layer = self.attn_params_per_layer + self.active_mlp_params_per_layer
        return self.num_layers * per_layer + self.vocab_size * self.hidden_size

    @property
    def weight_bytes(self) -> float:
        if self.file_weight_bytes is not None:
            return self.file_weight_bytes
        return self.total_params * self.weight_bytes_per_param

    @property
    def kv_bytes_per_token(self) -> float:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.kv_bytes_per_element

    def with_precision(self, weights: str = "bfloat16", kv_cache: str = "bfloat16") -> ModelProfile:
        for field, value in (("weights", weights), ("kv_cache", kv_cache)):
            if value not in DTYPE_BYTES:
                raise SimInputError(field, f"unknown dtype {value!r}", DTYPE_BYTES)
        return replace(
            self,
            weight_bytes_per_param=DTYPE_BYTES[weights],
            kv_bytes_per_element=DTYPE_BYTES[kv_cache],
            file_weight_bytes=None if weights != "bfloat16" else self.file_weight_bytes,
        )


PRESETS: dict[str, ModelProfile] = {
    p.name: p
    for p in (
        ModelProfile("llama-3-8b", 32, 4096, 32, 8, 128, 14336, 128256, max_model_len=8192),
        ModelProfile("llama-3-70b", 80, 8192, 64, 8, 128, 28672, 128256, max_model_len=8192),
        ModelProfile("mixtral-8x7b", 32, 4096, 32, 8, 128, 14336, 32000, 8, 2, max_model_len=32768),
        # The default CPU model (SmolLM2-135M), for the calibrated `cpu` profile; fp32 on CPU.
        ModelProfile(
            "smollm2-135m",
            30,
            576,
            9,
            3,
            64,
            1536,
            49152,
            tie_embeddings=True,
            weight_bytes_per_param=4.0,
            kv_bytes_per_element=4.0,
        ),
    )
}
PRESET_ALIASES = {
    "8b": "llama-3-8b",
    "70b": "llama-3-70b",
    "moe": "mixtral-8x7b",
    "smollm2-135m-instruct": "smollm2-135m",
}


def _first(config: dict, *keys: str, default=None):
    for k in keys:
        if config.get(k) is not None:
            return config[k]
    return default


def from_hf_config(config: dict, name: str) -> ModelProfile:
    try:
        hidden = int(_first(config, "hidden_size", "d_model"))
        heads = int(_first(config, "num_attention_heads", "n_head"))
        profile = ModelProfile(
            name=name,
            num_layers=int(_first(config, "num_hidden_layers", "n_layer")),
            hidden_size=hidden,
            num_heads=heads,
            num_kv_heads=int(_first(config, "num_key_value_heads", default=heads)),
            head_dim=int(_first(config, "head_dim", default=hidden // heads)),
            intermediate_size=int(_first(config, "intermediate_size", "ffn_dim", default=4 * hidden)),
            vocab_size=int(config["vocab_size"]),
            num_experts=int(_first(config, "num_local_experts", "num_experts", default=0)),
            experts_per_token=int(_first(config, "num_experts_per_tok", default=0)),
            moe_intermediate_size=int(_first(config, "moe_intermediate_size", default=0)),
            tie_embeddings=bool(config.get("tie_word_embeddings", False)),
            weight_bytes_per_param=DTYPE_BYTES.get(str(config.get("torch_dtype", "bfloat16")), 2.0),
            max_model_len=int(_first(config, "max_position_embeddings", default=8192)),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise SimInputError("model", f"config.json of {name!r} lacks or mistypes a field: {e}") from e
    if profile.num_experts and not profile.experts_per_token:
        raise SimInputError("model", f"{name!r} has experts but no num_experts_per_tok")
    return profile


def from_gguf(path: Path) -> ModelProfile:
    import gguf  # only here: reading a header is the one use

    try:
        reader = gguf.GGUFReader(str(path))
    except (OSError, ValueError) as e:
        raise SimInputError("model", f"cannot read GGUF {path}: {e}") from e

    def get(key: str, default=None):
        field = reader.fields.get(key)
        return default if field is None else field.contents()

    arch = get("general.architecture")
    if arch is None:
        raise SimInputError("model", f"{path} has no general.architecture")
    try:
        hidden = int(get(f"{arch}.embedding_length"))
        heads = int(get(f"{arch}.attention.head_count"))
        vocab = get(f"{arch}.vocab_size")
        if vocab is None:
            tokens = reader.fields.get("tokenizer.ggml.tokens")
            vocab = len(tokens.data) if tokens is not None else 32000
        names = {t.name for t in reader.tensors}
        return ModelProfile(
            name=path.stem,
            num_layers=int(get(f"{arch}.block_count")),
            hidden_size=hidden,
            num_heads=heads,
            num_kv_heads=int(get(f"{arch}.attention.head_count_kv", heads)),
            head_dim=int(get(f"{arch}.attention.key_length", hidden // heads)),
            intermediate_size=int(get(f"{arch}.feed_forward_length")),
            vocab_size=int(vocab),
            num_experts=int(get(f"{arch}.expert_count", 0)),
            experts_per_token=int(get(f"{arch}.expert_used_count", 0)),
            moe_intermediate_size=int(get(f"{arch}.expert_feed_forward_length", 0)),
            tie_embeddings="output.weight" not in names,
            max_model_len=int(get(f"{arch}.context_length", 8192)),
            file_weight_bytes=float(sum(int(t.n_bytes) for t in reader.tensors)),
        )
    except (TypeError, ValueError) as e:
        raise SimInputError("model", f"GGUF {path}: missing or bad {arch} header field: {e}") from e


def model_profile(spec: str) -> ModelProfile:
    """A preset name, a HF checkpoint directory / config.json, or a .gguf file."""
    key = PRESET_ALIASES.get(spec.lower(), spec.lower())
    if key in PRESETS:
        return PRESETS[key]
    path = Path(spec)
    if path.is_dir():
        path = path / "config.json"
    if path.suffix == ".gguf" and path.is_file():
        return from_gguf(path)
    if path.name.endswith(".json") and path.is_file():
        try:
            config = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise SimInputError("model", f"cannot read {path}: {e}") from e
        return from_hf_config(config, path.parent.name or path.stem)
    raise SimInputError(
        "model",
        f"unknown model {spec!r}: not a preset, a .gguf file or a directory with config.json",
        [*PRESETS, *PRESET_ALIASES],
    )
