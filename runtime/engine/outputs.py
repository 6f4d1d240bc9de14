"""Messages the engine hands to its callers (frozen: they cross the engine-thread / event-loop boundary)."""

from __future__ import annotations

from dataclasses import dataclass

from tokenfleet.runtime.engine.kv_cache.cache_metrics import KVCacheMetrics


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """Logprob of the sampled token under the raw model distribution, and the top-n alternatives."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    rank: int | None = None  # of the sampled token in the raw distribution (1 = most likely)


@dataclass(frozen=True, slots=True)
class RequestMetrics:
    """Monotonic timestamps (seconds) of one request's life, for latency histograms."""

    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finished_time: float | None


@dataclass(slots=True)
class RequestDelta:
    """A delta: what one request produced in one engine step (the last one has finished=True).

    Not vLLM's RequestOutput: that is the whole result `LLM.generate` returns (`offline_outputs.py`).
    Treat it as immutable. It is not declared frozen because one is built per request per step, and a
    frozen dataclass's `__init__` sets each field through `object.__setattr__`: 2.0 instead of 0.9 us here,
    0.3 ms of a 256-stream step."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    new_logprobs: list[TokenLogprobs] | None
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort"
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    stop_reason: int | str | None = None
    metrics: RequestMetrics | None = None  # only on the final output
    # With `prompt_logprobs`: on the request's first delta, one entry per prompt token after the first
    # (its logprob given the tokens before it), in prompt order.
    prompt_logprobs: list[TokenLogprobs] | None = None


@dataclass(frozen=True, slots=True)
class EngineStats:
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    prefix_cache_queries: int = 0  # tokens, cumulative
    prefix_cache_hits: int = 0  # tokens, cumulative
    num_preemptions: int = 0
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    num_steps: int = 0
    # Time in the steps' model work (forward, logits, sampling), and from its end to the next step's while
    # the engine stayed busy (step_clock.py); host clock, so all 0 unless the model runs on the CPU.
    model_seconds_total: float = 0.0
    host_gap_seconds_total: float = 0.0
    num_host_gaps: int = 0
    # Speculative decoding (vLLM's spec_decode_* counters); all 0 when speculation is off.
    spec_decode_num_drafts: int = 0  # request-steps verified with >= 1 proposal
    spec_decode_num_draft_tokens: int = 0  # proposals verified
    spec_decode_num_accepted_tokens: int = 0  # proposals accepted
    spec_decode_num_accepted_tokens_per_pos: tuple[int, ...] = ()  # accepted at proposal position i
    # Per-tier hits, evictions by reason, pins and offload traffic (kv_cache/cache_metrics.py).
    kv_metrics: KVCacheMetrics | None = None
    # LoRA: the adapters of running and of waiting requests (sorted names) and the device slots (0: off).
    running_lora_adapters: tuple[str, ...] = ()
    waiting_lora_adapters: tuple[str, ...] = ()
    max_lora: int = 0
    # Level ("host", "device") -> (adapters loaded, adapters evicted to make room), cumulative.
    lora_swaps: tuple[tuple[str, int, int], ...] = ()

    @property
    def spec_decode_acceptance_rate(self) -> float | None:
        """Accepted / proposed tokens; None before the first proposal."""
        if not self.spec_decode_num_draft_tokens:
            return None
        return self.spec_decode_num_accepted_tokens / self.spec_decode_num_draft_tokens

    @property
    def spec_decode_mean_accepted_length(self) -> float | None:
        """Tokens emitted per verified request-step: 1 (corrected or bonus token) + accepted proposals."""
        if not self.spec_decode_num_drafts:
            return None
        return 1.0 + self.spec_decode_num_accepted_tokens / self.spec_decode_num_drafts
