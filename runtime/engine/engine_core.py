"""EngineCore: the synchronous step loop — schedule, run the model, sample, update, detokenize.

Single-threaded by design: whoever owns an EngineCore (LLM offline, or AsyncEngine's worker thread) is
the only thread that touches the scheduler, the KV cache manager and the Request objects.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tokenfleet.runtime.config import CacheConfig, RuntimeConfig
from tokenfleet.runtime.engine.cache_policy import CachePolicyRuntime
from tokenfleet.runtime.engine.detokenizer import IncrementalDetokenizer
from tokenfleet.runtime.engine.kv_cache.kv_events import PrefillScheduled
from tokenfleet.runtime.engine.kv_cache.manager import KVCacheManager
from tokenfleet.runtime.engine.model_runner import ModelRunner, kv_cache_dtype, num_kv_blocks, resolve_device
from tokenfleet.runtime.engine.outputs import EngineStats, RequestMetrics, RequestOutput, TokenLogprobs
from tokenfleet.runtime.engine.request import Request, RequestStatus
from tokenfleet.runtime.engine.sampling_params import SamplingParams
from tokenfleet.runtime.engine.scheduler import Scheduler
from tokenfleet.runtime.engine.spec_decode.coordinator import SpecDecoder
from tokenfleet.runtime.engine.spec_decode.proposer import build_proposer
from tokenfleet.runtime.errors import CapacityError, ContextLengthExceeded
from tokenfleet.runtime.model.loader import LoadedModel, load_model

logger = logging.getLogger(__name__)

_KV_EVENT_BACKLOG_MAX = 65536


@dataclass(slots=True)
class _Tracked:
    """Engine-side bookkeeping of one request next to its Request."""

    request: Request
    detokenizer: IncrementalDetokenizer
    want_logprobs: bool


class EngineCore:
    def __init__(self, config: RuntimeConfig, loaded: LoadedModel | None = None):
        self.config = config
        self.device = resolve_device(config.model)
        self.loaded = loaded if loaded is not None else load_model(config.model, self.device)
        self.tokenizer = self.loaded.tokenizer
        self.model_name = config.model.name
        self.max_model_len = self.loaded.max_model_len
        # ---- speculative decoding (spec_decode/): the draft may load a model and need KV memory ----
        proposer = build_proposer(config.speculative, self.loaded, self.device)
        draft_bytes = proposer.kv_bytes_per_block(config.cache.block_size) if proposer is not None else 0
        num_blocks = num_kv_blocks(
            config.cache, self.loaded, self.device, kv_cache_dtype(config.cache, self.loaded), draft_bytes
        )
        self.kv_manager = KVCacheManager.from_config(config.cache, num_blocks, self.loaded.name)
        self.scheduler = Scheduler(config.scheduler, self.kv_manager, self.max_model_len)
        self.runner = ModelRunner(self.loaded, config.cache, self.device, num_blocks, proposer)
        self.spec_decoder = (
            SpecDecoder(config.speculative, self.runner, self.kv_manager, self.max_model_len)
            if proposer is not None
            else None
        )
        # ---- end speculative decoding ----
        self._tracked: dict[str, _Tracked] = {}
        self._prompt_tokens_total = 0
        self._generation_tokens_total = 0
        self._num_steps = 0
        # Where the block pool's stored/removed events go after each step (the server's KV-event log for
        # the router). Until a sink is set they wait in a bounded backlog, so the blocks computed before a
        # router could listen (pinned prefixes at start-up) are still announced.
        self.kv_event_sink: Callable[[Sequence[object]], object] | None = None
        self._kv_event_backlog: list[object] = []
        # Last: computes pinned prefixes (runs internal requests through this engine).
        self.cache_policy = CachePolicyRuntime(self)

    # ---- admission -------------------------------------------------------------------------------------

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Checks that need no engine state (safe from any thread): context length and cache capacity."""
        n = len(prompt_token_ids)
        if n == 0:
            raise ContextLengthExceeded("the prompt is empty", param="prompt")
        if n >= self.max_model_len:
            raise ContextLengthExceeded(
                f"the prompt has {n} tokens; this model's context length is {self.max_model_len}",
                param="prompt",
            )
        if params.max_tokens is not None and n + params.max_tokens > self.max_model_len:
            raise ContextLengthExceeded(
                f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) exceeds the context length "
                f"{self.max_model_len}",
                param="max_tokens",
            )
        total = n + (params.max_tokens if params.max_tokens is not None else self.max_model_len - n)
        needed = -(-total // self.kv_manager.block_size)
        if needed > self.kv_manager.num_blocks:
            raise CapacityError(
                f"the request needs {needed} KV blocks; the cache has {self.kv_manager.num_blocks}",
                param="max_tokens",
            )

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
    ) -> None:
        if request_id in self._tracked:
            raise ValueError(f"duplicate request id {request_id!r}")
        self.validate(prompt_token_ids, params)
        if params.max_tokens is None:
            params.max_tokens = self.max_model_len - len(prompt_token_ids)
        request = Request(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            sampling_params=params,
            eos_token_ids=frozenset(self.tokenizer.eos_token_ids),
            priority=priority,
            cache_salt=cache_salt,
        )
        if arrival_time is not None:
            request.arrival_time = arrival_time
        self.scheduler.add_request(request)
        self._tracked[request_id] = _Tracked(
            request,
            IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids, params),
            params.logprobs is not None,
        )
        self._prompt_tokens_total += len(prompt_token_ids)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Abort in any state; frees its blocks at once. Returns the final output, None if unknown."""
        tracked = self._tracked.pop(request_id, None)
        if tracked is None:
            return None
        self.scheduler.abort(request_id)
        self.runner.release(request_id)
        self._publish_kv_events()
        return self._output(tracked, [], "", None, finished=True, reason="abort")

    # ---- the step ------------------------------------------------------------------------------------------

    def has_unfinished(self) -> bool:
        return bool(self._tracked)

    def step(self) -> list[RequestOutput]:
        sched = self.scheduler.schedule()
        if not sched.scheduled:
            return []
        self._num_steps += 1
        now = time.monotonic()
        announced = []
        for s in sched.scheduled:
            req = self._tracked[s.request_id].request
            if req.first_scheduled_time is None:
                req.first_scheduled_time = now
                if req.block_hashes:
                    announced.append(PrefillScheduled(tuple(req.block_hashes)))
        if announced and self.kv_event_sink is not None:
            self.kv_event_sink(announced)  # before the forward: routers learn of it while it runs
        result = self.runner.execute(sched, {rid: t.request for rid, t in self._tracked.items()})
        # With speculation a request may get several tokens, and the scheduler drops those after a stop
        # (EOS, max_tokens): what it appended is what the request produced.
        num_before = {rid: self._tracked[rid].request.num_output_tokens for rid in result.sampled}
        finished = {r.request_id for r in self.scheduler.update(sched, result.sampled)}
        if self.spec_decoder is not None:
            self.spec_decoder.record(sched, result.sampled)
            self.spec_decoder.propose(self.scheduler.running)
        now = time.monotonic()
        outputs: list[RequestOutput] = []
        for rid in result.sampled:
            tracked = self._tracked[rid]
            req = tracked.request
            new_ids = req.output_token_ids[num_before[rid] :]
            if req.first_token_time is None:
                req.first_token_time = now
            self._generation_tokens_total += len(new_ids)
            # A stop *token* ends the text before it (its text is not emitted); EOS is special anyway.
            text_ids = new_ids[:-1] if isinstance(req.stop_reason, int) and rid in finished else new_ids
            delta = tracked.detokenizer.update(text_ids)
            if tracked.detokenizer.stop_reason is not None and rid not in finished:
                self.scheduler.finish(rid, RequestStatus.FINISHED_STOPPED)
                req.stop_reason = tracked.detokenizer.stop_reason
                finished.add(rid)
            if rid in finished:
                delta += tracked.detokenizer.flush()
            lps = result.logprobs.get(rid)[: len(new_ids)] if tracked.want_logprobs else None
            outputs.append(
                self._output(
                    tracked,
                    new_ids,
                    delta,
                    [lp for lp in lps if lp is not None] if lps else None,
                    finished=rid in finished,
                    reason=req.status.finish_reason,
                )
            )
        for rid in finished:
            self._tracked.pop(rid, None)
            self.runner.release(rid)
        self._publish_kv_events()
        return outputs

    def set_kv_event_sink(self, sink: Callable[[Sequence[object]], object] | None) -> None:
        """Engine thread only. Hands the backlog to the new sink first, so nothing stored is missed."""
        self.kv_event_sink = sink
        self._publish_kv_events()

    def _publish_kv_events(self) -> None:
        events = self.kv_manager.take_events()
        if self.kv_event_sink is None:
            # Nobody listens (offline use): keep a bounded backlog; past the bound a listener that comes
            # later resyncs from an incomplete picture, which costs routing quality, never correctness.
            if len(self._kv_event_backlog) < _KV_EVENT_BACKLOG_MAX:
                self._kv_event_backlog.extend(events)
            return
        if self._kv_event_backlog:
            events = self._kv_event_backlog + events
            self._kv_event_backlog = []
        if events:
            self.kv_event_sink(events)

    def apply_cache_policy(self, cache: CacheConfig) -> None:
        """Apply the live fields of a new CacheConfig (TTL, eviction, pins, host tier) between steps."""
        self.cache_policy.apply(cache)
        self._publish_kv_events()

    def _output(
        self,
        tracked: _Tracked,
        new_ids: list[int],
        text: str,
        logprobs: list[TokenLogprobs] | None,
        *,
        finished: bool,
        reason: str | None,
    ) -> RequestOutput:
        req = tracked.request
        metrics = None
        if finished:
            metrics = RequestMetrics(
                arrival_time=req.arrival_time,
                first_scheduled_time=req.first_scheduled_time,
                first_token_time=req.first_token_time,
                finished_time=time.monotonic(),
            )
        return RequestOutput(
            request_id=req.request_id,
            new_token_ids=list(new_ids),
            new_text=text,
            new_logprobs=logprobs,
            finished=finished,
            finish_reason=reason if finished else None,
            num_prompt_tokens=req.num_prompt_tokens,
            num_output_tokens=req.num_output_tokens,
            num_cached_tokens=req.num_cached_tokens,
            stop_reason=req.stop_reason if finished else None,
            metrics=metrics,
        )

    def stats(self) -> EngineStats:
        km = self.kv_manager
        return EngineStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            kv_cache_usage=km.usage,
            num_free_blocks=km.num_free_blocks,
            num_total_blocks=km.num_blocks,
            prefix_cache_queries=km.prefix_queries,
            prefix_cache_hits=km.prefix_hits,
            num_preemptions=self.scheduler.num_preemptions_total,
            prompt_tokens_total=self._prompt_tokens_total,
            generation_tokens_total=self._generation_tokens_total,
            num_steps=self._num_steps,
            kv_metrics=km.metrics(),
            **self._spec_stats(),
        )

    def _spec_stats(self) -> dict[str, object]:
        spec = self.spec_decoder
        if spec is None:
            return {}
        return {
            "spec_decode_num_drafts": spec.num_drafts,
            "spec_decode_num_draft_tokens": spec.num_draft_tokens,
            "spec_decode_num_accepted_tokens": spec.num_accepted_tokens,
            "spec_decode_num_accepted_tokens_per_pos": tuple(spec.accepted_per_pos),
        }
