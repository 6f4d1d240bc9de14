"""Sampling defaults a checkpoint ships with: HF `generation_config.json`, GGUF `general.sampling.*`.

Model authors tune these (Qwen2.5 ships temperature 0.7, top_p 0.8, top_k 20, repetition_penalty 1.05);
as vLLM does by default, requests that leave a field unset get the model's value instead of OpenAI's
neutral one. Only the fields the server can apply are read; anything absent stays None.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path

from tokenfleet.runtime.model.gguf_file import GGUFFile
from tokenfleet.runtime.model.source import ModelSource

logger = logging.getLogger(__name__)

# our field -> (generation_config.json key, GGUF metadata key, type)
_FIELDS = {
    "temperature": ("temperature", "general.sampling.temp", float),
    "top_p": ("top_p", "general.sampling.top_p", float),
    "top_k": ("top_k", "general.sampling.top_k", int),
    "min_p": ("min_p", "general.sampling.min_p", float),
    "repetition_penalty": ("repetition_penalty", "general.sampling.penalty_repeat", float),
}


@dataclass(frozen=True, slots=True)
class GenerationDefaults:
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None

    def as_dict(self) -> dict[str, float]:
        return {k: v for k, v in asdict(self).items() if v is not None}


def _from_mapping(values: dict, key_index: int) -> GenerationDefaults:
    found = {}
    for field, keys in _FIELDS.items():
        raw = values.get(keys[key_index])
        if isinstance(raw, (int, float)) and not isinstance(raw, bool):
            found[field] = keys[2](raw)
    return GenerationDefaults(**found)


def read_generation_defaults(source: ModelSource) -> GenerationDefaults:
    """The checkpoint's defaults; an unreadable file is logged and yields none (never fails a load)."""
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
