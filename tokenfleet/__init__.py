"""tokenfleet: Kubernetes-native LLM serving.

`tokenfleet.runtime` (engine, server, router), `tokenfleet.operator` (kopf operator) and
`tokenfleet.kernels` (Triton kernels) live in the repository's top-level folders; pyproject.toml maps them.

The offline API is importable from here as from vLLM (`from tokenfleet import LLM, SamplingParams`). The
names load on first use (module `__getattr__`): the operator imports this package and must never load
torch.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# name -> module that defines it; loaded on first attribute access.
_LAZY: dict[str, str] = {
    "LLM": "tokenfleet.runtime.engine.llm",
    "SamplingParams": "tokenfleet.runtime.engine.sampling_params",
    "RequestOutput": "tokenfleet.runtime.engine.offline_outputs",
    "CompletionOutput": "tokenfleet.runtime.engine.offline_outputs",
    "Logprob": "tokenfleet.runtime.engine.offline_outputs",
    "StructuredOutputsParams": "tokenfleet.runtime.engine.structured_output.spec",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'tokenfleet' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
