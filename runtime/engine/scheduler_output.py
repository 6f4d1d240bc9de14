"""What one scheduler step tells the model runner (frozen messages, built by the scheduler only)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple


class ScheduledRequest(NamedTuple):
    """One request's share of a step.

    Feed `token_ids` at positions `start_pos ...`, then `spec_token_ids` (speculative proposals to verify)
    right after them; `block_ids` is the request's whole block table and covers all of those positions.
    `sample` is True when the chunk reaches the end of the request's known tokens: the runner samples
    one token after the last of `token_ids` (and verifies the proposals when there are any).

    An immutable NamedTuple rather than a frozen dataclass: one is built per running request per step,
    and a frozen dataclass costs ~6x more to construct (its __init__ goes through object.__setattr__
    per field) — at 256 sequences that alone would exceed the scheduler's 1 ms step budget.
    """

    request_id: str
    token_ids: tuple[int, ...]
    start_pos: int
    block_ids: tuple[int, ...]
    sample: bool
    spec_token_ids: tuple[int, ...] = ()

    @property
    def num_tokens(self) -> int:
        """Token slots this request uses in the step (its share of the token budget)."""
        return len(self.token_ids) + len(self.spec_token_ids)


class PromptLogprobsChunk(NamedTuple):
    """Prompt positions of one scheduled chunk to score (a request asking for prompt logprobs).

    The rows at positions `first_position ...` of the request's chunk each score the next prompt token:
    `target_token_ids[i]` is the prompt token at `first_position + i + 1`. `num_logprobs` alternatives each.
    """

    request_id: str
    first_position: int
    target_token_ids: tuple[int, ...]
    num_logprobs: int


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    scheduled: tuple[ScheduledRequest, ...]
    num_batched_tokens: int
    preempted_ids: tuple[str, ...] = ()  # preempted in this step: their KV is gone (recomputed on resume)
    aborted_ids: tuple[str, ...] = ()  # aborted since the previous step: drop any per-request state
    finished_ids: tuple[str, ...] = ()  # finished (not aborted) since the previous step: likewise
    # Prompt positions to score in this step; empty unless a scheduled request asks for prompt logprobs
    # (then, and only then, the runner computes logits beyond the sampling rows).
    prompt_logprobs: tuple[PromptLogprobsChunk, ...] = ()
    # LoRA: the device slot of each scheduled entry's adapter (-1: the base model), set by the engine once
    # the slots are loaded; empty when no entry uses an adapter.
    lora_slots: tuple[int, ...] = ()

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
