"""EngineCore: the synchronous step loop — schedule, run the model, update, emit outputs.

`step()` is the data flow and nothing else: `Scheduler.schedule` -> `ModelRunner.execute` (prepare inputs
-> forward -> sample -> verify) -> `Scheduler.update` -> speculative proposals for the next step ->
`OutputProcessor.process` (detokenize, stop strings, deltas).

Single-threaded by design: whoever owns an EngineCore (LLM offline, or AsyncEngine's worker thread) is
the only thread that touches the scheduler, the KV cache manager and the Request objects. Time comes from
an injected clock (`time.monotonic` by default), so the same engine runs on virtual time.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence

import torch
from tokenfleet.runtime.config import CacheConfig, RuntimeConfig
from tokenfleet.runtime.engine.cache_policy import CachePolicyRuntime
from tokenfleet.runtime.engine.cpu_threads import cpu_thread_budget
from tokenfleet.runtime.engine.kv_cache.manager import KVCacheManager
from tokenfleet.runtime.engine.lora_manager import LoRAAdapter, LoRAManager
from tokenfleet.runtime.engine.model_runner import ModelRunner, kv_cache_dtype, num_kv_blocks, resolve_device
from tokenfleet.runtime.engine.output_processor import OutputProcessor
from tokenfleet.runtime.engine.outputs import EngineStats, RequestDelta
from tokenfleet.runtime.engine.parallel.support import check_tensor_parallel_config
from tokenfleet.runtime.engine.parallel.workers import TPWorkers, rank_device, threads_per_rank
from tokenfleet.runtime.engine.request import Request, RequestStatus, ResumeFrom
from tokenfleet.runtime.engine.sampling_params import SamplingParams
from tokenfleet.runtime.engine.scheduler import Scheduler
from tokenfleet.runtime.engine.spec_decode.coordinator import SpecDecoder
from tokenfleet.runtime.engine.spec_decode.proposer import build_proposer
from tokenfleet.runtime.engine.structured_output.compiler import GrammarCompiler
from tokenfleet.runtime.errors import AdapterUnavailable, ConfigError, InvalidRequest, ModelNotFound
from tokenfleet.runtime.model.loader import LoadedModel, load_model
from tokenfleet.runtime.model.lora_adapter import LoRAAdapterWeights, shard_adapter
from tokenfleet.runtime.model.lora_slots import LoRASlots

logger = logging.getLogger(__name__)

_KV_EVENT_BACKLOG_MAX = 65536

Clock = Callable[[], float]


class EngineCore:
    def __init__(
        self,
        config: RuntimeConfig,
        loaded: LoadedModel | None = None,
        clock: Clock = time.monotonic,
    ):
        self.config = config
        self.clock = clock
        tp_size = config.parallel.tensor_parallel_size
        self.device = resolve_device(config.model) if tp_size == 1 else rank_device(config.model, 0)
        if tp_size > 1:
            check_tensor_parallel_config(config, loaded)
            if self.device.type == "cpu":  # the ranks share the cores (process-wide setting)
                torch.set_num_threads(threads_per_rank(tp_size))
        elif self.device.type == "cpu" and (budget := cpu_thread_budget()) < torch.get_num_threads():
            torch.set_num_threads(budget)  # a CPU quota below the cores torch saw (cpu_threads.py)
        self.loaded = loaded if loaded is not None else load_model(config.model, self.device, tp_size=tp_size)
        # Tensor parallel: this process is rank 0 (scheduler, server, shard 0); ranks 1.. are workers.
        self.workers = TPWorkers.start(config) if tp_size > 1 else None
        try:
            self._build(config)
        except BaseException:
            self.shutdown()
            raise

    def _build(self, config: RuntimeConfig) -> None:
        clock = self.clock
        self.tokenizer = self.loaded.tokenizer
        self._eos_token_ids = frozenset(self.tokenizer.eos_token_ids)
        self.model_name = config.model.name
        self.max_model_len = self.loaded.max_model_len
        # A speculative draft may load a model and need KV memory next to the target's.
        proposer = build_proposer(config.speculative, self.loaded, self.device)
        draft_bytes = proposer.kv_bytes_per_block(config.cache.block_size) if proposer is not None else 0
        num_blocks = num_kv_blocks(
            config.cache, self.loaded, self.device, kv_cache_dtype(config.cache, self.loaded), draft_bytes
        )
        if self.workers is not None:
            num_blocks = self.workers.join(num_blocks, self.device)
        # A draft that writes KV proposes into look-ahead slots the scheduler allocates with each step.
        lookahead = config.speculative.num_speculative_tokens if proposer and proposer.writes_kv else 0
        # Blocks behind every layer's window are given back, unless a KV-writing draft reads the same table.
        window = None if proposer is not None and proposer.writes_kv else self.loaded.arch.all_layers_window
        self.kv_manager = KVCacheManager.from_config(
            config.cache, num_blocks, self.loaded.name, clock, sliding_window=window
        )
        self.lora = self._build_lora(config)
        self.scheduler = Scheduler(
            config.scheduler,
            self.kv_manager,
            self.max_model_len,
            lookahead,
            max_loras=config.lora.max_loras if self.lora is not None else None,
        )
        self.runner = ModelRunner(
            self.loaded,
            config.cache,
            self.device,
            num_blocks,
            proposer,
            self.workers,
            compile=config.model.compile,
            max_num_seqs=config.scheduler.max_num_seqs,
            compile_batch_sizes=config.model.compile_batch_sizes,
        )
        self.spec_decoder = (
            SpecDecoder(config.speculative, self.runner, self.scheduler) if proposer is not None else None
        )
        self.outputs = OutputProcessor(
            self.tokenizer,
            lambda rid: self.scheduler.finish(rid, RequestStatus.FINISHED_STOPPED),
            clock,
            config.server.stream_interval,
        )
        # Grammars for constrained outputs, over the logits' vocabulary (may be padded past the tokenizer's).
        self.grammars = GrammarCompiler(self.tokenizer, self.loaded.arch.vocab_size)
        self._prompt_tokens_total = 0
        self._num_steps = 0
        # Requests in flight under a LoRA adapter: each holds it until it ends (see LoRAManager).
        self._lora_requests: dict[str, LoRAAdapter] = {}
        # Where the block pool's stored/removed events go after each step (the server's KV-event log for
        # the router). Until a sink is set they wait in a bounded backlog, so the blocks computed before a
        # router could listen (pinned prefixes at start-up) are still announced.
        self.kv_event_sink: Callable[[Sequence[object]], object] | None = None
        self._kv_event_backlog: list[object] = []
        # Called with the requests that finished in a step, right after their blocks went back to the pool
        # and before anything can allocate again: a disaggregated prefill's KV hold is taken there, while
        # every block of its prompt is certainly still cached (kv_cache/kv_holds.py).
        self.finish_listeners: list[Callable[[Sequence[Request]], None]] = []
        # Queues the pinned prefixes' prefill requests; whoever builds the engine runs them with
        # `prefill_pins()` before serving (or they run with the first requests).
        self._cache_config = config.cache  # the live one: pins are computed again after a sleep
        self.sleep_level = 0  # 0 awake; 1 or 2 while asleep (until every part is awake again)
        self.cache_policy = CachePolicyRuntime(self)

    def _build_lora(self, config: RuntimeConfig) -> LoRAManager | None:
        """The adapter slots hooked into the model and the start-up adapters loaded, when LoRA is on."""
        if not config.lora.enable:
            return None
        model = self.loaded.model
        if getattr(model, "lora", None) is not None:
            raise ConfigError("this model already serves LoRA adapters for another engine")
        slots = LoRASlots(
            model, config.lora.max_loras, config.lora.max_lora_rank, self.loaded.dtype, self.device
        )
        model.lora = slots  # the runner sets the step's token -> slot map on it; compiling is then off
        self._lora_slots = slots  # hooks removed at shutdown: a model passed in outlives the engine
        size = config.parallel.tensor_parallel_size
        manager = LoRAManager(
            config.lora,
            slots,
            self.loaded.arch,
            self.loaded.dtype,
            config.model.name,
            size,
            self._replicate_lora if size > 1 else None,
        )
        manager.set_listed((), config.lora.modules)
        for name, exc in manager.preload():  # as many as host memory holds; the rest on first use
            if isinstance(exc, AdapterUnavailable):  # its Hub is down now: the pod serves, and tries on use
                logger.warning("LoRA adapter %s not loaded at start: %s", name, exc)
                continue
            raise ConfigError(f"lora.modules {name}: {exc}")
        logger.info(
            "LoRA: %d slots of rank %d (%.1f MiB), adapters %s",
            slots.max_loras,
            slots.max_rank,
            slots.nbytes / 2**20,
            [a.name for a in manager.adapters()],
        )
        return manager

    def _replicate_lora(self, slot: int, weights: LoRAAdapterWeights) -> None:
        """Tensor parallelism: each worker loads its part of the adapter rank 0 put into `slot`."""
        size = self.config.parallel.tensor_parallel_size
        parts = [shard_adapter(weights, self.loaded.arch, rank, size) for rank in range(1, size)]
        self.workers.load_lora(slot, parts)

    def check_health(self) -> None:
        """Raise EngineDeadError when a part the engine needs has died (a tensor-parallel worker)."""
        if self.workers is not None:
            self.workers.check()

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any, and drop the compiled decode graphs (idempotent). The
        engine cannot step afterwards."""
        if self.workers is not None:
            self.workers.stop()
        slots = getattr(self, "_lora_slots", None)
        if slots is not None:
            slots.detach()
            del self.loaded.model.lora
            self._lora_slots = None
        runner = getattr(self, "runner", None)  # absent when construction failed before it was built
        if runner is not None and runner.compiled is not None:
            runner.compiled.close()

    def prefill_pins(self) -> None:
        """Compute the pinned prefixes now (start-up, before any client request): the first requests then
        hit them, and offline callers never see the internal requests' outputs."""
        while self.has_unfinished():
            self.step()

    # ---- admission -------------------------------------------------------------------------------------

    def check_admission(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        """The scheduler's admission check, without queueing (pure: safe from any thread)."""
        self.scheduler.admission.check(len(prompt_token_ids), params.max_tokens)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
        resume: ResumeFrom | None = None,
        tenant: str | None = None,
        lora_name: str | None = None,
    ) -> None:
        """Queue a request; raises (and keeps nothing) when the scheduler refuses it. With `resume` it
        continues a stream begun elsewhere (recomputed like a preempted request, prefix cache permitting).
        `tenant`: whose share it counts against under `scheduler.fair_share` (None: the anonymous one).
        `lora_name`: the loaded LoRA adapter it runs under (ModelNotFound when there is none of that name)."""
        if self.sleep_level:  # the server answers 503 `sleeping` before this; offline callers get told
            raise RuntimeError("the engine is asleep (sleep mode): wake_up() first")
        adapter = None
        if lora_name is not None:
            if self.lora is None:
                raise ModelNotFound(lora_name)
            adapter = self.lora.acquire(lora_name)
        request = Request(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            sampling_params=params,
            eos_token_ids=self._eos_token_ids,
            priority=priority,
            arrival_time=self.clock() if arrival_time is None else arrival_time,
            cache_salt=cache_salt,
            tenant=tenant,
            lora=adapter,
            grammar=self.grammars.new_state(params.structured_output),
        )
        if resume is not None:
            request.output_token_ids = list(resume.output_token_ids)
            request.num_delivered_chars = resume.num_delivered_chars
        elif params.prompt_logprobs is not None:
            # Scored as its prefill runs; a continuation's prompt was scored where the stream began.
            request.prompt_logprobs = []
        try:
            self.scheduler.add_request(request)
        except BaseException:
            if adapter is not None:
                self.lora.release(adapter)
            raise
        if adapter is not None:
            self._lora_requests[request_id] = adapter
        self.outputs.add(request)
        self._prompt_tokens_total += len(prompt_token_ids)

    def abort(self, request_id: str) -> RequestDelta | None:
        """Abort in any state; frees its blocks at once. Returns the final output, None if unknown."""
        out = self.outputs.abort(request_id)
        if out is None:
            return None
        self.scheduler.abort(request_id)
        self.runner.release(request_id)
        self._release_lora(request_id)
        self._publish_kv_events()
        return out

    # ---- the step ------------------------------------------------------------------------------------------

    def has_unfinished(self) -> bool:
        return bool(self.outputs)

    def step(self) -> list[RequestDelta]:
        sched = self.scheduler.schedule()
        if sched.is_empty:
            self.runner.clock.pause()  # waiting on something other than the host (a transfer, a wake)
            return []
        self._num_steps += 1
        now = self.clock()
        get = self.outputs.get
        requests = {rid: get(rid) for rid in sched.request_ids}
        announced = self.scheduler.started
        if announced:  # some requests start: a decode-only step skips this loop
            for req in requests.values():
                if req.first_scheduled_time is None:
                    req.first_scheduled_time = now
            if self.kv_event_sink is not None:
                self.kv_event_sink(announced)  # before the forward: routers learn of it while it runs
        if self._lora_requests:
            adapters = [requests[rid].lora for rid in sched.request_ids]
            if any(a is not None for a in adapters):
                sched = dataclasses.replace(sched, lora_slots=self.lora.slots_for(adapters))
        result = self.runner.execute(sched, requests)
        for rid, scored in result.prompt_logprobs.items():
            requests[rid].prompt_logprobs.extend(scored)
        num_before = {rid: requests[rid].num_output_tokens for rid in result.sampled}
        finished = {r.request_id for r in self.scheduler.update(sched, result.sampled)}
        if self.spec_decoder is not None:
            self.spec_decoder.record(sched, result.sampled)
            self.spec_decoder.propose(self.scheduler.running)
        outputs, ended = self.outputs.process(num_before, result.logprobs, finished)
        for rid in ended:
            self.runner.release(rid)
            if self._lora_requests:
                self._release_lora(rid)
        if ended and self.finish_listeners:
            done = [requests[rid] for rid in ended if rid in requests]
            for listener in self.finish_listeners:
                listener(done)
        self._publish_kv_events()
        if not self.has_unfinished():
            self.runner.clock.pause()  # out of work: the time until the next request is idle
        return outputs

    def _release_lora(self, request_id: str) -> None:
        adapter = self._lora_requests.pop(request_id, None)
        if adapter is not None:
            self.lora.release(adapter)

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

    def set_stream_interval(self, interval: int) -> None:
        """Between steps: deltas held under the old interval go out with the next one due under the new."""
        if interval < 1:
            raise ValueError(f"stream_interval must be >= 1, got {interval}")
        self.outputs.stream_interval = interval

    def apply_cache_policy(self, cache: CacheConfig) -> None:
        """Apply the live fields of a new CacheConfig (TTL, eviction, pins, host tier) between steps."""
        self._cache_config = cache
        if self.sleep_level:  # no KV to move or pin into: applied on wake
            return
        self.cache_policy.apply(cache)
        self._publish_kv_events()

    # ---- sleep mode ------------------------------------------------------------------------------------

    def sleep(self, level: int) -> dict[str, int]:
        """Free the KV cache (level 1 also moves the weights to host memory, level 2 discards them); the
        prefix cache is reset, so routers hear `AllBlocksCleared` and drop their index of this pod. Only
        an idle engine sleeps (the server drains it first). Returns the bytes freed per part."""
        if level not in (1, 2):
            raise InvalidRequest(f"sleep level must be 1 or 2, got {level}", param="level")
        if self.sleep_level:
            return {"kv_cache": 0, "weights": 0}
        if self.workers is not None:
            raise InvalidRequest("sleep mode is not supported with tensor parallelism", param="level")
        if self.config.speculative.method == "draft":
            raise InvalidRequest("sleep mode is not supported with a separate draft model", param="level")
        if self.has_unfinished():
            n = self.scheduler.num_running + self.scheduler.num_waiting
            raise RuntimeError(f"cannot sleep with {n} requests unfinished")
        pins = self.kv_manager.pins
        for key in pins.pin_keys():  # their KV is about to go; wake computes them again
            pins.unpin(key)
        self.kv_manager.reset_prefix_cache()
        self._publish_kv_events()
        freed = self.runner.sleep(level)
        self.sleep_level = level
        logger.info(
            "asleep at level %d: freed %.0f MiB of KV cache, %.0f MiB of weights",
            level,
            freed["kv_cache"] / 2**20,
            freed["weights"] / 2**20,
        )
        return freed

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Restore what sleep freed: `weights` (from host memory, or reloaded from the model source by
        the start-up loader after level 2) and/or `kv_cache` (re-allocated, zeroed; the pinned prefixes
        are queued to be computed again). None = both."""
        tags = ("weights", "kv_cache") if tags is None else tuple(tags)
        if unknown := set(tags) - {"weights", "kv_cache"}:
            raise InvalidRequest(
                f"unknown wake_up tags {sorted(unknown)}: use weights, kv_cache", param="tags"
            )
        runner = self.runner
        if "weights" in tags:
            runner.wake_weights(lambda: load_model(self.config.model, self.device))
        if "kv_cache" in tags and runner.kv_asleep:
            runner.wake_kv_cache()
        if not runner.kv_asleep and not runner.weights_asleep:
            self.sleep_level = 0
            # Pins (and any cache policy change that arrived while asleep) need both parts awake.
            self.cache_policy.apply(self._cache_config)
            self._publish_kv_events()

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
            generation_tokens_total=self.outputs.generation_tokens_total,
            num_steps=self._num_steps,
            model_seconds_total=self.runner.clock.model_seconds,
            host_gap_seconds_total=self.runner.clock.host_gap_seconds,
            num_host_gaps=self.runner.clock.num_gaps,
            kv_metrics=km.metrics(),
            **self._spec_stats(),
            **self._lora_stats(),
        )

    def _lora_stats(self) -> dict[str, object]:
        if self.lora is None:
            return {}
        running_ids = {r.request_id for r in self.scheduler.running}
        running, waiting = set(), set()
        for rid, adapter in self._lora_requests.items():
            (running if rid in running_ids else waiting).add(adapter.name)
        return {
            "running_lora_adapters": tuple(sorted(running)),
            "waiting_lora_adapters": tuple(sorted(waiting)),
            "max_lora": self.config.lora.max_loras,
            "lora_swaps": tuple((level, *n) for level, n in self.lora.swap_counts().items()),
        }

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
