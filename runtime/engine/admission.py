"""Admission: whether a request can ever run on this engine, decided in one place.

The scheduler owns this decision (it owns the context length and the KV cache it checks against) and
applies it in `Scheduler.add_request`. The async front end calls the same pure check from the event-loop
thread before queueing, so a client hears "no" before its stream starts; it only reads fixed geometry
(max_model_len, block size, number of blocks), never scheduler state.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenfleet.runtime.errors import CapacityError, ContextLengthExceeded, InvalidRequest


@dataclass(frozen=True, slots=True)
class AdmissionLimits:
    max_model_len: int
    block_size: int
    num_blocks: int

    def check(self, num_prompt_tokens: int, max_tokens: int | None) -> int:
        """The request's length limit (prompt + output tokens it may reach); raises why it could never run.

        - an empty prompt has no token to compute logits from: InvalidRequest;
        - a prompt of max_model_len tokens or more leaves no room for one output token;
        - prompt + max_tokens past the context length is refused, not silently clamped (OpenAI does too);
        - KV capacity: the last token of a finished sequence is never fed back, so a sequence of final
          length L holds L - 1 tokens of KV. One that could not fit the whole cache would be preempted
          forever: refuse it now. (Speculative look-ahead slots are capped at the same L - 1.)
        """
        n = num_prompt_tokens
        limit_len = self.max_model_len
        if n == 0:
            raise InvalidRequest("the prompt is empty", param="prompt")
        if n >= limit_len:
            raise ContextLengthExceeded(
                f"the prompt has {n} tokens; this model's context length is {limit_len} "
                "(at least one token must be left to generate)",
                param="prompt",
            )
        if max_tokens is not None and n + max_tokens > limit_len:
            raise ContextLengthExceeded(
                f"prompt ({n} tokens) + max_tokens ({max_tokens}) exceeds the context length {limit_len}",
                param="max_tokens",
            )
        limit = limit_len if max_tokens is None else n + max_tokens
        needed = -(-(limit - 1) // self.block_size)
        if needed > self.num_blocks:
            raise CapacityError(
                f"prompt ({n} tokens) + max_tokens needs {needed} KV blocks of {self.block_size} tokens; "
                f"the cache has {self.num_blocks}",
                param="max_tokens",
            )
        return limit
