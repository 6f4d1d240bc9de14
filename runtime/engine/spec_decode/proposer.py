"""The proposer contract: what a speculative-decoding draft sees and returns, and the registry of drafts.

A proposer runs once per engine step, after the scheduler applied the step's results, for every running
request whose next token is about to be decoded (never for one still prefilling). It returns up to `k`
guessed continuation tokens per request; the next step feeds them after the request's last token and the
target model verifies them all in one forward pass (`rejection_sampler.py`).

Proposals are deterministic guesses (a point-mass draft distribution): n-gram lookup has no distribution
at all, and model drafts propose their argmax. Verification against a point mass is exact for any target
distribution, so the output law is the target's whatever the proposer guesses.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from tokenfleet.runtime.config import SpeculativeConfig
from tokenfleet.runtime.errors import ConfigError
from tokenfleet.runtime.model.attention.base import AttentionMetadata
from tokenfleet.runtime.model.loader import LoadedModel


@dataclass(frozen=True, slots=True)
class ProposalInput:
    """One request to draft for. `prompt_token_ids` / `output_token_ids` are the request's own lists
    (read-only views, valid for the duration of the `propose` call: no per-step copy of long contexts).

    The request has `num_computed_tokens` tokens of KV; its last token (at that position) has none yet.
    Model drafts write KV at positions `num_computed_tokens ... + num_spec - 1` of `block_ids`, whose
    slots the engine allocated before the call.
    """

    request_id: str
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    num_computed_tokens: int
    num_spec: int  # at most this many proposals (>= 1)
    block_ids: Sequence[int]

    @property
    def last_token_id(self) -> int:
        out = self.output_token_ids
        return out[-1] if out else self.prompt_token_ids[-1]


class Proposer(abc.ABC):
    """A draft. Stateless across steps unless documented: everything it needs comes with the inputs."""

    # Whether `propose` writes KV cache slots (model drafts): the engine then allocates the slots of the
    # positions to be proposed before calling it, and skips requests for which none are free.
    writes_kv: bool = False

    def kv_bytes_per_block(self, block_size: int) -> int:
        """Extra KV cache memory per block the draft needs next to the target's (a separate draft model)."""
        return 0

    def bind(
        self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], num_blocks: int, block_size: int
    ) -> None:
        """Called once by the model runner with the target's paged KV cache and its geometry."""
        return None

    def observe(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> None:
        """Called after every target forward with the same inputs (a separate draft mirrors them)."""
        return None

    @abc.abstractmethod
    def propose(self, batch: Sequence[ProposalInput]) -> list[list[int]]:
        """Up to `num_spec` proposed tokens per input, in order (an empty list: no guess)."""


ProposerFactory = Callable[[SpeculativeConfig, LoadedModel, torch.device], Proposer]

# method -> factory. Each proposer module registers itself here (imported by `build_proposer`).
PROPOSERS: dict[str, ProposerFactory] = {}


def register(method: str) -> Callable[[ProposerFactory], ProposerFactory]:
    def wrap(factory: ProposerFactory) -> ProposerFactory:
        PROPOSERS[method] = factory
        return factory

    return wrap


def build_proposer(config: SpeculativeConfig, target: LoadedModel, device: torch.device) -> Proposer | None:
    """The configured draft, or None when speculation is off. Raises ConfigError for an unusable one."""
    if config.method == "none":
        return None
    # Imported for their registration side effect; kept here so `proposer` has no import cycle.
    from tokenfleet.runtime.engine.spec_decode import draft_model, ngram, self_draft  # noqa: F401

    factory = PROPOSERS.get(config.method)
    if factory is None:
        raise ConfigError(f"unknown speculative method {config.method!r}; known: {sorted(PROPOSERS)}")
    return factory(config, target, device)
