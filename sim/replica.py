"""One simulated serving pod: the real `Scheduler` and `KVCacheManager`, with the forward pass replaced by a cost.

A step is exactly the engine's: `schedule()` -> (the model would run) -> `update(output, sampled)`. Each
request's "model" emits one fixed token over and over (`SimRequest.output` is that token `max_tokens` times;
`ignore_eos`, so lengths are exact): the scheduler appends what it is given, the KV manager hashes the output
blocks from those tokens, and a session's next turn — built from the previous prompt + output — finds that
answer's KV under the same hashes. Chained hashes keep two requests' identical-looking output blocks apart.
The step lasts `cost.step_seconds(shape)` of virtual time; tokens appear when it ends. The KV manager's TTL
clock is the simulation clock.

Why one fixed token per request: the sampled-token mapping the scheduler reads can then be one dict per pod,
kept from admission to finish, instead of a new dict built every step; and every per-token figure is taken
with set operations over the step's request ids (C loops) instead of a Python loop per token. One hour of a
16-replica fleet is ~400 million tokens: each Python-level operation per token is minutes of wall time.

Per-request timings and the pod's cumulative counters are kept here, as the server's metrics would.

LoRA (`ReplicaConfig.lora`, when the workload names adapters): the pod's held adapters are `PodAdapters`
(adapters.py); a request whose adapter is not loaded yet is parked there and reaches the scheduler once
the load completes (`adapter_loaded`), so a load never stalls the running batch; one the pod has no room
for is refused as the server refuses it (`rejected` is `ADAPTERS_BUSY`: the router tries another pod).
Requests carry the
adapter as `Request.lora`, so the real scheduler applies `max_loras` and the real KV manager hashes their
blocks under the adapter's key. A parked request counts as waiting in the pod's load report.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import compress
from operator import attrgetter, itemgetter

from tokenfleet.runtime.config import CacheConfig, SchedulerConfig
from tokenfleet.runtime.engine.kv_cache.kv_events import KVEvent, PrefillScheduled
from tokenfleet.runtime.engine.kv_cache.manager import KVCacheManager
from tokenfleet.runtime.engine.request import Request
from tokenfleet.runtime.engine.sampling_params import SamplingParams
from tokenfleet.runtime.engine.scheduler import Scheduler
from tokenfleet.runtime.errors import AdaptersBusy, InvalidRequest
from tokenfleet.sim.adapters import BUSY, PARKED, PodAdapters, sim_adapter
from tokenfleet.sim.config import LoRASpec
from tokenfleet.sim.cost_model import CoreUsage, CostModel, LoRAStepCost, batch_shape
from tokenfleet.sim.errors import SimInputError
from tokenfleet.sim.workload import SimRequest

# 1%-wide log bins: bin k holds gaps in [1.01^k, 1.01^(k+1)).
ITL_BINS_PER_E = 1.0 / math.log(1.01)
# A request refused because every adapter the pod holds is in use: the server's 503 and its error code.
ADAPTERS_BUSY = f"pod 503: {AdaptersBusy.code}"

_rid = itemgetter(0)
_sample = itemgetter(4)
_lora = attrgetter("lora")


def itl_bin(gap: float) -> int:
    return math.floor(math.log(max(gap, 1e-7)) * ITL_BINS_PER_E)


@dataclass(slots=True)
class RequestRecord:
    """What a client would measure for one request (virtual seconds)."""

    request: SimRequest
    replica: str
    reached: float | None = None  # when it reached its pod (after the router's queue and the hop there)
    first_scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    finished: float | None = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    num_emitted: int = 0
    rejected: str | None = None  # why the pod refused it (never fits, too long)
    adapter_wait: float = 0.0  # waiting for its adapter's load on the pod


@dataclass(frozen=True, slots=True)
class ReplicaConfig:
    scheduler: SchedulerConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    max_model_len: int = 8192
    model_name: str = "model"
    lora: LoRASpec | None = None  # when requests name adapters


class SimReplica:
    def __init__(
        self,
        name: str,
        cost: CostModel,
        config: ReplicaConfig,
        clock: Callable[[], float],
        on_first_token: Callable[[float], None],
        shared_host: CoreUsage | None = None,
        on_adapter_load: Callable[[str, str, float], None] | None = None,
        on_tokens: Callable[[Counter[str]], None] | None = None,
    ) -> None:
        """`on_adapter_load(pod, adapter, ready_at)`: a load began; call `adapter_loaded` at `ready_at`.
        `on_tokens(by_tenant)`: the tokens each step generated, per tenant, as a router relaying the streams
        sees them pass (its fair share charges them then)."""
        num_blocks = cost.num_kv_blocks(config.cache.block_size)
        if num_blocks < 1:
            raise SimInputError(
                "fleet",
                f"the model's weights leave no room for a KV cache on {cost.name}: use more TP or a bigger GPU",
            )
        self.name = name
        self.cost = cost
        self.shared_host = shared_host
        self.step_cores = 0.0  # cores the step in flight keeps busy (shared host only)
        # As the engine builds it (the pool's events on: the router follows them).
        self.kv = KVCacheManager.from_config(config.cache, num_blocks, config.model_name, clock)
        lora = config.lora
        self.scheduler = Scheduler(
            config.scheduler,
            self.kv,
            config.max_model_len,
            max_loras=None if lora is None else lora.max_loras,
        )
        self.adapters: PodAdapters | None = None
        self.lora_cost: LoRAStepCost | None = None
        if lora is not None:
            assert on_adapter_load is not None
            self.adapters = PodAdapters(
                lora.max_adapters, lora.load_s, lambda adapter, at: on_adapter_load(name, adapter, at)
            )
            self.lora_cost = LoRAStepCost(lora.step_overhead, lora.step_overhead_per_adapter)
        self.records: dict[str, RequestRecord] = {}
        self.itl_bins: dict[int, int] = {}  # log-spaced bins of inter-token gaps (results.py reads them)
        self._on_first_token = on_first_token
        self._on_tokens = on_tokens
        self._pending = None  # the step in flight
        # The "model": request id -> [its token]; update() reads it for every sampling entry.
        self._tokens: dict[str, list[int]] = {}
        self._no_token_yet: set[str] = set()
        self._prev_sampled: set[str] = set()  # ids that got a token at the end of the previous step ...
        self._prev_end = 0.0  # ... which ended then
        self._left_at: dict[str, float] = {}  # ids that got no token in the last step: when they last did
        self._all_sample = False  # every request of the step in flight samples
        self.announced: list[PrefillScheduled] = []  # requests started since the router last looked
        self.busy = False
        self.num_steps = 0
        self.busy_seconds = 0.0
        self.generation_tokens_total = 0
        self.num_served = 0
        # (time, ttft) of recent first tokens for the autoscaler's window.
        self.recent_ttft: deque[tuple[float, float]] = deque()

    # ---- the pod's load report ------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    @property
    def num_waiting(self) -> int:
        adapters = self.adapters
        return self.scheduler.num_waiting + (adapters.num_parked if adapters is not None else 0)

    @property
    def kv_usage(self) -> float:
        return self.kv.usage

    def has_work(self) -> bool:
        adapters = self.adapters
        return self.scheduler.has_unfinished_requests() or (adapters is not None and adapters.num_parked > 0)

    # ---- requests -------------------------------------------------------------------------------------

    def add(
        self, sreq: SimRequest, now: float, max_tokens: int | None = None, resumed_at: float | None = None
    ) -> RequestRecord:
        """Hand the pod a request; `max_tokens` (default: its whole output) ends it early (a prefill pod
        runs the prompt and the first token only). `resumed_at`: another pod produced the first token,
        which reached the client then; this pod continues after it (a decode pod)."""
        record = RequestRecord(sreq, self.name, reached=now)
        output = sreq.output
        params = SamplingParams(max_tokens=max_tokens or len(output), ignore_eos=True, temperature=0.0)
        adapter = sreq.adapter if self.adapters is not None else None
        request = Request(
            sreq.request_id,
            sreq.prompt,
            params,
            priority=sreq.priority,
            arrival_time=now,
            tenant=sreq.tenant,
            block_hashes=list(sreq.block_hashes),  # the router's hashes: the same function, computed once
            lora=None if adapter is None else sim_adapter(adapter),  # type: ignore[arg-type]  # duck-typed
        )
        if resumed_at is not None:
            request.output_token_ids = [output[0]]  # as the engine takes a resumed stream's tokens
        if adapter is not None:
            assert self.adapters is not None
            verdict = self.adapters.request(adapter, (request, record, resumed_at, now), now)
            if verdict == BUSY:  # the server's 503: every adapter it holds is in use
                record.rejected = ADAPTERS_BUSY
                record.finished = now
                return record
            if verdict == PARKED:
                return record  # parked until its adapter is loaded (adapter_loaded submits it)
        self._submit(request, record, resumed_at, now)
        return record

    def _submit(self, request: Request, record: RequestRecord, resumed_at: float | None, now: float) -> None:
        rid = request.request_id
        request.arrival_time = now  # the scheduler's first-come order starts when it reaches the engine
        try:
            self.scheduler.add_request(request)
        except InvalidRequest as e:  # CapacityError, ContextLengthExceeded: the pod answers 400
            record.rejected = f"{type(e).__name__}: {e}"
            record.finished = now
            if request.lora is not None and self.adapters is not None:
                self.adapters.release(request.lora.name)
            return
        self.records[rid] = record
        self._tokens[rid] = [record.request.output[0]]
        if resumed_at is None:
            self._no_token_yet.add(rid)
        else:  # its next token's gap runs from the first one
            record.first_token = record.last_token = resumed_at
            self._left_at[rid] = resumed_at

    def adapter_loaded(self, adapter: str, now: float) -> list[RequestRecord]:
        """`adapter`'s load completed: its parked requests reach the scheduler. Returns those it refused."""
        assert self.adapters is not None
        refused = []
        for request, record, resumed_at, parked_at in self.adapters.load_done(adapter):
            record.adapter_wait = now - parked_at
            self._submit(request, record, resumed_at, now)
            if record.rejected is not None:
                refused.append(record)
        return refused

    # ---- the step -------------------------------------------------------------------------------------

    def start_step(self, now: float, others_cores: float = 0.0) -> float | None:
        """Schedule a step at `now`; its duration, or None when there is nothing to run.

        On a shared host (`shared_host`: the engine's measured core usage) `others_cores` are the cores the
        other engines' steps in flight keep busy; once the demand exceeds the host's cores every engine
        gets its share, and this step stretches by demand / cores (fixed at its start).
        """
        scheduler = self.scheduler
        num_before = len(scheduler.running)
        output = scheduler.schedule()
        if output.is_empty:
            self.busy = False
            return None
        # Requests leave the waiting queue only by admission, which appends them to `running` (the
        # scheduler's admission order): the newly running tail are this step's admissions.
        num_admitted = len(scheduler.running) - num_before + len(output.preempted_ids)
        if num_admitted > 0:
            records = self.records
            for request in scheduler.running[-num_admitted:]:
                rec = records[request.request_id]
                if rec.first_scheduled is None:
                    rec.first_scheduled = now
        # The scheduler's announcements of the requests it starts, which the engine publishes before the
        # forward (routers count them as work and follow the prefix while it is prefilled).
        self.announced.extend(scheduler.started)
        self._pending = output
        self.busy = True
        shape = batch_shape(output)
        self._all_sample = shape.num_samples == shape.num_seqs
        duration = self.cost.step_seconds(shape)
        if self.lora_cost is not None:  # the LoRA kernels, by the distinct adapters the batch runs
            adapters = set(map(_lora, scheduler.running))
            adapters.discard(None)
            duration *= self.lora_cost.factor(len(adapters))
        shared = self.shared_host
        if shared is not None:
            self.step_cores = shared.of(shape)
            duration *= max(1.0, (others_cores + self.step_cores) / shared.host_cores)
        self.busy_seconds += duration
        self.num_steps += 1
        return duration

    def finish_step(self, now: float) -> list[RequestRecord]:
        """The step ends at `now`: tokens appear, finished requests leave; returns those."""
        output = self._pending
        self._pending = None
        others = output.others
        sampled = set(output.decodes.request_ids)  # every plain decode samples
        if self._all_sample:  # most steps: every request gets a token
            sampled.update(map(_rid, others))
        else:
            sampled.update(compress(map(_rid, others), map(_sample, others)))
        finished = self.scheduler.update(output, self._tokens)
        self.generation_tokens_total += len(sampled)
        records = self.records
        if self._on_tokens is not None and sampled:
            self._on_tokens(Counter(records[rid].request.tenant or "" for rid in sampled))
        itl_bins = self.itl_bins
        prev = self._prev_sampled
        left_at = self._left_at
        if prev:
            # Only the few ids that joined or left since the previous step are looked at one by one.
            fresh = []
            for rid in sampled ^ prev:
                if rid in sampled:
                    fresh.append(rid)
                else:  # got no token this step (preempted, or out of budget)
                    left_at[rid] = self._prev_end
            # Gaps of requests that also got a token at the previous step's end: all the same, one bin.
            num_cont = len(sampled) - len(fresh)
            if num_cont:
                key = itl_bin(now - self._prev_end)
                itl_bins[key] = itl_bins.get(key, 0) + num_cont
        else:
            fresh = sampled
        if fresh:
            no_token_yet = self._no_token_yet
            for rid in fresh:
                if rid in no_token_yet:
                    no_token_yet.discard(rid)
                    rec = records[rid]
                    rec.first_token = now
                    ttft = now - rec.request.arrival
                    self.recent_ttft.append((now, ttft))
                    self._on_first_token(ttft)
                else:  # back after a gap
                    key = itl_bin(now - left_at.pop(rid))
                    itl_bins[key] = itl_bins.get(key, 0) + 1
        done = []
        if finished:
            tokens = self._tokens
            for request in finished:
                rid = request.request_id
                rec = records.pop(rid)
                del tokens[rid]
                sampled.discard(rid)
                rec.finished = rec.last_token = now
                rec.num_emitted = len(request.output_token_ids)
                rec.num_cached_tokens = request.num_cached_tokens
                rec.num_preemptions = request.num_preemptions
                done.append(rec)
                if request.lora is not None:
                    self.adapters.release(request.lora.name)  # type: ignore[union-attr]
            self.num_served += len(done)
        self._prev_sampled = sampled
        self._prev_end = now
        return done

    def take_events(self) -> list[KVEvent]:
        return self.kv.take_events()

    def ttft_window(self, now: float, window_s: float) -> list[float]:
        recent = self.recent_ttft
        while recent and now - recent[0][0] > window_s:
            recent.popleft()
        return [v for _, v in recent]
