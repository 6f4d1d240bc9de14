"""What one scheduler step tells the model runner (frozen messages, built by the scheduler only)."""

from __future__ import annotations

from dataclasses import dataclass, field
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
class DecodeBatch:
    """The step's plain decodes, one list per field: request `request_ids[i]` feeds `token_ids[i]` at position
    `start_pos[i]` over its block table `block_ids[i]` and samples the token after it (no proposals).

    Nearly every running request is one of these nearly every step. As columns, scheduling one costs four
    list appends instead of two tuples (a `ScheduledRequest` and its one-token `token_ids`), which is what
    per-request allocation cost the scheduler at 1,024 and 4,096 sequences (bench/scheduler_overhead.py), and
    the runner and the simulator take whole columns (`torch.tensor(token_ids)`, `sum(start_pos)`) where they
    unpacked entries one by one. The lists are filled by the scheduler while it schedules the step and never
    changed once the output is handed over.
    """

    request_ids: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    start_pos: list[int] = field(default_factory=list)
    block_ids: list[tuple[int, ...]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.request_ids)

    def entries(self) -> list[ScheduledRequest]:
        """The same decodes as `ScheduledRequest`s, in order."""
        columns = zip(self.request_ids, self.token_ids, self.start_pos, self.block_ids, strict=True)
        return [ScheduledRequest(rid, (token,), start, blocks, True) for rid, token, start, blocks in columns]

    def pop(self, i: int) -> int:
        """Take decode `i` out (the scheduler preempted its request while scheduling the step); its start
        position."""
        del self.request_ids[i], self.token_ids[i], self.block_ids[i]
        return self.start_pos.pop(i)


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    """A step: the plain decodes (`decodes`, column-wise), then every other entry (`others`: prompt chunks,
    decodes that verify proposals or take look-ahead slots), in the order the runner lays out its rows."""

    decodes: DecodeBatch
    others: tuple[ScheduledRequest, ...]
    num_batched_tokens: int
    preempted_ids: tuple[str, ...] = ()  # preempted in this step: their KV is gone (recomputed on resume)
    aborted_ids: tuple[str, ...] = ()  # aborted since the previous step: drop any per-request state
    finished_ids: tuple[str, ...] = ()  # finished (not aborted) since the previous step: likewise
    # Prompt positions to score in this step; empty unless a scheduled request asks for prompt logprobs
    # (then, and only then, the runner computes logits beyond the sampling rows).
    prompt_logprobs: tuple[PromptLogprobsChunk, ...] = ()
    # LoRA: the device slot of each scheduled entry's adapter (-1: the base model), in the order of
    # `scheduled`, set by the engine once the slots are loaded; empty when no entry uses an adapter.
    lora_slots: tuple[int, ...] = ()

    @property
    def scheduled(self) -> tuple[ScheduledRequest, ...]:
        """Every entry, the decodes first, as `ScheduledRequest`s. Built at each call from the columns: code
        that runs every step reads `decodes` and `others` instead."""
        if not self.decodes:
            return self.others
        return (*self.decodes.entries(), *self.others)

    @property
    def request_ids(self) -> list[str]:
        """The scheduled requests' ids, in the order of `scheduled`."""
        return [*self.decodes.request_ids, *(entry.request_id for entry in self.others)]

    @property
    def num_scheduled(self) -> int:
        return len(self.decodes) + len(self.others)

    @property
    def is_empty(self) -> bool:
        return not self.decodes and not self.others
