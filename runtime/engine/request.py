"""Request: one sequence's state inside the engine (touched by the engine thread only)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tokenfleet.runtime.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tokenfleet.runtime.engine.lora_manager import LoRAAdapter


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # back in the waiting queue, its KV freed (recompute on resume)
    FINISHED_STOPPED = "stop"  # EOS, a stop token or a stop string
    FINISHED_LENGTH = "length"  # max_tokens or the context length
    FINISHED_ABORTED = "abort"  # client went away / abort()

    @property
    def finished(self) -> bool:
        return self in (
            RequestStatus.FINISHED_STOPPED,
            RequestStatus.FINISHED_LENGTH,
            RequestStatus.FINISHED_ABORTED,
        )

    @property
    def finish_reason(self) -> str | None:
        """OpenAI's finish_reason for a finished status."""
        return self.value if self.finished else None


@dataclass(frozen=True, slots=True)
class ResumeFrom:
    """A stream begun elsewhere: the tokens already generated and how much of their text the client holds.

    The request then continues as if it had produced them itself: they count against max_tokens and
    min_tokens and in the penalties, the grammar state and the seeded generator are advanced over them,
    and only text past `num_delivered_chars` is released.
    """

    output_token_ids: tuple[int, ...]
    num_delivered_chars: int


@dataclass(slots=True, eq=False)
class Request:
    """The single rule (vLLM V1): `num_computed_tokens` catches up with `num_tokens` (prompt + output).

    A step schedules some tokens of each request under a budget; prefix-cache hits start it ahead.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    priority: int = 0  # lower value = more important (vLLM convention)
    arrival_time: float = field(default_factory=time.monotonic)
    cache_salt: str | None = None
    # Whose share of the engine this request counts against under `scheduler.fair_share` (None: the one
    # anonymous tenant); the server sets it from a trusted tenant header or the client's key digest.
    tenant: str | None = None
    # The LoRA adapter the request runs under (None: the base model); part of its block hashes.
    lora: LoRAAdapter | None = None
    # A continuation of a stream begun on another pod starts with the tokens generated there and the number
    # of characters of their text the client already holds (the detokenizer resumes from both).
    output_token_ids: list[int] = field(default_factory=list)
    num_delivered_chars: int = 0
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    # Speculative tokens proposed for the next step (verified by the runner, rolled back when rejected).
    spec_token_ids: list[int] = field(default_factory=list)
    # Block hashes of the full blocks of all_token_ids, filled in incrementally by the KV cache manager.
    block_hashes: list[bytes] = field(default_factory=list)
    # structured_output.state.GrammarState when the output is constrained (kept in step with the outputs).
    grammar: object | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    # With `prompt_logprobs`: outputs.TokenLogprobs of prompt positions 1.., filled by the engine as prefill
    # chunks run (its length is how far the scoring got; a preempted request resumes scoring there).
    prompt_logprobs: list | None = None
    # Set by the scheduler when it takes the request: (EOS + stop token ids, min_tokens, output tokens up to
    # the length limit), the figures of the stop check that runs for every sampled token, kept here so
    # that the check needs no lookup by id.
    stop_figures: tuple[frozenset[int], int, int] | None = field(default=None, repr=False)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status.finished
