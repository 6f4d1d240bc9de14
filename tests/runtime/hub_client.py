"""The fake Hub (e2e/fake_hub.py: what huggingface_hub asks for, every request counted) served on loopback,
and this process's huggingface_hub client pointed at it.

The fake lives beside the e2e harness, whose cluster's pods download from the same one; it is loaded by
path, so neither folder goes on sys.path.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


def _load_fake_hub():
    path = Path(__file__).resolve().parents[2] / "e2e" / "fake_hub.py"
    if "fake_hub" in sys.modules:
        return sys.modules["fake_hub"]
    spec = importlib.util.spec_from_file_location("fake_hub", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


fake_hub = _load_fake_hub()
FakeHub, FakeRepo, serve_hub = fake_hub.FakeHub, fake_hub.FakeRepo, fake_hub.serve_hub


def hub_env(url: str, tmp_path: Path) -> dict[str, str]:
    """The environment a process (a pod's container) downloads from the Hub at `url` with."""
    return {
        "HF_ENDPOINT": url,
        "HF_HOME": str(tmp_path / "hf-home"),
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "NO_PROXY": "127.0.0.1",
    }


@contextmanager
def client_pointed_at(mp: pytest.MonkeyPatch, url: str, tmp_path: Path) -> Iterator[None]:
    """This process's huggingface_hub asks the Hub at `url`, with no token, until the context ends."""
    for key, value in hub_env(url, tmp_path).items():
        mp.setenv(key, value)
    for key in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_TOKEN"):
        mp.delenv(key, raising=False)
    # huggingface_hub reads HF_ENDPOINT once, when imported: this process imported it long before.
    from huggingface_hub import constants

    mp.setattr(constants, "ENDPOINT", url)
    mp.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", url + "/{repo_id}/resolve/{revision}/{filename}")
    mp.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf-home" / "hub"))
    yield
