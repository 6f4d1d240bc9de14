"""The discrete-event loop: arrivals, engine steps, load polls, autoscaling decisions and cold starts on one
virtual clock.

Events are (time, sequence number, kind, payload) in a heap; the sequence number makes equal-time events
run in the order they were scheduled, so a run is a pure function of its config and seed. Each replica
steps back to back while it has work (an engine loop), waking when a request arrives. The router picks a
Ready replica for every arrival, which the request reaches the cost model's `request_overhead_s` later
(what serving adds outside the engine's steps: fitted for a served `cpu` profile); KV events reach the
router's prefix index at the end of the step that caused them (the pod publishes after every step and the
router long-polls), load reports every `probe_interval_s`. With `fleet.cpu_shared_host` the replicas share
one host's cores: a step stretches by the demand of the engines computing when it starts.
Every `autoscale_interval_s` the operator's policy (`decide`) sees one sample per replica and sets the
count, and between those decisions, every `demand_interval_s`, the operator's demand check
(`demand_calls_decision`: the router's held requests, the pods' queues) runs it at once: new replicas become Ready after `cold_start_s`; removed ones stop getting requests at once, finish
what they hold and then leave (a lossless scale-down). With `autoscaling.idle: sleep` the operator's warm
tier (`operator/warm_tier.plan`, unchanged) decides which idle replicas sleep and which sleepers wake; a
woken replica is Ready after `wake_s`, and a request the router holds wakes one sleeper at once when no
awake replica is Ready or on its way (the router's wake on demand). A count lowered below the pods that exist removes
sleepers first (the ReplicaSet's not-Ready-first order). Sleepers hold their GPUs: they count in
replica-seconds.
With LoRA adapters (`workload.adapters`) a pod loading an adapter for a request schedules that request
when the load completes (an ADAPTER_LOADED event, `lora.load_s` later); each load report lists the pod's
loaded adapters and its room, which is what the router places by. A pod with no room refuses the request
(503 `lora_slots_busy`) and the router retries it on another pod, as the live proxy does.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable, Iterator

from tokenfleet.operator import warm_tier
from tokenfleet.operator.adapter_copies import PIN_TICKS, PodLoad, pins
from tokenfleet.operator.autoscaling_policy import History, PodSample, PodState, decide, demand_calls_decision
from tokenfleet.operator.pod_metrics import histogram_quantile
from tokenfleet.runtime.engine.long_lived_heap import long_lived_heap
from tokenfleet.runtime.router.priority import Waiter
from tokenfleet.runtime.server.metrics import TTFT_BUCKETS
from tokenfleet.sim.config import SimConfig
from tokenfleet.sim.cost_model import CoreUsage, CostModel
from tokenfleet.sim.errors import SimInputError
from tokenfleet.sim.handoff import Handoff, KVHandoffs
from tokenfleet.sim.replica import ADAPTERS_BUSY, ReplicaConfig, RequestRecord, SimReplica
from tokenfleet.sim.results import Collector
from tokenfleet.sim.router import SimRouter
from tokenfleet.sim.workload import SimRequest

(
    ARRIVAL,
    FOLLOW_UP,
    STEP,
    PROBE,
    SCALE,
    READY,
    TICK,
    HANDOFF,
    DELIVER,
    QUEUE_DEADLINE,
    DEMAND,
    ADAPTER_LOADED,
    ADAPTER_PINS,
) = range(13)


class _Pod:
    __slots__ = ("asleep", "created", "draining", "inbound", "ready", "replica", "retired", "role", "tokens")

    def __init__(self, replica: SimReplica, created: float, ready: bool, role: str = "both") -> None:
        self.replica = replica
        self.role = role
        self.created = created
        self.ready = ready
        self.draining = False
        self.asleep = False  # the warm tier: no requests, no capacity, its GPUs still held
        self.retired: float | None = None
        self.inbound = 0  # routed here, still on their way (the cost model's request overhead)
        self.tokens: deque[tuple[float, int]] = deque()  # (time, generated total) for the tokens/s window


class Simulation:
    def __init__(
        self,
        config: SimConfig,
        workload,
        cost: CostModel,
        model_name: str,
        max_model_len: int,
        kv_bytes_per_token: float = 0.0,
    ) -> None:
        self.config = config
        self.workload = workload
        self.cost = cost
        self.now = 0.0
        self._heap: list[tuple[float, int, int, object]] = []
        self._seq = itertools.count()
        self._arrivals: Iterator[SimRequest] = iter(workload.arrivals())
        self._arrivals_done = False
        self._pending_followups = 0
        self.collector = Collector(config)
        self.router = SimRouter(
            config.routing,
            config.cache.block_size,
            model_name,
            self.clock,
            placement=config.lora.placement,
            max_copies=config.lora.max_copies,
            min_copies=config.lora.min_copies,
        )
        self.replica_config = ReplicaConfig(
            config.scheduler,
            config.cache,
            max_model_len,
            model_name,
            config.lora if config.uses_adapters else None,
        )
        self.pods: dict[str, _Pod] = {}
        self._names = itertools.count()
        self.history = History()
        self.scale_events: list[tuple[float, int, int, str]] = []
        self.last_arrival = 0.0
        self._tick_s = 1.0
        self.handoffs: KVHandoffs | None = None
        if config.disaggregation is not None:
            self.handoffs = KVHandoffs(
                config.disaggregation,
                kv_bytes_per_token,
                config.cache.block_size,
                config.fleet.tp,
                self.clock,
            )
        self._pending_handoffs = 0
        self._warm = config.autoscaling is not None and config.autoscaling.idle == "sleep"
        self._shared_host: CoreUsage | None = None
        if config.fleet.cpu_shared_host:
            self._shared_host = getattr(cost, "cores", None)
            if self._shared_host is None:
                raise SimInputError(
                    "fleet.cpu_shared_host",
                    "the cpu profile does not say how many cores its engine keeps busy",
                    "a profile from `tokenfleet simulate calibrate --via server`",
                )
        self._phases: dict[str, RequestRecord] = {}  # request id -> its prefill record, while it decodes
        self._tried: dict[str, frozenset[str]] = {}  # request id -> the pods that refused it its adapter
        self.adapter_retries = 0  # requests sent to another pod after such a refusal
        self.pin_ticks = 0  # the operator's adapter ticks (with lora.min_copies) ...
        self.pin_ticks_met = 0  # ... after the first, those that found every minimum loaded already
        # Called at each timeline tick with the virtual time (the speed experiment reads the CPU clock there).
        self.on_tick: Callable[[float], None] | None = None

    def clock(self) -> float:
        return self.now

    def _push(self, t: float, kind: int, payload: object = None) -> None:
        heapq.heappush(self._heap, (t, next(self._seq), kind, payload))

    # ---- replicas -----------------------------------------------------------------------------------------

    def _add_pod(self, ready: bool, role: str = "both") -> _Pod:
        name = f"replica-{next(self._names)}" if role == "both" else f"{role}-{next(self._names)}"
        replica = SimReplica(
            name,
            self.cost,
            self.replica_config,
            self.clock,
            self.collector.first_token,
            self._shared_host,
            self._adapter_load_started,
            self.router.streamed if self.router.fair is not None else None,
        )
        pod = _Pod(replica, self.now, ready, role)
        self.pods[name] = pod
        if ready:
            self.router.add_endpoint(name, role)
        else:
            self._push(self.now + self.config.cold_start_s, READY, name)
        return pod

    def _live(self) -> list[_Pod]:
        """The awake pods that stay (Ready or starting)."""
        return [p for p in self.pods.values() if p.retired is None and not p.draining and not p.asleep]

    def _asleep(self) -> list[_Pod]:
        return [p for p in self.pods.values() if p.retired is None and p.asleep]

    def _sleep(self, pod: _Pod) -> None:
        pod.asleep, pod.ready = True, False
        self.router.remove_endpoint(pod.replica.name)

    def _wake(self, pod: _Pod) -> None:
        pod.asleep = False
        self._push(self.now + self.config.wake_s, READY, pod.replica.name)

    def _wake_on_demand(self) -> None:
        """A request is held: as the router does, wake one sleeper when no awake pod is in rotation and none
        is on its way (held behind busy awake pods, more capacity is the autoscaler's decision)."""
        if self._live():
            return
        sleepers = sorted(self._asleep(), key=lambda p: p.replica.name)
        if sleepers:
            self._wake(sleepers[0])

    def _retire_if_idle(self, pod: _Pod) -> None:
        if (
            pod.draining
            and pod.retired is None
            and not pod.inbound
            and not pod.replica.has_work()
            and not pod.replica.busy
        ):
            pod.retired = self.now

    def _scale_to(self, target: int, reason: str, record: bool = True) -> None:
        live = self._live()
        current = len(live)
        if target > current:
            for _ in range(target - current):
                self._add_pod(ready=self.config.cold_start_s == 0)
        elif target < current:
            # Starting pods go first (newest first), then the least loaded Ready ones.
            order = sorted(
                live,
                key=lambda p: (
                    p.ready,
                    p.replica.num_running + p.replica.num_waiting,
                    -p.created,
                    p.replica.name,
                ),
            )
            for pod in order[: current - target]:
                pod.draining = True
                self.router.remove_endpoint(pod.replica.name)
                if not pod.ready:
                    pod.retired = self.now
                self._retire_if_idle(pod)
        if record and target != current:
            self.scale_events.append((self.now, current, target, reason))

    # ---- events -------------------------------------------------------------------------------------------

    def _next_arrival(self) -> None:
        try:
            sreq = next(self._arrivals)
        except StopIteration:
            self._arrivals_done = True
            return
        self._push(sreq.arrival, ARRIVAL, sreq)

    def _route(self, sreq: SimRequest) -> None:
        role = "both" if self.handoffs is None else "prefill"
        self.router.arrived(sreq)
        if self.router.queue:  # as the router's gate: behind the waiters, who may go first
            self._enqueue(sreq, role)
            self._dispatch_queued()
            return
        name = self.router.pick(sreq, role)
        if name is None:
            self._enqueue(sreq, role)
            return
        self._deliver(sreq, name, role)

    def _enqueue(self, sreq: SimRequest, role: str, item: object = None) -> None:
        waiter = self.router.enqueue(sreq, role, item)
        if isinstance(waiter, str):  # the router's queue is full: refused at once
            self._refused(sreq, waiter)
            return
        if waiter.deadline != float("inf"):
            self._push(waiter.deadline, QUEUE_DEADLINE, waiter)
        if self._warm:
            self._wake_on_demand()

    def _refused(self, sreq: SimRequest, why: str) -> None:
        """The router answered with an error (429/503): the client's request ends there."""
        self._ended(RequestRecord(sreq, "", rejected=why))

    def _ended(self, rec: RequestRecord) -> None:
        """The client's request is over — served, or refused by the router or a pod (nothing emitted)."""
        self.router.ended(rec.request)
        self.collector.finished(rec)

    def _on_queue_deadline(self, waiter: Waiter) -> None:
        why = self.router.timed_out(waiter)
        if why is not None:
            self._refused(waiter.item[0], why)

    def _dispatch_queued(self) -> None:
        for sreq, name, role, item in self.router.dispatch_queued():
            self._deliver(sreq, name, role, item)

    def _deliver(
        self, sreq: SimRequest, name: str, role: str = "both", handoff: Handoff | None = None
    ) -> None:
        pod = self.pods[name]
        if role == "decode":  # the decode pod fetches the prompt's KV first, then runs the request
            assert handoff is not None and self.handoffs is not None
            prefill = self.pods.get(handoff.prefill_pod)
            duration = self.handoffs.start(
                handoff, prefill.replica if prefill else None, pod.replica, self.now
            )
            self._pending_handoffs += 1
            self._push(self.now + duration, HANDOFF, handoff)
            return
        if self.cost.request_overhead_s > 0:
            pod.inbound += 1
            self._push(self.now + self.cost.request_overhead_s, DELIVER, (sreq, pod, role))
            return
        self._add_to_replica(sreq, pod, role)

    def _on_deliver(self, item: tuple[SimRequest, _Pod, str]) -> None:
        sreq, pod, role = item
        pod.inbound -= 1
        self._add_to_replica(sreq, pod, role)

    def _add_to_replica(self, sreq: SimRequest, pod: _Pod, role: str) -> None:
        record = pod.replica.add(sreq, self.now, max_tokens=1 if role == "prefill" else None)
        self._admitted(record, pod)

    def _admitted(self, record: RequestRecord, pod: _Pod) -> None:
        if record.rejected == ADAPTERS_BUSY:
            self._adapter_busy(record.request, pod)
            return
        if self._tried:
            self._tried.pop(record.request.request_id, None)
        self.collector.admitted(record)
        if record.rejected is not None:
            self.router.release(pod.replica.name)
            self._ended(record)
            return
        if not pod.replica.busy:
            self._start_step(pod)

    def _adapter_busy(self, sreq: SimRequest, pod: _Pod) -> None:
        """The pod had no room for the request's adapter (its 503 `lora_slots_busy`). As the router's
        proxy does: no room there until its next report, and the request goes to a pod it has not tried,
        within `retries.max_attempts` attempts; past them, or with no pod left to try, the client gets the
        503 and the router makes a place for the adapter's next requests (`SimRouter.adapter_refused`)."""
        name = pod.replica.name
        self.router.release(name)
        self.router.adapter_busy(name)
        rid = sreq.request_id
        tried = self._tried.get(rid, frozenset()) | {name}
        target = None
        if len(tried) < self.config.routing.retries.max_attempts:
            target = self.router.pick(sreq, pod.role, tried)
        if target is None:
            self._tried.pop(rid, None)
            self.router.adapter_refused(sreq, pod.role)  # a place is made for the next ones
            self._refused(sreq, ADAPTERS_BUSY)
            return
        self._tried[rid] = tried
        self.adapter_retries += 1
        self._deliver(sreq, target, pod.role)

    def _on_handoff(self, handoff: Handoff) -> None:
        """The prompt's KV reached the decode pod: insert it, release the hold, run the rest there."""
        self._pending_handoffs -= 1
        assert self.handoffs is not None and handoff.decode_pod is not None
        decode = self.pods[handoff.decode_pod]
        prefill = self.pods.get(handoff.prefill_pod)
        self.handoffs.finish(handoff, prefill.replica if prefill else None, decode.replica)
        first = handoff.prefill
        record = decode.replica.add(first.request, self.now, resumed_at=first.first_token)
        if record.rejected is None:  # a rejected request never finishes, so nothing would pop it
            self._phases[first.request.request_id] = first
        self._admitted(record, decode)

    def _adapter_load_started(self, name: str, adapter: str, ready_at: float) -> None:
        self._push(ready_at, ADAPTER_LOADED, (name, adapter))

    def _on_adapter_loaded(self, item: tuple[str, str]) -> None:
        """A pod finished loading an adapter: the requests parked for it reach its scheduler."""
        name, adapter = item
        pod = self.pods[name]
        for record in pod.replica.adapter_loaded(adapter, self.now):  # refused by the scheduler: a 400
            self.router.release(name)
            self._ended(record)
        if not pod.replica.busy:
            self._start_step(pod)

    def _start_step(self, pod: _Pod) -> None:
        replica = pod.replica
        others = 0.0
        if self._shared_host is not None:  # engines computing at once share the host's cores
            others = sum(p.replica.step_cores for p in self.pods.values() if p.replica.busy and p is not pod)
        duration = replica.start_step(self.now, others)
        if duration is not None:
            if replica.announced:  # published before the forward: the router knows while it runs
                for ev in replica.announced:
                    self.router.announced(replica.name, ev)
                replica.announced.clear()
            self._push(self.now + duration, STEP, pod)
        else:
            self._retire_if_idle(pod)

    def _step_done(self, pod: _Pod) -> None:
        replica = pod.replica
        done = replica.finish_step(self.now)
        events = replica.take_events()
        if events:
            self.router.apply_events(replica.name, events)
        for rec in done:
            self._finished(rec, pod)
        self._start_step(pod)
        if done and self.router.num_queued:
            self._dispatch_queued()

    def _finished(self, rec: RequestRecord, pod: _Pod) -> None:
        self.router.release(pod.replica.name)
        sreq = rec.request
        if pod.role == "prefill" and rec.rejected is None and len(sreq.output) > 1:
            # Hold the prompt's blocks now, in the step that freed them, then on to a decode pod.
            assert self.handoffs is not None
            handoff = self.handoffs.hold(pod.replica, rec, self.now)
            name = self.router.pick(sreq, "decode")
            if name is None:
                self._enqueue(sreq, "decode", handoff)
            else:
                self._deliver(sreq, name, "decode", handoff)
            return
        if pod.role == "decode":  # the client's view spans both phases
            first = self._phases.pop(sreq.request_id)
            rec.reached, rec.first_scheduled = first.reached, first.first_scheduled
            rec.num_cached_tokens = first.num_cached_tokens
            rec.num_preemptions += first.num_preemptions
        self._ended(rec)
        follow = self.workload.follow_up(rec.request, self.now)
        if follow is not None:
            self._pending_followups += 1
            self._push(follow.arrival, FOLLOW_UP, follow)

    def _probe(self) -> None:
        for pod in self._live():
            if pod.ready:
                r = pod.replica
                held = r.adapters
                self.router.report(
                    r.name,
                    r.num_running + r.num_waiting,
                    r.kv_usage,
                    None if held is None else held.loaded(),
                    None if held is None else held.room(self.now),
                    None if held is None else held.active(),
                    r.scheduler.max_loras,
                )

    def _on_adapter_pins(self, _: object) -> None:
        """The operator's adapter tick: each adapter's minCopies pinned, for a lease of a few ticks, on the
        Ready pods `adapter_copies.pins` chooses from their load reports (holders first, then the least
        loaded with room), as operator/adapter_report.py does."""
        lora = self.config.lora
        interval = lora.pin_interval_s
        pods = {p.replica.name: p for p in self._live() if p.ready and p.replica.adapters is not None}
        loads = []
        for name, pod in pods.items():
            r, held = pod.replica, pod.replica.adapters
            assert held is not None
            loads.append(
                PodLoad(name, frozenset(held.loaded()), held.room(self.now), r.num_running + r.num_waiting)
            )
        listed = self.config.workload.adapters.count if self.config.workload.adapters is not None else 0
        if self.pin_ticks:  # the first tick (the fleet's start) finds nothing loaded yet
            self.pin_ticks_met += all(
                sum(name in p.adapters for p in loads) >= min(n, len(loads))
                for name, n in lora.min_copies.items()
            )
        self.pin_ticks += 1
        until = self.now + PIN_TICKS * interval
        for name, adapter in pins(lora.min_copies, loads, lora.max_adapters, listed):
            held = pods[name].replica.adapters
            assert held is not None
            held.pin(adapter, until, self.now)  # a pod with no room refuses; the next tick tries again
        self._push(self.now + interval, ADAPTER_PINS)

    def _sample(self, pod: _Pod, window_s: float, quantile: float) -> PodSample:
        r = pod.replica
        if not pod.ready:
            return PodSample(r.name, PodState.STARTING)
        ttfts = r.ttft_window(self.now, window_s)
        ttft = None
        if ttfts:
            # The operator sees TTFT through the server's histogram buckets: so does the simulation.
            counts = [sum(1 for v in ttfts if v <= le) for le in TTFT_BUCKETS]
            buckets = [*zip(TTFT_BUCKETS, counts, strict=True), (float("inf"), len(ttfts))]
            ttft = histogram_quantile(quantile, buckets)
        pod.tokens.append((self.now, r.generation_tokens_total))
        while len(pod.tokens) > 1 and self.now - pod.tokens[1][0] >= window_s:
            pod.tokens.popleft()
        t0, n0 = pod.tokens[0]
        rate = (r.generation_tokens_total - n0) / (self.now - t0) if self.now > t0 else 0.0
        return PodSample(r.name, PodState.READY, r.num_waiting, r.num_running, r.kv_usage, ttft, rate)

    def _autoscale(self) -> None:
        spec = self.config.autoscaling
        assert spec is not None
        window, quantile = (
            (spec.targets.ttft.window_seconds, spec.targets.ttft.percentile)
            if spec.targets.ttft
            else (60.0, 0.9)
        )
        live = self._live()
        samples = [self._sample(p, window, quantile) for p in live]
        pending = self.router.num_queued
        d = decide(len(live), samples, spec, self.history, self.now, pending_requests=pending)
        self.history = d.history
        if self._warm:
            self._warm_tier(d.replicas, d.reason, live, samples)
        else:
            self._scale_to(d.replicas, d.reason)
        if self.router.num_queued:
            self._dispatch_queued()

    def _warm_tier(self, desired: int, reason: str, live: list[_Pod], samples: list[PodSample]) -> None:
        """The operator's warm tier: its plan, then the ReplicaSet's order for a lowered count."""
        assert self.config.autoscaling is not None
        asleep = self._asleep()
        samples = samples + [PodSample(p.replica.name, PodState.SLEEPING) for p in asleep]
        written = len(live) + len(asleep)
        plan = warm_tier.plan(desired, written, samples, self.config.autoscaling)
        for name in plan.wake:
            self._wake(self.pods[name])
        for name in plan.sleep:
            pod = self.pods[name]
            if not pod.inbound:  # a request on its way: the live sleep would wait for it; skip this time
                self._sleep(pod)
        if plan.replicas < written:
            gone = sorted(asleep, key=lambda p: p.replica.name)[: written - plan.replicas]
            for pod in gone:
                pod.retired = self.now
            if len(gone) < written - plan.replicas:
                self._scale_to(plan.replicas, reason, record=False)
        elif plan.replicas > written:
            for _ in range(plan.replicas - written):
                self._add_pod(ready=self.config.cold_start_s == 0)
        if desired != len(live):
            self.scale_events.append((self.now, len(live), desired, reason))

    def _tick(self) -> None:
        pods = [p for p in self.pods.values() if p.retired is None]
        ready = [p for p in pods if p.ready and not p.draining]
        waiting = sum(p.replica.num_waiting for p in pods) + self.router.num_queued
        running = sum(p.replica.num_running for p in pods)
        kv = sum(p.replica.kv_usage for p in ready) / len(ready) if ready else 0.0
        self.collector.tick(
            self.now, waiting, running, kv, len(ready), len([p for p in pods if not p.draining])
        )

    # ---- event handlers (one per event kind) ------------------------------------------------------------

    def _on_arrival(self, sreq: SimRequest) -> None:
        self.last_arrival = self.now
        self._next_arrival()
        self.collector.arrived(sreq)
        self._route(sreq)

    def _on_follow_up(self, sreq: SimRequest) -> None:
        self._pending_followups -= 1
        self.collector.arrived(sreq)
        self._route(sreq)

    def _on_probe(self, _: object) -> None:
        self._probe()
        self._push(self.now + self.config.probe_interval_s, PROBE)

    def _on_scale(self, _: object) -> None:
        self._autoscale()
        self._push(self.now + self.config.autoscale_interval_s, SCALE)

    def _on_demand(self, _: object) -> None:
        """The operator's demand check between decisions (`demand_calls_decision`, unchanged): held
        requests, or the pods' queues beyond the target, decide at once."""
        spec = self.config.autoscaling
        assert spec is not None and self.config.demand_interval_s is not None
        live = self._live()
        waiting = sum(p.replica.num_waiting for p in live if p.ready)
        if demand_calls_decision(len(live), self.router.num_queued, waiting, spec):
            self._autoscale()
        self._push(self.now + self.config.demand_interval_s, DEMAND)

    def _on_ready(self, name: str) -> None:
        pod = self.pods[name]
        if pod.retired is None and not pod.draining and not pod.asleep:
            pod.ready = True
            self.router.add_endpoint(name, pod.role)
            self._dispatch_queued()

    def _on_tick(self, _: object) -> None:
        self._tick()
        if self.on_tick is not None:
            self.on_tick(self.now)
        self._push(self.now + self._tick_s, TICK)

    # ---- the loop -----------------------------------------------------------------------------------------

    def _idle(self) -> bool:
        if (
            not self._arrivals_done
            or self._pending_followups
            or self._pending_handoffs
            or self.router.num_queued
        ):
            return False
        return not any(
            p.replica.busy or p.replica.has_work() or p.inbound
            for p in self.pods.values()
            if p.retired is None
        )

    def run(self):
        cfg = self.config
        num_prefill = cfg.disaggregation.prefill_replicas if cfg.disaggregation else 0
        for i in range(cfg.fleet.replicas):
            role = "both" if cfg.disaggregation is None else "prefill" if i < num_prefill else "decode"
            self._add_pod(ready=True, role=role)
        for _ in range(cfg.start_asleep):
            self._sleep(self._add_pod(ready=True))
        with long_lived_heap():
            return self._run_events(cfg)

    def _run_events(self, cfg: SimConfig):
        self._next_arrival()
        self._push(0.0, PROBE)
        if cfg.autoscaling is not None:
            self._push(0.0, SCALE)
            if cfg.demand_interval_s is not None and cfg.disaggregation is None:
                self._push(cfg.demand_interval_s, DEMAND)
        horizon = cfg.run_until_s or (cfg.trace and self.workload.duration_s) or cfg.workload.duration_s
        self._push(0.0, TICK)
        if cfg.uses_adapters and any(cfg.lora.min_copies.values()):
            self._push(0.0, ADAPTER_PINS)
        self._tick_s = float(horizon) / cfg.timeline_points
        handlers = {
            STEP: self._step_done,
            ARRIVAL: self._on_arrival,
            FOLLOW_UP: self._on_follow_up,
            PROBE: self._on_probe,
            SCALE: self._on_scale,
            READY: self._on_ready,
            TICK: self._on_tick,
            HANDOFF: self._on_handoff,
            DELIVER: self._on_deliver,
            QUEUE_DEADLINE: self._on_queue_deadline,
            DEMAND: self._on_demand,
            ADAPTER_LOADED: self._on_adapter_loaded,
            ADAPTER_PINS: self._on_adapter_pins,
        }
        heap = self._heap
        pop = heapq.heappop
        while heap:
            t, _, kind, payload = pop(heap)
            self.now = t
            handlers[kind](payload)
            if kind != STEP and self._idle() and (cfg.run_until_s is None or t >= cfg.run_until_s):
                break
            if self._arrivals_done and t > self.last_arrival + cfg.drain_limit_s:
                break
        end = self.now
        for pod in self.pods.values():
            if pod.retired is None:
                pod.retired = end
        return self.collector.results(self, end)
