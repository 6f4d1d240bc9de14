"""load_model: ModelConfig -> a ready LlamaForCausalLM on the device, with its tokenizer and shape."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tokenfleet.runtime import startup_timing
from tokenfleet.runtime.config import ModelConfig
from tokenfleet.runtime.errors import ConfigError
from tokenfleet.runtime.model import (
    gemma2,  # noqa: F401 (registers DECODER_LAYERS["gemma2"], Gemma 2's and 3's layer)
    moe,  # noqa: F401 (registers MLP_BUILDERS["moe"])
)
from tokenfleet.runtime.model.arch import ModelArch
from tokenfleet.runtime.model.attention.base import get_attention_backend, resolve_backend_name
from tokenfleet.runtime.model.checkpoint import Checkpoint
from tokenfleet.runtime.model.fp8 import quantize_model_fp8
from tokenfleet.runtime.model.generation_defaults import GenerationDefaults, read_generation_defaults
from tokenfleet.runtime.model.gguf_loader import load_gguf
from tokenfleet.runtime.model.llama import LlamaForCausalLM
from tokenfleet.runtime.model.rope import RotaryEmbedding
from tokenfleet.runtime.model.safetensors_loader import load_hf_dir
from tokenfleet.runtime.model.source import resolve_source
from tokenfleet.runtime.model.tensor_parallel import (
    keep_row_parallel_biases_on_rank_0,
    shard_arch,
    shard_slice,
)
from tokenfleet.runtime.model.tokenizer import Tokenizer
from tokenfleet.runtime.model.weight_cache import WeightCache, WeightCacheError, cache_key
from torch.overrides import TorchFunctionMode

log = logging.getLogger(__name__)

# source kind -> reader of that format
CHECKPOINT_LOADERS: dict[str, Callable[[Path], Checkpoint]] = {"gguf": load_gguf, "hf_dir": load_hf_dir}

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

ProgressFn = Callable[[int, int], None]  # (weights loaded, total)


@dataclass(frozen=True, slots=True)
class LoadedModel:
    model: LlamaForCausalLM
    arch: ModelArch
    tokenizer: Tokenizer
    name: str  # the name clients use (served_name or the model string)
    max_model_len: int
    dtype: torch.dtype
    attention_backend: str
    generation_defaults: GenerationDefaults = field(default_factory=GenerationDefaults)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """`auto`: fp32 on CPU (no fast bf16 matmul on most CPUs, and exact vs references), bf16 on CUDA."""
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[dtype]


def resolve_max_model_len(arch: ModelArch, requested: int | None) -> int:
    limit = arch.max_position_embeddings
    if requested is None:
        return limit
    if requested > limit:
        raise ConfigError(f"max_model_len {requested} exceeds the model's context length {limit}")
    return requested


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


# In-place initialisers modules run in their constructors: torch.nn.init's functions (what nn layers call)
# and the tensor methods behind them.
_INIT_METHODS = frozenset(
    {
        torch.Tensor.normal_,
        torch.Tensor.uniform_,
        torch.Tensor.zero_,
        torch.Tensor.fill_,
        torch.Tensor.random_,
    }
)


class _SkipInitOnMeta(TorchFunctionMode):
    """Skip parameter initialisers while building on the meta device, where they compute nothing.

    They are not free there: a meta `normal_` (nn.Embedding's init) runs torch's Python reference, whose
    first call imports torch._dynamo — ~1 s of cold start on 2 cores, for values that do not exist.
    Thread-local, like the meta device context it sits in.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _INIT_METHODS or getattr(func, "__module__", None) == "torch.nn.init":
            tensor = args[0] if args else kwargs.get("tensor")  # nn.init passes it by keyword
            if getattr(tensor, "is_meta", False):
                return tensor
        return func(*args, **kwargs)


@contextlib.contextmanager
def _load_threads() -> Iterator[None]:
    """Half the process's cores (at least one) for torch while the weights are converted and copied in.

    That work is elementwise and memory-bound: half the cores already take the memory bandwidth, and the
    rest stay free for the event loop answering probes and for whatever shares the machine. On a busy
    2-core machine the difference is large (OpenMP threads spin at each op's barrier while a preempted
    peer is off-core): the built-in model's dequantisation took 4.3 s with 2 threads, 0.6 s with 1.
    """
    previous = torch.get_num_threads()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    torch.set_num_threads(max(1, min(previous, cores // 2)))
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _tracked(weights: Iterator[tuple[str, torch.Tensor]], total: int, progress: ProgressFn | None):
    for done, item in enumerate(weights, 1):
        yield item
        startup_timing.weights(done, total)  # the server's /ready and log say how far a load is
        if progress is not None:
            progress(done, total)


def _set_kernel_backend(model: torch.nn.Module, backend_name: str) -> None:
    """MoE and FP8 layers use the attention backend's kernel family: Triton kernels or torch references."""
    kernel_backend = backend_name if backend_name in ("torch", "triton") else "auto"
    for module in model.modules():
        if hasattr(module, "kernel_backend"):
            module.kernel_backend = kernel_backend


def build_rope_tables(model: torch.nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):  # every RoPE table (Gemma 3 has two)
            module.build_tables()


def assign_cached(model: torch.nn.Module, tensors: dict[str, torch.Tensor], device: torch.device) -> None:
    """Make a meta-built model's parameters the cached tensors themselves (no copy), then give its
    non-persistent buffers (the RoPE tables) memory and values. WeightCacheError when the entry is not
    exactly this model's state (names, shapes, dtypes): it is then converted again."""
    expected = model.state_dict()
    if set(expected) != set(tensors):
        missing, extra = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
        raise WeightCacheError(f"an entry of other parameters (missing {missing[:3]}, extra {extra[:3]})")
    for name, want in expected.items():
        got = tensors[name]
        if got.shape != want.shape or got.dtype != want.dtype:
            raise WeightCacheError(f"an entry whose {name} is {got.dtype}{list(got.shape)}")
    try:
        model.load_state_dict(tensors, strict=True, assign=True)
    except RuntimeError as e:  # what the checks above did not foresee: still only a miss
        raise WeightCacheError(f"an entry the model refused ({e})") from None
    model.tie_weights()
    for module in model.modules():
        for name, buf in module._buffers.items():
            if buf is not None and buf.is_meta:
                module._buffers[name] = torch.empty_strided(
                    buf.size(), buf.stride(), dtype=buf.dtype, device=device
                )
    build_rope_tables(model)


def load_model(
    model_config: ModelConfig,
    device: torch.device | str,
    progress: ProgressFn | None = None,
    tp_rank: int = 0,
    tp_size: int = 1,
) -> LoadedModel:
    """The model (with `tp_size` > 1: shard `tp_rank` of it, read slice by slice from the checkpoint;
    `LoadedModel.arch` stays the whole model's shape, `model.arch` is the shard's)."""
    device = torch.device(device)
    startup_timing.mark("engine_init")
    source = resolve_source(model_config.model)
    startup_timing.mark("model_resolve")
    checkpoint = CHECKPOINT_LOADERS[source.kind](source.path)
    startup_timing.mark("checkpoint_open")
    arch = checkpoint.arch
    shard = shard_arch(arch, tp_rank, tp_size)  # raises ConfigError when the model cannot be split so
    select = None if tp_size == 1 else functools.partial(shard_slice, full=arch, rank=tp_rank, size=tp_size)
    dtype = resolve_dtype(model_config.dtype, device)
    max_model_len = resolve_max_model_len(arch, model_config.max_model_len)
    backend_name = resolve_backend_name(model_config.attention_backend, device)
    backend = get_attention_backend(backend_name)

    cache = WeightCache(Path(model_config.weight_cache_dir)) if model_config.weight_cache_dir else None
    key = cache_key(source.path, dtype, device, tp_rank, tp_size) if cache is not None else ""
    max_positions = max(max_model_len, arch.max_position_embeddings)

    def build() -> LlamaForCausalLM:
        # On the meta device: no random init of weights about to be overwritten, no memory yet.
        with torch.device("meta"), _default_dtype(dtype), _SkipInitOnMeta():
            return LlamaForCausalLM(shard, backend, max_positions=max_positions)

    model = build()
    cached = False
    if cache is not None:
        try:
            tensors = cache.load(key, device)
        except WeightCacheError as e:
            log.info("weight cache: %s for %s: converting the checkpoint", e, source.path)
        else:
            try:
                assign_cached(model, tensors, device)
                cached = True
            except WeightCacheError as e:  # whatever wrote it, it is not this model's: replaced below
                cache.remove(key, str(e))
                model = build()  # a refused entry may have assigned some parameters already
            del tensors
        startup_timing.mark("weight_cache")
    if not cached:
        # Given uninitialised memory on the device in the target dtype: load_weights refuses a checkpoint
        # that leaves any parameter unwritten, so no garbage survives. Module.to_empty, minus its
        # empty_like of meta tensors: that runs torch's Python reference, whose first call imports sympy
        # (~0.7 s on 2 cores). Same result: uninitialised memory of each tensor's layout.
        model._apply(lambda t: torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=device))
        model.tie_weights()  # to_empty unties shared parameters
        build_rope_tables(model)
        startup_timing.mark("model_build")
        # The checkpoint's reader counts its own parts (weight_read, dequant); the rest is the copy in.
        with _load_threads():
            model.load_weights(_tracked(checkpoint.weights(select), checkpoint.num_weights, progress))
        startup_timing.mark("weight_copy")
    if tp_size > 1:
        keep_row_parallel_biases_on_rank_0(model, tp_rank)
    if cache is not None and not cached:
        # As loaded (before fp8, which is applied on every load): the next process on this volume maps it.
        cache.store_in_background(key, dict(model.state_dict()), str(source.path))
    model.eval().requires_grad_(False)
    if model_config.quantization == "fp8":
        saved = quantize_model_fp8(model)
        log.info("fp8: quantised the projections on load, %.1f MiB of weights saved", saved / 2**20)
    _set_kernel_backend(model, backend_name)
    log.info(
        "loaded %s (%s, %d layers) on %s as %s, attention=%s, max_model_len=%d%s",
        model_config.model, arch.model_type, arch.num_layers, device, dtype, backend_name, max_model_len,
        f", torch threads: {torch.get_num_threads()}" if device.type == "cpu" else "",
    )  # fmt: skip
    startup_timing.mark("model_finish")
    return LoadedModel(
        model=model,
        arch=arch,
        tokenizer=checkpoint.tokenizer,
        name=model_config.name,
        max_model_len=max_model_len,
        dtype=dtype,
        attention_backend=backend_name,
        generation_defaults=read_generation_defaults(source),
    )
