"""Load a Hugging Face checkpoint directory: config.json, *.safetensors (single or sharded with an index),
tokenizer.json, tokenizer_config.json (chat template, special tokens), generation_config.json (EOS ids).

safetensors only: pickle-based .bin checkpoints can execute code on load and are refused.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import tokenizers
import torch
from safetensors import safe_open
from tokenfleet.runtime.errors import ConfigError
from tokenfleet.runtime.model.arch import arch_from_hf_config
from tokenfleet.runtime.model.checkpoint import Checkpoint, Selector
from tokenfleet.runtime.model.tokenizer import Tokenizer

_INDEX = "model.safetensors.index.json"


def _read_json(path: Path, required: bool = True) -> dict[str, Any]:
    if not path.exists():
        if required:
            raise ConfigError(f"{path.parent}: missing {path.name}")
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read {path}: {e}") from e


def safetensors_files(directory: Path) -> list[Path]:
    index = directory / _INDEX
    if index.exists():
        shards = sorted(set(_read_json(index).get("weight_map", {}).values()))
        files = [directory / shard for shard in shards]
        missing = [f.name for f in files if not f.exists()]
        if missing:
            raise ConfigError(f"{directory}: shards listed in {_INDEX} are missing: {missing}")
        return files
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        pickled = [p.name for p in directory.glob("*.bin")] + [p.name for p in directory.glob("*.pt")]
        hint = (
            f" (found {pickled}: pickle checkpoints are refused, convert them to safetensors)"
            if pickled
            else ""
        )
        raise ConfigError(f"{directory}: no *.safetensors weights{hint}")
    return files


def _special_token(value: Any) -> str | None:
    """tokenizer_config.json writes special tokens as strings or as AddedToken dicts."""
    if isinstance(value, dict):
        return value.get("content")
    return value


def _eos_ids(
    config: dict, generation: dict, backend: tokenizers.Tokenizer, eos_token: str | None
) -> tuple[int, ...]:
    ids: list[int] = []
    for source in (generation.get("eos_token_id"), config.get("eos_token_id")):
        if source is not None:
            ids.extend([source] if isinstance(source, int) else source)
    if eos_token is not None and (token_id := backend.token_to_id(eos_token)) is not None:
        ids.append(token_id)
    return tuple(dict.fromkeys(int(i) for i in ids))


def _weights(files: list[Path], select: Selector | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                part = select(name) if select is not None else None
                if part is None:
                    yield name, f.get_tensor(name)
                    continue
                dim, start, length = part  # read only this rank's rows / columns
                view = f.get_slice(name)
                index = (slice(None),) * dim + (slice(start, start + length),)
                yield name, view[index]


def load_hf_dir(directory: Path) -> Checkpoint:
    config = _read_json(directory / "config.json")
    tokenizer_config = _read_json(directory / "tokenizer_config.json", required=False)
    generation = _read_json(directory / "generation_config.json", required=False)
    tokenizer_file = directory / "tokenizer.json"
    if not tokenizer_file.exists():
        raise ConfigError(f"{directory}: missing tokenizer.json (only fast tokenizers are supported)")
    try:
        backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
    except Exception as e:  # tokenizers raises a bare Exception on malformed files
        raise ConfigError(f"cannot read {tokenizer_file}: {e}") from e

    eos_token = _special_token(tokenizer_config.get("eos_token"))
    bos_token = _special_token(tokenizer_config.get("bos_token"))
    arch = arch_from_hf_config(config, eos_token_ids=_eos_ids(config, generation, backend, eos_token))
    chat_template = tokenizer_config.get("chat_template")
    if chat_template is None and (directory / "chat_template.jinja").exists():
        chat_template = (directory / "chat_template.jinja").read_text(encoding="utf-8")
    if isinstance(chat_template, list):  # [{"name": "default", "template": ...}, ...]
        chat_template = next((t["template"] for t in chat_template if t.get("name") == "default"), None)
    tokenizer = Tokenizer(
        backend,
        eos_token_ids=arch.eos_token_ids,
        bos_token=bos_token,
        eos_token=eos_token,
        chat_template=chat_template,
    )

    files = safetensors_files(directory)
    num_weights = 0
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            num_weights += len(list(f.keys()))
    return Checkpoint(
        arch=arch,
        tokenizer=tokenizer,
        weights=lambda select=None: _weights(files, select),
        num_weights=num_weights,
        name=directory.name,
    )
