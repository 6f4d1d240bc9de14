"""Model loading (GGUF, HF safetensors), the Llama-family model, tokenizer and chat templates.

The re-exports below load on first use (PEP 562): a light module of this package imported on its own — the
model download (`fetch.py`, an init container's whole program) — must not pay torch's import (~1.6 s and
~700 MB) for names it never uses.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tokenfleet.runtime.model.arch import ModelArch, RopeScaling
    from tokenfleet.runtime.model.loader import LoadedModel, load_model
    from tokenfleet.runtime.model.tokenizer import Tokenizer

_EXPORTS = {
    "ModelArch": "arch",
    "RopeScaling": "arch",
    "LoadedModel": "loader",
    "load_model": "loader",
    "Tokenizer": "tokenizer",
}
__all__ = ["LoadedModel", "ModelArch", "RopeScaling", "Tokenizer", "load_model"]  # = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
