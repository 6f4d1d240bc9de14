"""A PEFT LoRA adapter read from disk and checked against the base model it is to run on.

PEFT saves an adapter as `adapter_config.json` + `adapter_model.safetensors`, the tensors named after the
base model's modules: `base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight` ([r, in]) and
`...lora_B.weight` ([out, r]). A targeted projection computes `W x + scaling * B (A x)`, with
`scaling = alpha / r`, or `alpha / sqrt(r)` under rsLoRA; `rank_pattern` / `alpha_pattern` give single
modules their own r / alpha (r is read from each tensor's shape, which always says it).

Everything is checked before anything is kept, so a bad adapter is refused with a message naming the
problem and the engine never holds half of one: a missing path, a `.bin` (pickle) adapter, unreadable JSON
or safetensors, a variant not served (DoRA, LoRA biases, extra trained modules, embedding or LM-head
targets), a module the model does not have, a rank over the limit, or shapes of another base model.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenfleet.runtime.errors import InvalidRequest
from tokenfleet.runtime.model.arch import ModelArch
from tokenfleet.runtime.model.tensor_parallel import shard_slice

# The projections an adapter may target, and the fused projection of the model each one lands in (the
# model concatenates q/k/v and gate/up) with its slice index there.
TARGETS: dict[str, tuple[str, int]] = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "o_proj": ("o_proj", 0),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", 0),
}

_TENSOR_NAME = re.compile(
    r"^(?:base_model\.model\.)?(?:model\.)?(?:language_model\.)?(?:model\.)?layers\.(\d+)\."
    r"(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight$"
)


class InvalidAdapter(InvalidRequest):
    """The adapter cannot be served on this model; the message says why (400, nothing is loaded)."""

    def __init__(self, message: str):
        super().__init__(message, param="lora_path")


def projection_shapes(arch: ModelArch) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each targetable HF projection of `arch`."""
    hidden, inter = arch.hidden_size, arch.intermediate_size
    return {
        "q_proj": (hidden, arch.q_size),
        "k_proj": (hidden, arch.kv_size),
        "v_proj": (hidden, arch.kv_size),
        "o_proj": (arch.q_size, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }


@dataclass(frozen=True, slots=True)
class LoRAModule:
    """One targeted projection: `delta = scaling * (x @ a.T) @ b.T`."""

    a: torch.Tensor  # [r, in]
    b: torch.Tensor  # [out, r]
    scaling: float

    @property
    def rank(self) -> int:
        return int(self.a.shape[0])


@dataclass(frozen=True, slots=True)
class LoRAAdapterWeights:
    """An adapter's checked tensors, keyed by (layer, HF projection name), on the host."""

    path: str
    modules: dict[tuple[int, str], LoRAModule]
    digest: str  # sha256 of the config and the weights: a reload with other weights is another adapter

    @property
    def rank(self) -> int:
        return max(m.rank for m in self.modules.values())

    @property
    def target_modules(self) -> tuple[str, ...]:
        return tuple(sorted({name for _, name in self.modules}))

    @property
    def nbytes(self) -> int:
        return sum(m.a.nbytes + m.b.nbytes for m in self.modules.values())


def _pattern_value(patterns: dict, module_path: str, default: float) -> float:
    """PEFT's rank/alpha_pattern lookup: a key matches a module whose dotted path ends with it (a regex)."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?{key}$", module_path):
            return float(value)
    return default


def _read_config(folder: Path) -> dict:
    config_file = folder / "adapter_config.json"
    if not config_file.is_file():
        raise InvalidAdapter(f"{folder}: no adapter_config.json (not a PEFT adapter folder)")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        raise InvalidAdapter(f"{config_file}: not readable JSON ({exc})") from None
    if not isinstance(config, dict):
        raise InvalidAdapter(f"{config_file}: not a JSON object")
    peft_type = str(config.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise InvalidAdapter(f"{config_file}: peft_type {peft_type!r} is not served (only LORA)")
    if config.get("use_dora"):
        raise InvalidAdapter(f"{config_file}: DoRA adapters (use_dora) are not served")
    if config.get("bias", "none") != "none":
        raise InvalidAdapter(f"{config_file}: LoRA biases (bias={config['bias']!r}) are not served")
    if config.get("modules_to_save"):
        raise InvalidAdapter(
            f"{config_file}: modules_to_save {config['modules_to_save']} are fully trained copies, not LoRA"
        )
    if config.get("fan_in_fan_out"):
        raise InvalidAdapter(f"{config_file}: fan_in_fan_out is for GPT-2 style Conv1D models")
    for key in ("r", "lora_alpha"):
        if not isinstance(config.get(key), int | float) or config[key] <= 0:
            raise InvalidAdapter(f"{config_file}: {key} must be a positive number, got {config.get(key)!r}")
    return config


def _read_tensors(folder: Path) -> tuple[dict[str, torch.Tensor], bytes]:
    weights_file = folder / "adapter_model.safetensors"
    if not weights_file.is_file():
        if (folder / "adapter_model.bin").is_file():
            raise InvalidAdapter(
                f"{folder}: adapter_model.bin is a pickle, which is never loaded (it can run code); "
                "save the adapter with safe_serialization=True"
            )
        raise InvalidAdapter(f"{folder}: no adapter_model.safetensors")
    from safetensors.torch import load

    data = weights_file.read_bytes()
    try:
        return load(data), data
    except Exception as exc:  # safetensors raises its own error types for damaged headers and sizes
        raise InvalidAdapter(f"{weights_file}: not a readable safetensors file ({exc})") from None


def load_adapter(path: str | Path, arch: ModelArch, max_rank: int, dtype: torch.dtype) -> LoRAAdapterWeights:
    """Read and check the PEFT adapter in folder `path` for a model of shape `arch` (the whole model's,
    never a tensor-parallel shard's); tensors converted to `dtype`. Raises InvalidAdapter."""
    folder = Path(path)
    if not folder.exists():
        raise InvalidAdapter(f"{folder}: no such adapter path")
    if not folder.is_dir():
        raise InvalidAdapter(f"{folder}: an adapter is a folder (adapter_config.json + weights)")
    config = _read_config(folder)
    tensors, data = _read_tensors(folder)
    alpha = float(config["lora_alpha"])
    alpha_pattern = config.get("alpha_pattern") or {}
    rslora = bool(config.get("use_rslora"))
    shapes = projection_shapes(arch)
    has_mlp = not any(arch.is_moe_layer(i) for i in range(arch.num_layers))
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        match = _TENSOR_NAME.match(name)
        if match is None:
            raise InvalidAdapter(
                f"{folder}: tensor {name!r} is not a LoRA A/B weight of a decoder layer's projection "
                f"(targets must be among {', '.join(TARGETS)})"
            )
        layer, module, half = int(match.group(1)), match.group(2), match.group(3)
        if module not in TARGETS:
            raise InvalidAdapter(
                f"{folder}: target module {module!r} is not served (targets must be among {', '.join(TARGETS)})"
            )
        if module in ("gate_proj", "up_proj", "down_proj") and not has_mlp:
            raise InvalidAdapter(f"{folder}: {module} targets a dense MLP; this model's MLPs are experts")
        if layer >= arch.num_layers:
            raise InvalidAdapter(
                f"{folder}: layer {layer} of {name!r} does not exist (the model has {arch.num_layers}); "
                "an adapter of another base model?"
            )
        halves.setdefault((layer, module), {})[half] = tensor
    if not halves:
        raise InvalidAdapter(f"{folder}: adapter_model.safetensors holds no LoRA weights")
    modules: dict[tuple[int, str], LoRAModule] = {}
    for (layer, module), pair in sorted(halves.items()):
        where = f"layers.{layer}.{module}"
        if set(pair) != {"A", "B"}:
            raise InvalidAdapter(f"{folder}: {where} has lora_{next(iter(pair))} but not its other half")
        a, b = pair["A"], pair["B"]
        in_features, out_features = shapes[module]
        rank = int(a.shape[0]) if a.dim() == 2 else -1
        if (
            a.dim() != 2
            or b.dim() != 2
            or a.shape[1] != in_features
            or tuple(b.shape) != (out_features, rank)
        ):
            raise InvalidAdapter(
                f"{folder}: {where} has A {tuple(a.shape)} and B {tuple(b.shape)}; this model needs "
                f"A [r, {in_features}] and B [{out_features}, r] (an adapter of another base model)"
            )
        if rank > max_rank:
            raise InvalidAdapter(f"{folder}: {where} has rank {rank}, over max_lora_rank {max_rank}")
        module_alpha = _pattern_value(alpha_pattern, f"model.layers.{layer}.{module}", alpha)
        scaling = module_alpha / math.sqrt(rank) if rslora else module_alpha / rank
        modules[(layer, module)] = LoRAModule(a.to(dtype).contiguous(), b.to(dtype).contiguous(), scaling)
    config_bytes = json.dumps(config, sort_keys=True).encode()
    digest = hashlib.sha256(config_bytes + b"\0" + data).hexdigest()
    return LoRAAdapterWeights(str(folder), modules, digest)


def shard_adapter(weights: LoRAAdapterWeights, full: ModelArch, rank: int, size: int) -> LoRAAdapterWeights:
    """Rank `rank`'s part of an adapter under tensor parallelism, split as its base projection is split.

    A column-parallel projection (q/k/v, gate/up: the output rows split) keeps all of A and its own rows of
    B; a row-parallel one (o, down: the input columns split) keeps its own columns of A and all of B, so
    its delta is a partial sum that joins the projection's own partial sum before the all-reduce that
    already follows it — LoRA adds no communication. The parts are copies (they travel to the workers).
    """
    if size == 1:
        return weights
    modules = {}
    for (layer, name), module in weights.modules.items():
        block = "self_attn" if name in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
        cut = shard_slice(f"model.layers.{layer}.{block}.{name}.weight", full, rank, size)
        a, b = module.a, module.b
        if cut is not None:
            dim, start, length = cut
            if dim == 0:
                b = b.narrow(0, start, length).clone()
            else:
                a = a.narrow(1, start, length).clone()
        modules[(layer, name)] = LoRAModule(a, b, module.scaling)
    return dataclasses.replace(weights, modules=modules)
