"""Checkpoint: what a source loader hands to `load_model` (architecture, tokenizer, a weight stream)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from tokenfleet.runtime.model.arch import ModelArch
from tokenfleet.runtime.model.tokenizer import Tokenizer

# HF tensor name -> (dim, start, length) of the part to read, or None for all of it.
Selector = Callable[[str], tuple[int, int, int] | None]


@dataclass(frozen=True, slots=True)
class Checkpoint:
    arch: ModelArch
    tokenizer: Tokenizer
    # A fresh iterator of (HF parameter name, tensor) per call; tensors are produced lazily, one at a time.
    # With a selector, each tensor is only the part `select(name)` names (a tensor-parallel shard), read
    # without materialising the rest.
    weights: Callable[[Selector | None], Iterator[tuple[str, torch.Tensor]]]
    num_weights: int  # for progress reporting
    name: str
