"""What `LLM.generate` / `LLM.chat` return, in vLLM's shapes: one `RequestOutput` per prompt holding its n
`CompletionOutput`s, logprobs as one {token id: Logprob} mapping per generated token, prompt logprobs as
None (the first prompt token: nothing before it to condition on) then one such mapping per prompt token.

Code written against vLLM's offline API reads these fields unchanged. The engine's own per-step message is
`outputs.RequestDelta`; these are assembled from its deltas once a request has finished.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tokenfleet.runtime.engine.outputs import TokenLogprobs


@dataclass(frozen=True, slots=True)
class Logprob:
    """vLLM's Logprob: the log probability under the raw model distribution, the rank (1 = most likely),
    and the token's text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One mapping per generated token: the sampled token and the requested top alternatives.
SampleLogprobs = list[dict[int, Logprob]]
# vLLM's PromptLogprobs: None for the first prompt token, then one mapping per prompt token.
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass(frozen=True, slots=True)
class CompletionOutput:
    """One of a prompt's n completions (`index` 0..n-1)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None  # None unless logprobs were asked for (as in vLLM)
    logprobs: SampleLogprobs | None
    finish_reason: str | None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it, if one did

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """The whole result of one prompt: `prompt` is None for a token-id prompt (as in vLLM)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    prompt_logprobs: PromptLogprobs | None = None  # when SamplingParams.prompt_logprobs asked for them
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (the first completion's)


def sample_logprobs(
    entries: Sequence[TokenLogprobs], decode: Callable[[int], str]
) -> tuple[SampleLogprobs, float]:
    """vLLM's per-token mappings (the sampled token first, then the top-k by rank) and their cumulative
    logprob (the sum over the sampled tokens)."""
    out: SampleLogprobs = []
    total = 0.0
    for entry in entries:
        out.append(position_logprobs(entry, decode))
        total += entry.logprob
    return out, total


def prompt_logprobs(entries: Sequence[TokenLogprobs], decode: Callable[[int], str]) -> PromptLogprobs:
    """vLLM's prompt logprobs from the engine's entries (prompt positions 1..): None first."""
    return [None, *(position_logprobs(entry, decode) for entry in entries)]


def position_logprobs(entry: TokenLogprobs, decode: Callable[[int], str]) -> dict[int, Logprob]:
    """One position's mapping: its token first, then the top-k alternatives by rank."""
    position = {entry.token_id: Logprob(entry.logprob, entry.rank, decode(entry.token_id))}
    for rank, (token_id, logprob) in enumerate(entry.top, start=1):
        if token_id not in position:
            position[token_id] = Logprob(logprob, rank, decode(token_id))
    return position
