"""What the cold-start path relies on: lazy xgrammar, in-place dequantisation, lazily-paged zero KV memory,
and the startup log line the bench reads."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import numpy as np
import pytest
import torch
from gguf.constants import GGML_QUANT_SIZES
from gguf.constants import GGMLQuantizationType as Q
from gguf.quants import dequantize as gguf_dequantize
from tokenfleet.runtime import startup_timing
from tokenfleet.runtime.engine.kv_cache.kv_tensors import allocate_kv_caches, zeroed_cpu_tensor
from tokenfleet.runtime.model.attention.torch_backend import _store
from tokenfleet.runtime.model.dequant import dequantize


def test_serve_path_does_not_import_xgrammar():
    # A fresh interpreter: this test process may already have imported xgrammar through other tests.
    code = (
        "import sys\n"
        "import tokenfleet.runtime.server.main, tokenfleet.runtime.server.app\n"
        "import tokenfleet.runtime.engine.async_engine, tokenfleet.runtime.engine.structured_output.compiler\n"
        "print(sorted(m for m in ('xgrammar', 'transformers') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_grammar_compiles_after_lazy_import(default_model):
    from tokenfleet.runtime.engine.structured_output.compiler import GrammarCompiler
    from tokenfleet.runtime.engine.structured_output.spec import GrammarSpec
    from tokenfleet.runtime.engine.structured_output.state import apply_token_bitmask, grammar_bitmask

    vocab = default_model.arch.vocab_size
    compiler = GrammarCompiler(default_model.tokenizer, vocab)
    state = compiler.new_state(GrammarSpec("choice", json.dumps(["yes", "no"])))
    bitmask = grammar_bitmask([(state, [])], vocab)
    logits = apply_token_bitmask(torch.zeros(1, vocab), bitmask, [0])
    allowed = torch.isfinite(logits[0]).nonzero().flatten().tolist()
    assert 0 < len(allowed) < vocab
    # Every allowed first token starts one of the choices.
    texts = [default_model.tokenizer.decode([t]) for t in allowed]
    assert all("yes".startswith(t) or "no".startswith(t) for t in texts), texts


def _random_blocks(qtype: Q, rows: int, blocks_per_row: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    block_bytes = GGML_QUANT_SIZES[qtype][1]
    raw = rng.integers(0, 256, (rows * blocks_per_row, block_bytes), dtype=np.uint8)
    # Finite f16 scale (and min, for Q4_1) in the first bytes of each block; the codes stay random.
    n_halves = 2 if qtype == Q.Q4_1 else 1
    halves = rng.standard_normal((raw.shape[0], n_halves)).astype(np.float16)
    raw[:, : 2 * n_halves] = halves.view(np.uint8).reshape(raw.shape[0], 2 * n_halves)
    return raw.reshape(rows, blocks_per_row * block_bytes)


def _out_of_place(raw: np.ndarray, qtype: Q) -> torch.Tensor:
    """The previous implementation: one fp32 temporary per arithmetic step."""
    b = torch.from_numpy(np.array(raw, dtype=np.uint8).reshape(-1, GGML_QUANT_SIZES[qtype][1]))

    def f16(start):
        return b[:, start : start + 2].contiguous().view(torch.float16).float()

    def nibbles(qs):
        return torch.cat((qs & 0x0F, qs >> 4), dim=1).float()

    if qtype == Q.Q8_0:
        return f16(0) * b[:, 2:].contiguous().view(torch.int8).float()
    if qtype == Q.Q4_0:
        return f16(0) * (nibbles(b[:, 2:]) - 8.0)
    return f16(0) * nibbles(b[:, 4:]) + f16(2)


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1])
def test_dequant_in_place_is_bit_identical(qtype):
    rows, per_row = 24, 7
    raw = _random_blocks(qtype, rows, per_row, seed=int(qtype))
    shape = (rows, per_row * GGML_QUANT_SIZES[qtype][0])
    ours = dequantize(raw, qtype, shape)
    assert ours.shape == shape and ours.dtype == torch.float32 and ours.is_contiguous()
    assert torch.equal(ours, _out_of_place(raw, qtype).reshape(shape))
    reference = torch.from_numpy(gguf_dequantize(raw, qtype).astype(np.float32)).reshape(shape)
    assert torch.equal(ours, reference)


def test_dequant_reads_a_read_only_memmap(tmp_path):
    raw = _random_blocks(Q.Q4_1, 8, 3, seed=5)
    path = tmp_path / "w.bin"
    raw.tofile(path)
    mapped = np.memmap(path, dtype=np.uint8, mode="r").reshape(raw.shape)
    assert torch.equal(dequantize(mapped, Q.Q4_1, (8, 96)), dequantize(raw.copy(), Q.Q4_1, (8, 96)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_cpu_kv_caches_start_zero_and_are_writable(dtype):
    shape = (5, 16, 3, 8)
    caches = allocate_kv_caches(2, shape, dtype, torch.device("cpu"))
    assert len(caches) == 2
    tensors = [t for kv in caches for t in kv]
    assert len({t.data_ptr() for t in tensors}) == 4  # separate memory per layer and K/V
    for t in tensors:
        assert t.shape == shape and t.dtype == dtype and t.is_contiguous()
        assert not t.float().any()
    k = caches[0][0]
    _store(torch.ones(1, 3, 8), k, torch.tensor([17]), 1.0)  # the torch backend's KV write
    assert k.float().sum().item() == 24
    assert not caches[0][1].float().any() and not caches[1][0].float().any()


def test_mmap_tensor_outlives_its_allocator_reference():
    view = zeroed_cpu_tensor((4, 1024), torch.float32)[2]  # the base tensor is dropped at once
    view.fill_(3.0)
    assert view.sum().item() == 3.0 * 1024


def test_startup_phases_sum_and_parse(caplog):
    startup_timing.reset()
    startup_timing.mark("imports")
    startup_timing.add("dequant", 0.25)  # counted inside the next mark's interval, not twice
    startup_timing.mark("weights")
    with caplog.at_level(logging.INFO, logger="tokenfleet.startup"):
        record = startup_timing.report()
        assert startup_timing.report() is None  # once per process
    assert list(record["phases"]) == ["imports", "dequant", "weights"]
    assert record["phases"]["dequant"] == 0.25
    assert record["phases"]["weights"] == 0.0  # less time passed than add() claimed: clamped, not negative
    line = next(r.getMessage() for r in caplog.records if r.name == "tokenfleet.startup")
    assert startup_timing.parse_line("2026-01-01 INFO tokenfleet.startup: " + line) == record
    assert startup_timing.parse_line("startup: not json") is None
    assert startup_timing.parse_line("unrelated line") is None


def test_process_start_origin_precedes_import():
    # The origin is the kernel's start time of this process: before the module was even imported.
    code = (
        "import time; t = time.monotonic()\n"
        "from tokenfleet.runtime import startup_timing as s\n"
        "print(s._origin <= t, t - s._origin)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    before, age = out.stdout.split()
    assert before == "True" and 0.0 <= float(age) < 60.0


def test_model_load_skips_meta_init_imports_and_restores_threads():
    # Building on the meta device runs no initialisers and no meta-tensor references: those import
    # torch._dynamo and sympy, seconds of a cold start. The load's thread setting does not leak.
    code = (
        "import sys, torch\n"
        "from tokenfleet.runtime.config import ModelConfig\n"
        "from tokenfleet.runtime.model import load_model\n"
        "torch.set_num_threads(2)\n"
        "loaded = load_model(ModelConfig(), torch.device('cpu'))\n"
        "print(sorted(m for m in ('torch._dynamo', 'sympy') if m in sys.modules), torch.get_num_threads())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split("\n")[-2] == "[] 2", out.stdout + out.stderr


def test_meta_build_skips_initialisers_but_not_real_tensors():
    from tokenfleet.runtime.model.loader import _SkipInitOnMeta

    with torch.device("meta"), _SkipInitOnMeta():
        emb = torch.nn.Embedding(8, 4)
        real = torch.nn.init.constant_(torch.empty(3, device="cpu"), 2.0)  # not on meta: runs
    assert emb.weight.is_meta
    assert real.tolist() == [2.0, 2.0, 2.0]
