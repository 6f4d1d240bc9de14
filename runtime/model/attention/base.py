"""The attention-backend contract: metadata of one flattened step, the backend interface, the registry.

A step is a flat batch of T new tokens from B sequences (no padding). Sequence b owns query rows
`query_start_loc[b] : query_start_loc[b + 1]`; its context (cached tokens + the new ones) is `seq_lens[b]`
tokens long and lives in the paged KV cache at the blocks listed in `block_tables[b]`. The new tokens of a
sequence are always its last ones, so query row i of sequence b sits at position
`seq_lens[b] - query_lens[b] + i` (this is what makes chunked prefill and prefix-cache hits work).
"""

from __future__ import annotations

import abc
import importlib
from dataclasses import dataclass

import torch
from tokenfleet.runtime.errors import ConfigError


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    slot_mapping: (
        torch.Tensor
    )  # int64 [T]: flat cache slot (block_id * block_size + offset) of each new token
    query_start_loc: torch.Tensor  # int32 [B + 1]: cumulative query lengths
    seq_lens: torch.Tensor  # int32 [B]: context length of each sequence after this step
    block_tables: torch.Tensor  # int32 [B, max_blocks]: physical block ids, padded with 0 past seq_lens
    max_query_len: int
    max_seq_len: int
    # The same figures as CPU lists, so backends can plan without a device -> host sync.
    query_lens: tuple[int, ...]
    seq_lens_list: tuple[int, ...]

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])

    @property
    def is_all_decode(self) -> bool:
        """Every sequence brings exactly one new token (the steady state of a serving engine)."""
        return self.max_query_len == 1


@dataclass(frozen=True, slots=True)
class DecodeMetadata:
    """A decode-only step (one new token per sequence) with static shapes: tensors only, no host lists.

    What a compiled or graph-captured decode step passes to attention: every figure a launch needs is on the
    device, so nothing in the captured region reads host values that change from step to step. Rows past
    the real batch are padding: their slot is a scratch slot outside every real block and their seq_len 1.
    `block_tables` is as wide as the longest context the engine allows.
    """

    slot_mapping: torch.Tensor  # int64 [B]
    block_tables: torch.Tensor  # int32 [B, max_blocks_per_seq]
    seq_lens: torch.Tensor  # int32 [B]


class AttentionBackend(abc.ABC):
    """Writes the step's new K/V into the paged cache, then attends over each sequence's whole context."""

    name: str
    # Whether `forward` with DecodeMetadata is one traceable op (a compiled decode step can call it).
    traceable_decode: bool = False

    @abc.abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        meta: AttentionMetadata | DecodeMetadata,
        scale: float,
        softcap: float | None = None,
        sliding_window: int | None = None,
    ) -> torch.Tensor:  # [T, Hq, D], dtype of q
        """`DecodeMetadata` (a compiled decode step) must go through one traceable custom op.

        Gemma 2's per-layer options, None = off: `softcap` caps the scores (softcap * tanh(s / softcap))
        before the mask; `sliding_window` W lets a query at position p see keys p - W + 1 .. p only."""


# name -> "module:Class". Import paths rather than classes: a backend's module (Triton) may only import on
# machines that can run it. Register a backend with one entry here.
ATTENTION_BACKENDS: dict[str, str] = {
    "torch": "tokenfleet.runtime.model.attention.torch_backend:TorchAttentionBackend",
    "triton": "tokenfleet.runtime.model.attention.triton_backend:TritonAttentionBackend",
}


def resolve_backend_name(name: str, device: torch.device) -> str:
    """`auto` picks Triton on CUDA and the torch reference elsewhere."""
    if name == "auto":
        return "triton" if device.type == "cuda" else "torch"
    return name


def get_attention_backend(name: str) -> AttentionBackend:
    target = ATTENTION_BACKENDS.get(name)
    if target is None:
        raise ConfigError(f"unknown attention backend {name!r}; known: {sorted(ATTENTION_BACKENDS)}")
    module_name, _, class_name = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"attention backend {name!r} is not available here: {e}") from e
    backend_cls = getattr(module, class_name, None)
    if backend_cls is None:
        raise ConfigError(f"attention backend {name!r}: {module_name} defines no {class_name}")
    return backend_cls()
