"""Checkpoint: what a source loader hands to `load_model` (architecture, tokenizer, a weight stream)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from tokenfleet.runtime.model.arch import ModelArch
from tokenfleet.runtime.model.tokenizer import Tokenizer


@dataclass(frozen=True, slots=True)
class Checkpoint:
    arch: ModelArch
    tokenizer: Tokenizer
    # A fresh iterator of (HF parameter name, tensor) per call; tensors are produced lazily, one at a time.
    weights: Callable[[], Iterator[tuple[str, torch.Tensor]]]
    num_weights: int  # for progress reporting
    name: str
