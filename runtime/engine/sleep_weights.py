"""The model's weights in sleep mode: moved to host memory (level 1) or discarded and reloaded (level 2).

Works on storages, not on parameters: every tensor of the model (tied embeddings, views, fp8 scales
registered as buffers) keeps its Python object and its view onto the same storage; only the storage's
memory comes and goes. So the model, a self-draft that shares its layers and a compiled step's references
stay valid without being rebuilt (CUDA graphs still are: their addresses change, see ModelRunner.wake_up).

The storages are collected once, in the module's registration order, before anything is freed: a freed
storage has no address to deduplicate by, and a fresh model built by the same loader lists its storages
in the same order, which is how level 2 pairs the reloaded weights with the sleeping ones.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import itertools

import torch


def model_storages(model: torch.nn.Module) -> list[torch.UntypedStorage]:
    """Each distinct storage behind the model's parameters and buffers, in registration order."""
    seen: set[int] = set()
    out: list[torch.UntypedStorage] = []
    for _, t in itertools.chain(model.named_parameters(), model.named_buffers()):
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if storage.nbytes() == 0 or ptr in seen:
            continue
        seen.add(ptr)
        out.append(storage)
    return out


class SleepingWeights:
    """What sleep took from the model's storages, and how to give it back."""

    def __init__(self, storages: list[torch.UntypedStorage], host: list[torch.UntypedStorage] | None):
        self.storages = storages
        self.sizes = [s.nbytes() for s in storages]
        self.host = host  # level 1 on an accelerator: the bytes, in (pinned) host memory

    @property
    def nbytes(self) -> int:
        return sum(self.sizes)

    @classmethod
    def offload(cls, model: torch.nn.Module) -> SleepingWeights:
        """Level 1 on an accelerator: copy every storage to pinned host memory, then free device memory."""
        storages = model_storages(model)
        host = []
        for s in storages:
            copy = torch.UntypedStorage(s.nbytes(), device="cpu")
            copy = copy.pin_memory() if torch.cuda.is_available() else copy
            copy.copy_(s)
            host.append(copy)
        sleeping = cls(storages, host)
        for s in storages:
            s.resize_(0)
        _empty_cache(storages)
        return sleeping

    @classmethod
    def discard(cls, model: torch.nn.Module) -> SleepingWeights:
        """Level 2: free every storage; `restore` needs the reloaded model."""
        storages = model_storages(model)
        sleeping = cls(storages, None)
        for s in storages:
            s.resize_(0)
        _empty_cache(storages)
        return sleeping

    def restore(self, fresh: torch.nn.Module | None = None) -> None:
        """Back into the same storages: from the host copy (level 1) or from `fresh`, the model loaded anew
        from its source (level 2), whose storages must line up one for one."""
        sources = self.host
        if sources is None:
            if fresh is None:
                raise ValueError("the weights were discarded: restoring them needs the reloaded model")
            sources = model_storages(fresh)
            if [s.nbytes() for s in sources] != self.sizes:
                raise RuntimeError("the reloaded model's weights do not match the sleeping model's layout")
        for storage, size, source in zip(self.storages, self.sizes, sources, strict=True):
            storage.resize_(size)
            storage.copy_(source)
        self.host = None


def _empty_cache(storages: list[torch.UntypedStorage]) -> None:
    if any(s.device.type == "cuda" for s in storages):
        torch.cuda.empty_cache()
    if any(s.device.type == "cpu" for s in storages):
        release_host_heap()


def release_host_heap() -> None:
    """glibc keeps freed heap chunks (weights below its adaptive mmap threshold) mapped: hand them back."""
    name = ctypes.util.find_library("c")
    # Not glibc: the memory is reused by later allocations, just not returned.
    with contextlib.suppress(OSError, AttributeError, TypeError):
        ctypes.CDLL(name).malloc_trim(0)
