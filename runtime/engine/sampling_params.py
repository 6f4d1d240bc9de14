"""SamplingParams: what a request asks of the sampler, validated once at the boundary."""

from __future__ import annotations

from dataclasses import InitVar, dataclass, field

from tokenfleet.runtime.engine.structured_output.spec import GrammarSpec, StructuredOutputsParams
from tokenfleet.runtime.errors import InvalidRequest


@dataclass(slots=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # (0, 1]
    top_k: int = 0  # 0 = off
    min_p: float = 0.0  # [0, 1]
    repetition_penalty: float = 1.0  # > 0; 1 = off (HF semantics, prompt + output tokens)
    frequency_penalty: float = 0.0  # [-2, 2] (OpenAI semantics, output tokens)
    presence_penalty: float = 0.0  # [-2, 2]
    seed: int | None = None  # per-request generator: reproducible whatever the batch
    max_tokens: int | None = 16  # None = up to the context length
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None  # None = off; k = sampled token's logprob + top-k alternatives
    # vLLM's prompt_logprobs: None = off; k = each prompt token's logprob (given the tokens before it) +
    # the top-k alternatives at its position. Such a request recomputes its whole prompt: it does not read
    # the prefix cache, whose hits would skip the positions to score.
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # Constrained decoding (JSON schema, regex, choice, grammar, tool calls); None = free text.
    structured_output: GrammarSpec | None = None
    # vLLM's spellings of the same constraint (current and older releases), accepted when constructing;
    # either becomes `structured_output`.
    structured_outputs: InitVar[StructuredOutputsParams | GrammarSpec | None] = None
    guided_decoding: InitVar[StructuredOutputsParams | GrammarSpec | None] = None

    def __post_init__(
        self,
        structured_outputs: StructuredOutputsParams | GrammarSpec | None,
        guided_decoding: StructuredOutputsParams | GrammarSpec | None,
    ) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        for alias in (structured_outputs, guided_decoding):
            if alias is None:
                continue
            spec = alias.to_spec() if isinstance(alias, StructuredOutputsParams) else alias
            # dataclasses.replace passes the read alias back in: the same constraint is no conflict.
            if self.structured_output is not None and spec != self.structured_output:
                raise InvalidRequest("set one structured output constraint", param="structured_outputs")
            self.structured_output = spec
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        def bad(param: str, why: str) -> InvalidRequest:
            return InvalidRequest(f"{param} {why}", param=param)

        if self.n < 1 or self.n > 128:
            raise bad("n", f"must be in [1, 128], got {self.n}")
        if self.temperature < 0 or self.temperature > 100:
            raise bad("temperature", f"must be in [0, 100], got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise bad("top_k", f"must be >= 0 (0 = off), got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise bad("min_p", f"must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            raise bad("repetition_penalty", f"must be > 0, got {self.repetition_penalty}")
        if not -2 <= self.frequency_penalty <= 2:
            raise bad("frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty}")
        if not -2 <= self.presence_penalty <= 2:
            raise bad("presence_penalty", f"must be in [-2, 2], got {self.presence_penalty}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise bad("max_tokens", f"must be >= 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise bad("min_tokens", f"must be >= 0, got {self.min_tokens}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise bad("logprobs", f"must be in [0, 20], got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            raise bad("prompt_logprobs", f"must be in [0, 20], got {self.prompt_logprobs}")
        if len(self.stop) > 16 or any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", "must be at most 16 non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be non-negative integers")


# Read access under vLLM's name too (the InitVar above only takes it at construction; a class attribute set
# after the dataclass is built does not change the generated __init__).
SamplingParams.structured_outputs = property(lambda self: self.structured_output)  # type: ignore[assignment]
