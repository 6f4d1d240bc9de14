"""One simulated serving pod: the real `Scheduler` and `KVCacheManager`, with the forward pass replaced by a cost.

A step is exactly the engine's: `schedule()` -> (the model would run) -> `update(output, sampled)`. The
"sampled" tokens are the request's predetermined output tokens, so lengths are exact and a session's next
turn finds its previous answer's KV under the same hashes. The step lasts `cost.step_seconds(shape)` of
virtual time; tokens appear when it ends. The KV manager's TTL clock is the simulation clock.

Per-request timings and the pod's cumulative counters are kept here, as the server's metrics would.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from tokenfleet.runtime.config import SchedulerConfig
from tokenfleet.runtime.engine.kv_cache.block_hash import hash_extra
from tokenfleet.runtime.engine.kv_cache.kv_events import KVEvent
from tokenfleet.runtime.engine.kv_cache.manager import KVCacheManager
from tokenfleet.runtime.engine.request import Request
from tokenfleet.runtime.engine.sampling_params import SamplingParams
from tokenfleet.runtime.engine.scheduler import Scheduler
from tokenfleet.runtime.errors import InvalidRequest
from tokenfleet.sim.cost_model import CostModel, batch_shape
from tokenfleet.sim.errors import SimInputError
from tokenfleet.sim.workload import SimRequest

# 1%-wide log bins: bin k holds gaps in [1.01^k, 1.01^(k+1)).
ITL_BINS_PER_E = 1.0 / math.log(1.01)


@dataclass(slots=True)
class RequestRecord:
    """What a client would measure for one request (virtual seconds)."""

    request: SimRequest
    replica: str
    first_scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    finished: float | None = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    num_emitted: int = 0
    rejected: str | None = None  # why the pod refused it (never fits, too long)


@dataclass(frozen=True, slots=True)
class ReplicaConfig:
    scheduler: SchedulerConfig
    block_size: int = 16
    max_model_len: int = 8192
    eviction: str = "lru"
    ttl_seconds: float | None = None
    model_name: str = "model"


class SimReplica:
    def __init__(
        self,
        name: str,
        cost: CostModel,
        config: ReplicaConfig,
        clock: Callable[[], float],
        on_first_token: Callable[[float], None],
    ) -> None:
        num_blocks = cost.num_kv_blocks(config.block_size)
        if num_blocks < 1:
            raise SimInputError(
                "fleet",
                f"the model's weights leave no room for a KV cache on {cost.name}: use more TP or a bigger GPU",
            )
        self.name = name
        self.cost = cost
        self.kv = KVCacheManager(
            num_blocks,
            config.block_size,
            enable_caching=True,
            hash_extra=hash_extra(config.model_name),
            eviction=config.eviction,
            enable_kv_events=True,
            ttl_seconds=config.ttl_seconds,
            clock=clock,
        )
        self.scheduler = Scheduler(config.scheduler, self.kv, config.max_model_len)
        self.records: dict[str, RequestRecord] = {}
        self.itl_bins: dict[int, int] = {}  # log-spaced bins of inter-token gaps (results.py reads them)
        self._on_first_token = on_first_token
        self._pending = None  # the step in flight
        self.busy = False
        self.num_steps = 0
        self.busy_seconds = 0.0
        self.generation_tokens_total = 0
        self.num_served = 0
        # (time, ttft) of recent first tokens and (time, generated total) for the autoscaler's windows.
        self.recent_ttft: deque[tuple[float, float]] = deque()

    # ---- the pod's load report ------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    @property
    def kv_usage(self) -> float:
        return self.kv.usage

    def has_work(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # ---- requests -------------------------------------------------------------------------------------

    def add(self, sreq: SimRequest, now: float) -> RequestRecord:
        record = RequestRecord(sreq, self.name)
        params = SamplingParams(max_tokens=len(sreq.output), ignore_eos=True, temperature=0.0)
        request = Request(
            sreq.request_id,
            sreq.prompt,
            params,
            priority=sreq.priority,
            arrival_time=now,
            block_hashes=list(sreq.block_hashes),  # the router's hashes: the same function, computed once
        )
        try:
            self.scheduler.add_request(request)
        except InvalidRequest as e:  # CapacityError, ContextLengthExceeded: the pod answers 400
            record.rejected = f"{type(e).__name__}: {e}"
            record.finished = now
            return record
        self.records[sreq.request_id] = record
        return record

    # ---- the step -------------------------------------------------------------------------------------

    def start_step(self, now: float) -> float | None:
        """Schedule a step at `now`; its duration, or None when there is nothing to run."""
        output = self.scheduler.schedule()
        if output.is_empty:
            self.busy = False
            return None
        records = self.records
        for entry in output.scheduled:
            rec = records[entry[0]]
            if rec.first_scheduled is None:
                rec.first_scheduled = now
        self._pending = output
        self.busy = True
        duration = self.cost.step_seconds(batch_shape(output.scheduled))
        self.busy_seconds += duration
        self.num_steps += 1
        return duration

    def finish_step(self, now: float) -> list[RequestRecord]:
        """The step ends at `now`: tokens appear, finished requests leave; returns those."""
        output = self._pending
        self._pending = None
        sampled: dict[str, list[int]] = {}
        records = self.records
        itl_bins = self.itl_bins
        log, floor = math.log, math.floor
        for rid, _, _, _, sample, _ in output.scheduled:
            if not sample:
                continue
            rec = records.get(rid)
            if rec is None:
                continue
            # The "model" emits the request's next predetermined token (ignore_eos, exact max_tokens: the
            # scheduler takes every sampled token, so the count of emitted ones is the index).
            sampled[rid] = [rec.request.output[rec.num_emitted]]
            rec.num_emitted += 1
            if rec.first_token is None:
                rec.first_token = now
                ttft = now - rec.request.arrival
                self.recent_ttft.append((now, ttft))
                self._on_first_token(ttft)
            else:
                key = floor(log(max(now - rec.last_token, 1e-7)) * ITL_BINS_PER_E)
                itl_bins[key] = itl_bins.get(key, 0) + 1
            rec.last_token = now
        self.generation_tokens_total += len(sampled)
        finished = self.scheduler.update(output, sampled)
        done = []
        for request in finished:
            rec = records.pop(request.request_id)
            rec.finished = now
            rec.num_cached_tokens = request.num_cached_tokens
            rec.num_preemptions = request.num_preemptions
            done.append(rec)
        self.num_served += len(done)
        return done

    def take_events(self) -> list[KVEvent]:
        return self.kv.take_events()

    def ttft_window(self, now: float, window_s: float) -> list[float]:
        recent = self.recent_ttft
        while recent and now - recent[0][0] > window_s:
            recent.popleft()
        return [v for _, v in recent]
