"""Sampling defaults a checkpoint ships with: HF `generation_config.json`, GGUF `general.sampling.*`.

Model authors tune these (Qwen2.5 ships temperature 0.7, top_p 0.8, top_k 20, repetition_penalty 1.05);
as vLLM does by default, requests that leave a field unset get the model's value instead of OpenAI's
neutral one. Only the fields the server can apply are read; anything absent stays None.

`max_new_tokens` (generation_config.json only; GGUF has no such key) is read as vLLM reads it: the
`max_tokens` of a request that sets none (still bounded by the context left after the prompt). A built-in
catalog entry's generation config (`source.BUILTIN_MODELS`) is applied over its file's values.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path

from tokenfleet.runtime.model.gguf_file import GGUFFile
from tokenfleet.runtime.model.source import ModelSource

logger = logging.getLogger(__name__)

# our field -> (generation_config.json key, GGUF metadata key or None, type)
_FIELDS: dict[str, tuple[str, str | None, type]] = {
    "temperature": ("temperature", "general.sampling.temp", float),
    "top_p": ("top_p", "general.sampling.top_p", float),
    "top_k": ("top_k", "general.sampling.top_k", int),
    "min_p": ("min_p", "general.sampling.min_p", float),
    "repetition_penalty": ("repetition_penalty", "general.sampling.penalty_repeat", float),
    "max_tokens": ("max_new_tokens", None, int),
}


@dataclass(frozen=True, slots=True)
class GenerationDefaults:
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_tokens: int | None = None

    def as_dict(self) -> dict[str, float]:
        return {k: v for k, v in asdict(self).items() if v is not None}


def _from_mapping(values: dict, key_index: int) -> GenerationDefaults:
    found = {}
    for field, keys in _FIELDS.items():
        if keys[key_index] is None:
            continue
        raw = values.get(keys[key_index])
        if isinstance(raw, (int, float)) and not isinstance(raw, bool):
            if field == "max_tokens" and raw < 1:  # not a length a request could ask for
                continue
            found[field] = keys[2](raw)
    return GenerationDefaults(**found)


def read_generation_defaults(source: ModelSource) -> GenerationDefaults:
    """The checkpoint's defaults (a built-in entry's generation config over its file's); an unreadable file
    is logged and yields none (never fails a load)."""
    found = _read_file(source)
    if not source.generation_config:
        return found
    entry = _from_mapping(dict(source.generation_config), 0)
    return GenerationDefaults(**{**asdict(found), **entry.as_dict()})


def _read_file(source: ModelSource) -> GenerationDefaults:
    try:
        if source.kind == "hf_dir":
            path = Path(source.path) / "generation_config.json"
            if not path.exists():
                return GenerationDefaults()
            return _from_mapping(json.loads(path.read_text()), 0)
        if source.kind == "gguf":
            return _from_mapping(GGUFFile(source.path).metadata, 1)
    except (OSError, ValueError) as e:
        logger.warning("ignoring the generation defaults of %s: %s", source.path, e)
    return GenerationDefaults()
