"""Compiled decode steps: the model forward of a decode-only step under torch.compile, per padded batch bucket.

A decode step (every scheduled sequence brings one new token) is where serving spends its time, and with
small batches it is launch- and interpreter-bound: ~30 layers x a dozen small ops, each a Python call and a
kernel launch. Compiling the step removes the interpreter and fuses the elementwise work (norms, RoPE,
SiLU x up, residuals); on CUDA, `mode="reduce-overhead"` also captures it as a CUDA graph so one replay
launches the whole step.

Static shapes make that possible: a step of n sequences runs in the smallest bucket >= n, its inputs copied
into the bucket's own buffers and the rows past n padded (token 0 at position 0, a scratch KV slot outside
every real block, a context of one token). Attention goes through one traceable custom op per backend
(DecodeMetadata carries only device tensors), so nothing in the compiled region depends on host values
that change between steps. Prefill, mixed and speculative-verification steps stay eager: their shapes vary
with every step and their cost is dominated by large matmuls that compiling does not speed up. So do steps
that use LoRA adapters; the graphs are traced with the adapter hooks idle (no step batch set: they add
nothing), so a base-model decode step keeps its graph on a server that also serves adapters.

Greedy output is token-identical to eager (tests/runtime/test_compiled_decode.py): the same matmuls, in
the same order, on the same rows (padding rows never mix with real ones).
"""

from __future__ import annotations

import inspect
import logging
import os
import time
import types
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenfleet.runtime.errors import ConfigError
from tokenfleet.runtime.model.attention.base import AttentionMetadata, DecodeMetadata
from tokenfleet.runtime.model.llama import KVCache, LlamaForCausalLM

logger = logging.getLogger(__name__)

# Compiled artefacts (inductor's C++/Triton code, FX graph cache) live here, never in the checkout: a
# restart with the same model and buckets loads them instead of compiling again.
COMPILE_CACHE_DIR = Path.home() / ".cache" / "tokenfleet" / "inductor"


def default_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """Batch sizes compiled ahead: powers of two up to `max_num_seqs` (which is always one).

    Each bucket is a compile of the whole model at start-up, so few of them: a step pads to at most 2x its
    batch, which costs little because decode matmuls are bound by reading the weights, not by their rows.
    """
    sizes = {1 << i for i in range(max_num_seqs.bit_length()) if 1 << i <= max_num_seqs}
    sizes.add(max_num_seqs)
    return tuple(sorted(sizes))


def decode_buckets(max_num_seqs: int, sizes: Sequence[int] | None) -> tuple[int, ...]:
    """`model.compile_batch_sizes` up to `max_num_seqs` (larger steps never happen), or the default buckets.

    For a deployment (or a benchmark) that knows its batch sizes: every bucket is a whole-model compile at
    start-up, and one that no step uses is wasted minutes.
    """
    if sizes is None:
        return default_buckets(max_num_seqs)
    if not sizes or min(sizes) < 1:
        raise ValueError(f"decode buckets must be positive batch sizes, got {list(sizes)}")
    fitting = sorted({s for s in sizes if s <= max_num_seqs})
    if not fitting:
        raise ConfigError(
            f"model.compile_batch_sizes {sorted(set(sizes))}: none is <= scheduler.max_num_seqs={max_num_seqs}"
        )
    return tuple(fitting)


def unsupported_reason(model: LlamaForCausalLM, device: torch.device) -> str | None:
    """Why this model's decode step cannot be compiled on `device`, or None when it can."""
    arch = model.arch
    if arch.tp_size > 1:
        return "tensor parallelism (collectives are not captured)"
    if any(arch.is_moe_layer(i) for i in range(arch.num_layers)):
        return "MoE layers (routing sizes are data-dependent)"
    if any(type(m).__name__ == "Fp8Linear" for m in model.modules()):
        return "fp8 weights (the fp8 GEMM is not a registered op)"
    backend = model.model.layers[0].self_attn.backend
    if not getattr(backend, "traceable_decode", False):
        return f"the {backend.name} attention backend has no traceable decode op"
    if device.type == "cuda" and getattr(backend, "decode_reads_host", False):
        # The op reads a figure back to the host every step; a CUDA-graph capture fails on that sync.
        return (
            f"model.attention_backend {backend.name!r} reads a host value in its decode op, which a CUDA "
            "graph cannot capture (use attention_backend 'triton' on CUDA)"
        )
    return None


def should_compile(setting: str, device: torch.device, model: LlamaForCausalLM) -> bool:
    """`model.compile`: off; auto = on CUDA when supported; on = wherever supported, else a ConfigError."""
    if setting == "off":
        return False
    reason = unsupported_reason(model, device)
    if setting == "on" and reason is not None:
        raise ConfigError(f"model.compile is 'on' but this model cannot be compiled: {reason}")
    if setting == "auto" and (device.type != "cuda" or reason is not None):
        if device.type == "cuda":
            logger.info("decode steps run eagerly: %s", reason)
        return False
    return True


@dataclass(frozen=True, slots=True)
class _Bucket:
    """One batch size's static inputs: a step copies its rows in and pads the rest."""

    size: int
    input_ids: torch.Tensor  # int64 [size]
    positions: torch.Tensor  # int64 [size]
    meta: DecodeMetadata


def _meta_tensors(meta: DecodeMetadata) -> tuple[torch.Tensor, ...]:
    return (meta.slot_mapping, meta.block_tables, meta.seq_lens)


def _decode_logits(
    model: LlamaForCausalLM,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    kv_caches: list[KVCache],
    meta: DecodeMetadata,
) -> torch.Tensor:
    """The compiled region: the whole model and the LM head over every row of the bucket."""
    return model.compute_logits(model(input_ids, positions, kv_caches, meta))


def _own_copy(fn: types.FunctionType) -> types.FunctionType:
    """`fn` with a code object of its own.

    Dynamo keeps compiled graphs on the code object of the function it compiles. Compiling one shared
    function would pile every engine's graphs in the process into one cache, checked against one recompile
    limit (a third engine with other KV-cache shapes would soon hit it: an error with fullgraph=True), and
    nothing would ever drop the graphs of an engine that is gone. A copy per instance gives each engine
    its own cache, sized to its buckets, that goes away with it.
    """
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__)


def _recompile_limit(limit: int) -> dict[str, int]:
    """torch.compile's per-call `recompile_limit` where torch has it (2.13); older releases (the GPU
    machines run 2.11) only have dynamo's process-wide limit, which is per code object too, so raising it
    to this instance's need is equivalent."""
    if "recompile_limit" in inspect.signature(torch.compile).parameters:
        return {"recompile_limit": limit}
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), limit))
    return {}


def _drop_graphs(code: types.CodeType) -> None:
    # The code object may outlive the instance (dynamo's log of guard failures refers to it); the
    # compiled graphs stored on it must not.
    torch._C._dynamo.eval_frame.reset_code(code)


class CompiledDecode:
    """Runs decode-only steps of up to `max(buckets)` sequences through the compiled model.

    `scratch_slot`: a flat KV slot no request owns (the runner allocates one spare block for it); padding
    rows write their K/V there. `backend`: torch.compile's backend (tests pass a cheap one, e.g. "eager").
    Its compiled graphs are its own and are dropped by `close()` or when it is garbage-collected.
    """

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: list[KVCache],
        device: torch.device,
        *,
        buckets: Sequence[int],
        max_blocks_per_seq: int,
        scratch_slot: int,
        backend: str = "inductor",
    ):
        if not buckets or min(buckets) < 1:
            raise ValueError(f"decode buckets must be positive batch sizes, got {buckets}")
        self.model = model
        self.kv_caches = kv_caches
        self.device = device
        self.scratch_slot = scratch_slot
        self._buckets = {size: self._make_bucket(size, max_blocks_per_seq) for size in sorted(set(buckets))}
        # Tensors that keep their address for the engine's life: a CUDA graph reads and writes them in place
        # (without this, inductor refuses to capture a graph that mutates an input: the KV caches).
        for k_cache, v_cache in kv_caches:
            torch._dynamo.mark_static_address(k_cache)
            torch._dynamo.mark_static_address(v_cache)
        for bucket in self._buckets.values():
            for t in (bucket.input_ids, bucket.positions, *_meta_tensors(bucket.meta)):
                torch._dynamo.mark_static_address(t)
        self.max_batch = max(self._buckets)
        self.max_blocks_per_seq = max_blocks_per_seq
        self.num_steps = 0  # decode steps served compiled (for stats and tests)
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(COMPILE_CACHE_DIR))
        # CUDA graphs on CUDA (one replay per step); inductor's fused C++ kernels on CPU.
        mode = "reduce-overhead" if device.type == "cuda" and backend == "inductor" else None
        step = _own_copy(_decode_logits)
        # Static shapes: one graph per bucket. (A symbolic batch size would need one compile only, but
        # inductor failed on it for this model in torch 2.13: an AssertionError in its sympy handling.)
        # The limit counts this instance's graphs only (its own code object): one per bucket, and room for
        # as many unforeseen recompiles again before fullgraph=True makes the next one an error.
        limit = 2 * len(self._buckets)
        self._compiled = torch.compile(
            step, backend=backend, mode=mode, dynamic=False, fullgraph=True, **_recompile_limit(limit)
        )
        self._code = step.__code__
        self._release = weakref.finalize(self, _drop_graphs, step.__code__)

    @property
    def buckets(self) -> tuple[int, ...]:
        return tuple(self._buckets)

    @property
    def num_graphs(self) -> int:
        """Graphs dynamo holds for this instance: one per bucket once warmed up, none after `close()`."""
        return len(torch._dynamo.eval_frame._debug_get_cache_entry_list(self._code))

    def close(self) -> None:
        """Drop the compiled graphs now rather than at garbage collection (a later step would compile anew)."""
        self._release()

    def _make_bucket(self, size: int, max_blocks: int) -> _Bucket:
        dev = self.device
        return _Bucket(
            size=size,
            input_ids=torch.zeros(size, dtype=torch.int64, device=dev),
            positions=torch.zeros(size, dtype=torch.int64, device=dev),
            meta=DecodeMetadata(
                slot_mapping=torch.full((size,), self.scratch_slot, dtype=torch.int64, device=dev),
                block_tables=torch.zeros((size, max_blocks), dtype=torch.int32, device=dev),
                seq_lens=torch.ones(size, dtype=torch.int32, device=dev),
            ),
        )

    def supports(self, meta: AttentionMetadata) -> bool:
        """A step it can run: one new token per sequence, at most the largest bucket, tables that fit."""
        return (
            meta.is_all_decode
            and 0 < meta.num_seqs <= self.max_batch
            and meta.block_tables.shape[1] <= self.max_blocks_per_seq
        )

    def bucket_for(self, num_seqs: int) -> int:
        return next(size for size in self._buckets if size >= num_seqs)

    def logits(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """fp32 logits [n, V] of a decode step of n sequences (row i: sequence i's token)."""
        n = meta.num_seqs
        bucket = self._buckets[self.bucket_for(n)]
        self._fill(bucket, input_ids, positions, meta)
        self.num_steps += 1
        out = self._compiled(self.model, bucket.input_ids, bucket.positions, self.kv_caches, bucket.meta)
        # Cut the padding off: a copy, since a CUDA-graph replay owns (and will overwrite) its output.
        return out[:n].clone()

    def _fill(
        self, bucket: _Bucket, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> None:
        n, width = meta.num_seqs, meta.block_tables.shape[1]
        static = bucket.meta
        bucket.input_ids[:n].copy_(input_ids)
        bucket.positions[:n].copy_(positions)
        static.slot_mapping[:n].copy_(meta.slot_mapping)
        static.block_tables[:n, :width].copy_(meta.block_tables)
        static.seq_lens[:n].copy_(meta.seq_lens)
        if n < bucket.size:  # rows a previous, larger step left: back to padding
            bucket.input_ids[n:].zero_()
            bucket.positions[n:].zero_()
            static.slot_mapping[n:].fill_(self.scratch_slot)
            static.seq_lens[n:].fill_(1)
        # Columns past this step's table are never read: attention stops at each row's seq_len.

    def warm_up(self) -> float:
        """Compile (or load from the cache) every bucket by running it on padding rows; returns seconds."""
        start = time.perf_counter()
        with torch.inference_mode():
            for size, bucket in self._buckets.items():
                t = time.perf_counter()
                # CUDA-graph trees run a new graph once eagerly, then record it: three calls leave it replaying.
                for _ in range(3 if self.device.type == "cuda" else 1):
                    self._compiled(
                        self.model, bucket.input_ids, bucket.positions, self.kv_caches, bucket.meta
                    )
                logger.debug("decode bucket %d compiled in %.1f s", size, time.perf_counter() - t)
        return time.perf_counter() - start
