"""Converted weights cached on disk: the second load of a model maps them instead of converting the
checkpoint, gives the very same parameters, and a damaged, torn or foreign entry is rebuilt, never loaded."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from tokenfleet.runtime.config import ModelConfig
from tokenfleet.runtime.model import load_model
from tokenfleet.runtime.model import loader as loader_module
from tokenfleet.runtime.model.weight_cache import (
    ENTRIES_DIR,
    RECORD_FILE,
    WEIGHTS_FILE,
    WeightCache,
    cache_key,
    wait_for_writes,
)

from .tiny_checkpoints import write_hf_dir

CPU = torch.device("cpu")


@pytest.fixture
def tiny(tmp_path: Path, default_model_path: Path) -> Path:
    return write_hf_dir(tmp_path / "tiny", default_model_path, layers=2)


class _Conversions:
    """Counts the checkpoint reads a load makes (`Checkpoint.weights`): a cache hit makes none."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self.count = 0
        for kind, open_checkpoint in list(loader_module.CHECKPOINT_LOADERS.items()):
            monkeypatch.setitem(loader_module.CHECKPOINT_LOADERS, kind, self._wrap(open_checkpoint))

    def _wrap(self, open_checkpoint):
        def opened(path):
            checkpoint = open_checkpoint(path)

            def counted(*args, **kwargs):
                self.count += 1
                return checkpoint.weights(*args, **kwargs)

            return dataclasses.replace(checkpoint, weights=counted)

        return opened


def _load(model: str | Path, cache: Path | None, dtype: str = "float32"):
    config = ModelConfig(
        model=str(model),
        dtype=dtype,
        attention_backend="torch",
        weight_cache_dir=str(cache) if cache else None,
    )
    loaded = load_model(config, CPU)
    assert wait_for_writes(60)
    return loaded


def _entries(cache: Path) -> list[Path]:
    return sorted(p for p in (cache / ENTRIES_DIR).iterdir() if not p.name.startswith("."))


def _same_state(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert sa[name].dtype == sb[name].dtype and torch.equal(sa[name], sb[name]), name


def _mapped(path: Path) -> bool:
    return str(path.resolve()) in Path("/proc/self/maps").read_text()


def test_the_second_load_maps_the_entry_and_equals_a_conversion(tmp_path, default_model_path, monkeypatch):
    """The built-in GGUF (Q4_1 blocks dequantised, tied embeddings): the entry holds the converted tensors
    once each, the second load reads no checkpoint weights and its parameters are the file's pages."""
    cache = tmp_path / "cache"
    plain = _load(default_model_path, None)
    conversions = _Conversions(monkeypatch)
    first = _load(default_model_path, cache)
    assert conversions.count == 1
    (entry,) = _entries(cache)
    record = json.loads((entry / RECORD_FILE).read_text())
    assert record["aliases"] == {"lm_head.weight": "model.embed_tokens.weight"}
    with safe_open(entry / WEIGHTS_FILE, "pt") as f:  # a standard file: the library reads it
        names = set(f.keys())
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names

    second = _load(default_model_path, cache)
    assert conversions.count == 1  # no checkpoint weights read
    _same_state(plain.model, second.model)
    _same_state(first.model, second.model)
    assert second.model.lm_head.weight is second.model.model.embed_tokens.weight  # still tied
    assert _mapped(entry / WEIGHTS_FILE)
    pairs = list(zip(_rope(second), _rope(plain), strict=True))
    assert pairs and all(not m.cos.is_meta and torch.equal(m.cos, r.cos) for m, r in pairs)  # RoPE built


def _rope(loaded):
    return [m for m in loaded.model.modules() if isinstance(m, loader_module.RotaryEmbedding)]


def test_a_damaged_entry_is_rebuilt_never_loaded(tmp_path, tiny, monkeypatch, caplog):
    cache = tmp_path / "cache"
    plain = _load(tiny, cache)
    (entry,) = _entries(cache)
    weights = entry / WEIGHTS_FILE
    data = bytearray(weights.read_bytes())
    data[-5] ^= 0xFF  # one flipped bit pattern inside the last tensor: size unchanged
    weights.write_bytes(bytes(data))

    conversions = _Conversions(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="tokenfleet.runtime.model.weight_cache"):
        again = _load(tiny, cache)
    assert conversions.count == 1  # converted again
    assert "CRC-32 does not match" in caplog.text
    _same_state(plain.model, again.model)
    (rebuilt,) = _entries(cache)
    assert (rebuilt / WEIGHTS_FILE).read_bytes() != bytes(data)  # written anew

    third = _load(tiny, cache)
    assert conversions.count == 1
    _same_state(plain.model, third.model)


@pytest.mark.parametrize("damage", ["truncated", "no record", "garbled record"])
def test_a_torn_entry_is_rebuilt(tmp_path, tiny, monkeypatch, damage):
    cache = tmp_path / "cache"
    plain = _load(tiny, cache)
    (entry,) = _entries(cache)
    if damage == "truncated":
        os.truncate(entry / WEIGHTS_FILE, (entry / WEIGHTS_FILE).stat().st_size // 2)
    elif damage == "no record":
        (entry / RECORD_FILE).unlink()
    else:
        (entry / RECORD_FILE).write_text("{not json")
    conversions = _Conversions(monkeypatch)
    again = _load(tiny, cache)
    assert conversions.count == 1
    _same_state(plain.model, again.model)
    assert len(_entries(cache)) == 1


def test_an_entry_of_other_parameters_is_refused(tmp_path, tiny, default_model_path, monkeypatch, caplog):
    """Whatever sits under a key, only the model's own names, shapes and dtypes are assigned."""
    cache = tmp_path / "cache"
    other = _load(default_model_path, None)
    key = cache_key(tiny, torch.float32, CPU)
    WeightCache(cache).store(key, dict(other.model.state_dict()), "another model")
    conversions = _Conversions(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="tokenfleet.runtime.model.weight_cache"):
        loaded = _load(tiny, cache)
    assert conversions.count == 1
    assert "an entry of other parameters" in caplog.text  # removed, then written anew by this load
    assert loaded.model.model.embed_tokens.weight.shape[1] == 64  # the tiny model's own width
    again = _load(tiny, cache)
    assert conversions.count == 1  # the replacement entry is the tiny model's
    _same_state(loaded.model, again.model)


def test_the_key_follows_the_checkpoint_dtype_device_and_shard(tiny):
    key = cache_key(tiny, torch.float32, CPU)
    assert key == cache_key(tiny, torch.float32, CPU)
    assert key != cache_key(tiny, torch.bfloat16, CPU)
    assert key != cache_key(tiny, torch.float32, torch.device("cuda"))
    assert key != cache_key(tiny, torch.float32, CPU, tp_rank=1, tp_size=2)
    weights = next(tiny.glob("*.safetensors"))
    st = weights.stat()
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))  # rewritten in place
    assert key != cache_key(tiny, torch.float32, CPU)


def test_a_cache_that_cannot_be_written_costs_nothing_but_the_entry(tmp_path, tiny, caplog):
    blocked = tmp_path / "file-not-dir"
    blocked.write_text("")
    with caplog.at_level(logging.WARNING, logger="tokenfleet.runtime.model.weight_cache"):
        loaded = _load(tiny, blocked)
    assert loaded.model is not None
    assert "not written" in caplog.text


def test_bfloat16_entries_round_trip(tmp_path, tiny, monkeypatch):
    cache = tmp_path / "cache"
    plain = _load(tiny, cache, dtype="bfloat16")
    conversions = _Conversions(monkeypatch)
    again = _load(tiny, cache, dtype="bfloat16")
    assert conversions.count == 0
    assert again.model.model.embed_tokens.weight.dtype == torch.bfloat16
    _same_state(plain.model, again.model)


def test_tensor_parallel_shards_have_entries_of_their_own(tmp_path, tiny, monkeypatch):
    """Each rank maps its own shard (the key names it), equal to the shard a conversion slices out."""
    cache = tmp_path / "cache"

    def shard(rank: int, where: Path | None):
        config = ModelConfig(
            model=str(tiny),
            dtype="float32",
            attention_backend="torch",
            weight_cache_dir=str(where) if where else None,
        )
        loaded = load_model(config, CPU, tp_rank=rank, tp_size=2)
        assert wait_for_writes(60)
        return loaded

    plain = [shard(rank, None) for rank in (0, 1)]
    for rank in (0, 1):
        shard(rank, cache)
    assert len(_entries(cache)) == 2
    conversions = _Conversions(monkeypatch)
    for rank in (0, 1):
        _same_state(plain[rank].model, shard(rank, cache).model)
    assert conversions.count == 0


def test_a_fetched_models_key_has_its_verified_digests(tiny):
    """A model `tokenfleet fetch` downloaded is keyed by its files' sha256 too (its entry's manifest)."""
    from tokenfleet.runtime.model.fetch import MANIFEST

    plain = cache_key(tiny, torch.float32, CPU)
    manifest = {
        "version": 1,
        "commit": "c" * 40,
        "files": [{"name": "model.safetensors", "size": 1, "sha256": "a" * 64}],
    }
    (tiny / MANIFEST).write_text(json.dumps(manifest))
    fetched = cache_key(tiny, torch.float32, CPU)
    assert fetched != plain
    manifest["files"][0]["sha256"] = "b" * 64
    (tiny / MANIFEST).write_text(json.dumps(manifest))
    assert cache_key(tiny, torch.float32, CPU) not in (plain, fetched)
    (tiny / MANIFEST).write_text("{not json")  # what the fetch would refuse: the files' metadata alone
    assert cache_key(tiny, torch.float32, CPU) == plain
