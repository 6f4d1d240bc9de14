"""The fleet: every endpoint the router knows, what it knows about them, and the routing decision.

Owns the endpoint set, the exact and approximate prefix indexes, one monitor task and one KV-event follower
per endpoint, the strategy and the queue. Everything here runs on the event loop; discovery threads hop
onto it. `pick()` is the decision: model targets (primary, then fallbacks) -> available untried endpoints
-> prefix match per endpoint -> `decision.decide` (the in-flight limit, the load figure, the strategy; the
simulator calls the same function). Everything that ages (health, the recent-route memories, the
strategy's history) runs on the injected `clock`. `apply()` takes a new config live: endpoints of unchanged
backends, their prefix indexes and the strategy's history stay.

What a pod is computing right now is known two ways, so requests sharing a prefix follow the first one
while its prefill runs (before the pod's `stored` events exist): the pod's own `scheduled` events (every
router following the pod sees them, so active-active replicas agree) and this router's recent routes
(which cover the moments before the pod schedules the request).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import aiohttp
from tokenfleet.runtime.engine.fair_share import FairShare
from tokenfleet.runtime.router.adapter_placement import AdapterDrains, adapter_candidates, within_max_copies
from tokenfleet.runtime.router.config import AdapterCopies, Backend, RouterConfig
from tokenfleet.runtime.router.decision import EndpointState, approx_extra, decide, exact_matches
from tokenfleet.runtime.router.endpoints import Endpoint, EndpointSet
from tokenfleet.runtime.router.health import Probe
from tokenfleet.runtime.router.kv_events import KVEventFollower, apply_reply
from tokenfleet.runtime.router.metrics import RouterMetrics
from tokenfleet.runtime.router.model_routes import RouteTarget, route_targets
from tokenfleet.runtime.router.monitor import monitor_endpoint, probe_once
from tokenfleet.runtime.router.pod_auth import PodAuth
from tokenfleet.runtime.router.prefix_index import ApproximatePrefixIndex, ExactPrefixIndex, RecentRoutes
from tokenfleet.runtime.router.priority import PriorityGate
from tokenfleet.runtime.router.prompt_blocks import text_block_hashes, token_block_hashes
from tokenfleet.runtime.router.scoring import Decision, RouteQuery, make_strategy
from tokenfleet.runtime.router.wake import Waker

# How long the router's own routes count as "being prefilled there" before the pod's KV events must say so.
RECENT_ROUTES_TTL_S = 30.0


@dataclass(frozen=True, slots=True)
class PromptKey:
    """What the router knows of a prompt: token ids (None without a tokenizer) or its canonical text."""

    token_ids: tuple[int, ...] | None
    text: str
    cache_salt: str | None
    adapter: str | None = None  # the LoRA adapter it names (its blocks are hashed apart from the base's)


@dataclass(frozen=True, slots=True)
class Pick:
    endpoint: Endpoint
    decision: Decision
    target: RouteTarget
    num_blocks: int
    approx_hashes: tuple[bytes, ...]


class Fleet:
    def __init__(
        self,
        config: RouterConfig,
        metrics: RouterMetrics,
        session: aiohttp.ClientSession,
        pod_auth: PodAuth | None = None,
        clock: Callable[[], float] = time.monotonic,
        watch: bool = True,
    ) -> None:
        """`watch` False: no probe or KV-event tasks are started; the caller reports health (`report`) and
        feeds each pod's KV-event replies (`kv_reply`) itself, as a replay or the simulator-agreement test
        does."""
        self.config = config
        self.clock = clock
        self.watch = watch
        self.pod_auth = pod_auth
        self.metrics = metrics
        self.session = session
        self.endpoints = EndpointSet(config.discovery)
        self.recent = RecentRoutes(config.discovery.approximate_index_blocks, RECENT_ROUTES_TTL_S, clock)
        # Blocks pods announced as being prefilled (`scheduled` events), keyed like the exact index.
        self.scheduled = RecentRoutes(config.discovery.approximate_index_blocks, RECENT_ROUTES_TTL_S, clock)
        self.exact = ExactPrefixIndex(on_removal=self._evicted)
        self.approx = ApproximatePrefixIndex(config.discovery.approximate_index_blocks)
        self.strategy = make_strategy(config.routing, clock=clock)
        self.fair = FairShare()
        self.gate = PriorityGate(config.routing.max_queued, clock)
        self.adapter_drains = AdapterDrains()  # places being made for adapters no pod had room for
        self.adapter_copies = _adapter_copies(config)
        self._set_queue_policy(config)
        self._tasks: dict[str, list[asyncio.Task]] = {}
        self._followers: dict[str, KVEventFollower] = {}
        # Wakes sleeping pods for held requests (wake.py); only where this fleet probes its pods itself.
        self.waker = Waker(session, self.asleep_candidates, self._probe_now, self._woken, clock)

    def _scheduled(self, endpoint_id: str, hashes: Sequence[bytes]) -> None:
        """A pod started a request (from any router): its prefix is being computed there."""
        if hashes:
            self.scheduled.record(endpoint_id, hashes)
        work = self.strategy.work
        if work is not None:
            work.observed(endpoint_id)

    def _evicted(self, endpoint_id: str) -> None:
        """The pod reported an eviction: from now on its events alone say what it holds."""
        self.recent.forget(endpoint_id)
        self.scheduled.forget(endpoint_id)

    # --- live policy --------------------------------------------------------------------------------

    def apply(self, config: RouterConfig) -> None:
        """A new config's live part: routing policy and the backend list (the caller syncs discovery)."""
        self.config = config
        self.adapter_copies = _adapter_copies(config)
        self.strategy = make_strategy(config.routing, self.strategy)
        self.gate.max_queued = config.routing.max_queued
        self._set_queue_policy(config)
        self.gate.release()  # limits may have grown, or routes changed

    def _set_queue_policy(self, config: RouterConfig) -> None:
        """The queue's order within a band (tenants' counters) and the bands' minimum shares."""
        spec = config.routing.fair_share
        fair = self.fair
        fair.input_weight, fair.output_weight = spec.input_token_weight, spec.output_token_weight
        fair.tier_weights = dict(spec.tier_weights)
        self.gate.queue.order = fair.counter if spec.enabled else None
        shares: dict[int, float] = {}
        for c in config.routing.priority_classes:
            if c.min_share > 0:
                shares[c.priority] = max(shares.get(c.priority, 0.0), c.min_share)
        self.gate.queue.min_shares = shares

    # --- membership ---------------------------------------------------------------------------------

    def sync_backend(self, backend: Backend, urls: Sequence[str]) -> None:
        """Discovery's view of one backend. Ignored for a backend the config no longer names the same
        way (a watch that was just stopped may still deliver one last update)."""
        if backend not in self.config.backends:
            return
        self._sync(backend, urls)

    def remove_backend(self, backend: Backend) -> None:
        self._sync(backend, ())

    def _sync(self, backend: Backend, urls: Sequence[str]) -> None:
        added, removed = self.endpoints.sync(backend, urls)
        for ep in removed:
            for task in self._tasks.pop(ep.id, []):
                task.cancel()
            self._followers.pop(ep.id, None)
            self.exact.clear(ep.id)
            self.approx.forget(ep.id)
            self.recent.forget(ep.id)
            self.scheduled.forget(ep.id)
            self.metrics.forget_endpoint(ep.id)
            self.waker.forget(ep.id)
            if self.pod_auth is not None:
                self.pod_auth.endpoint_removed(ep.url)
        for ep in added:
            if self.pod_auth is not None:
                self.pod_auth.endpoint_added(ep.url, ep.backend)
            self.metrics.healthy.labels(ep.id).set(0)  # until a probe says it serves
            self.metrics.in_flight.labels(ep.id).set(0)
            d = self.config.discovery
            tasks = []
            if self.watch:
                tasks.append(
                    asyncio.create_task(
                        monitor_endpoint(
                            self.session, ep, d.probe_interval_seconds, d.health_every, self._probe_result
                        )
                    )
                )
            if d.kv_events:
                follower = KVEventFollower(
                    self.session,
                    ep.url,
                    ep.id,
                    self.exact,
                    self._scheduled,
                    on_error=lambda reason: self.metrics.kv_event_errors.labels(reason).inc(),
                )
                self._followers[ep.id] = follower
                if self.watch:
                    tasks.append(asyncio.create_task(follower.run()))
            self._tasks[ep.id] = tasks
        if added:
            self.gate.release()
        if removed:
            self.waker.check()  # held requests may have lost their last awake endpoint

    async def close(self) -> None:
        await self.waker.close()
        tasks = [t for ts in self._tasks.values() for t in ts]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks.clear()

    # --- health -------------------------------------------------------------------------------------

    def _probe_result(self, ep: Endpoint, outcome: Probe) -> None:
        if ep.id in self.endpoints.by_id:
            self._record(ep, outcome)
            follower = self._followers.get(ep.id)
            self.metrics.events_live.labels(ep.id).set(1 if follower is not None and follower.live else 0)

    def report(self, ep: Endpoint, ok: bool) -> None:
        """A request's outcome (passive health)."""
        self._record(ep, Probe.OK if ok else Probe.FAILED)

    def make_adapter_place(self, targets: Sequence[RouteTarget], adapter: str) -> None:
        """No endpoint tried had room for `adapter` (the client got a 503): drain a spare copy of another
        adapter on one pod so a place frees (AdapterDrains)."""
        least = {name: c.min_copies for name, c in self.adapter_copies.items() if c.min_copies}
        eps = self.healthy_endpoints(targets)
        if self.adapter_drains.make_place(adapter, eps, self.clock(), least) is not None:
            self.metrics.adapter_drains.inc()

    def adapter_busy(self, ep: Endpoint) -> None:
        """`ep` refused to load an adapter (every one it holds has requests in flight): it has no room until
        its next load report says otherwise, so adapters it does not hold go elsewhere meanwhile. Its
        health is untouched: the requests it can take are welcome."""
        ep.lora_room = 0  # the retry counter's reason "lora_busy" counts these

    def not_ready(self, ep: Endpoint) -> None:
        """A request was refused with 503 (the pod is loading, draining or asleep): out until a probe says
        ready. Whether it sleeps is left to its probe, which reads the reason."""
        was_available = self.available(ep)
        ep.health.record_not_ready()
        self._after_record(ep, was_available, False)

    def _record(self, ep: Endpoint, outcome: Probe) -> None:
        now = self.clock()
        was_available, was_asleep = ep.health.is_available(now), ep.health.asleep
        was_ejected = ep.health.ejected_until is not None
        if ep.health.record(outcome, now):
            self.gate.release()  # it takes traffic now: waiting requests may go
        if ep.health.ejected_until is not None and not was_ejected:
            self.metrics.ejections.labels(ep.id).inc()
        self._after_record(ep, was_available, ep.health.asleep and not was_asleep)

    def _after_record(self, ep: Endpoint, was_available: bool, fell_asleep: bool) -> None:
        available = self.available(ep)
        if ep.id in self.endpoints.by_id:
            self.metrics.healthy.labels(ep.id).set(1 if available else 0)
        if self.waker.has_demand and ((was_available and not available) or fell_asleep):
            self.waker.check()  # requests are held: this may leave a sleeping pod as their only way

    async def _probe_now(self, ep: Endpoint) -> None:
        """Probe `ep` at once (readiness included) and apply what it says."""
        self._probe_result(ep, await probe_once(self.session, ep, True))

    def _woken(self, ep: Endpoint, outcome: str) -> None:
        self.metrics.wakes.labels(ep.backend, outcome).inc()

    def asleep_candidates(self, targets: Sequence[RouteTarget]) -> list[Endpoint]:
        """The asleep endpoints that waking one of would serve `targets`: those of the first target that has
        any, when no target has an available endpoint (else none: the request waits for those)."""
        if not self.watch or self.healthy_endpoints(targets):
            return []
        for target in targets:
            asleep = [ep for ep in self.endpoints.of_backends(target.backends) if ep.health.asleep]
            if asleep:
                return asleep
        return []

    def endpoint_states(self) -> dict[str, dict]:
        """Per endpoint, what /v1/config shows: backend, role, whether it takes traffic, its sleep."""
        now = self.clock()
        out = {}
        for ep in sorted(self.endpoints.by_id.values(), key=lambda e: e.id):
            h = ep.health
            out[ep.id] = {
                "backend": ep.backend,
                "role": ep.role,
                "available": h.is_available(now),
                "ejected": h.ejected_until is not None,
                "in_flight": ep.in_flight,
                **self.waker.state(ep),
            }
        return out

    def kv_reply(self, endpoint_id: str, reply: object) -> None:
        """One `/v1/kv-events` reply of an endpoint, applied as its follower applies it (without `watch`)."""
        follower = self._followers[endpoint_id]
        follower.position = apply_reply(self.exact, endpoint_id, reply, self._scheduled, follower.position)
        follower.live = True

    def kv_events_live(self) -> dict[str, bool]:
        """Per endpoint: is the exact index following its KV-event stream right now?"""
        return {ep_id: f.live for ep_id, f in self._followers.items()}

    def available(self, ep: Endpoint) -> bool:
        return ep.health.is_available(self.clock())

    def in_rotation(self, count: int) -> bool:
        """Whether `count` endpoints are known and every one takes requests. An endpoint starts out of
        rotation until its first probe answers: requests sent before that all go to those already in."""
        eps = self.endpoints.by_id
        return len(eps) == count and all(map(self.available, eps.values()))

    # --- in-flight accounting -----------------------------------------------------------------------

    def acquire(self, ep: Endpoint, adapter: str | None = None) -> None:
        """One of this router's requests starts on `ep` (under `adapter`: active there from now on, as far as
        placement knows, until the pod's next report says)."""
        if adapter is not None and adapter not in ep.lora_active:
            ep.lora_active = ep.lora_active | {adapter}
        ep.in_flight += 1
        ep.since_report += 1
        self.metrics.in_flight.labels(ep.id).set(ep.in_flight)

    def release(self, ep: Endpoint) -> None:
        ep.in_flight -= 1
        ep.since_report -= 1
        work = self.strategy.work
        if work is not None:
            work.settle(ep.id, ep.in_flight)
        if ep.id in self.endpoints.by_id:
            self.metrics.in_flight.labels(ep.id).set(ep.in_flight)
        self.gate.release()

    def has_capacity(self, targets: Sequence[RouteTarget]) -> bool:
        """Can one of `targets`' endpoints take a request now (available, below the in-flight limit)?"""
        limit = self.config.routing.max_in_flight_per_endpoint
        return any(ep.in_flight < limit for ep in self.healthy_endpoints(targets))

    def retry_after(self, targets: Sequence[RouteTarget]) -> float:
        """Seconds a refused client should wait: until the first ejection ends, else a probe interval."""
        now = self.clock()
        ends = [
            ep.health.ejected_until - now
            for t in targets
            for ep in self.endpoints.of_backends(t.backends)
            if ep.health.ejected_until is not None
        ]
        return max(min(ends, default=1.0), 1.0)

    # --- the decision -------------------------------------------------------------------------------

    def targets(self, model: str, draw: float = 0.0) -> list[RouteTarget]:
        """`model`'s targets under the current policy; `draw` decides its splits (model_routes.py)."""
        return route_targets(model, self.config.routing, self.config.backends, draw)

    def healthy_endpoints(
        self, targets: Sequence[RouteTarget], exclude: frozenset[str] = frozenset()
    ) -> list[Endpoint]:
        """Available endpoints of the first target that has any (primary, then fallbacks in order)."""
        for target in targets:
            eps = [
                ep
                for ep in self.endpoints.of_backends(target.backends)
                if ep.id not in exclude and self.available(ep)
            ]
            if eps:
                return eps
        return []

    def pick(
        self,
        targets: Sequence[RouteTarget],
        prompt: PromptKey,
        session_key: str | None,
        exclude: frozenset[str],
    ) -> Pick | None:
        started = time.perf_counter()
        try:
            return self._pick(targets, prompt, session_key, exclude)
        finally:
            self.metrics.pick_seconds.observe(time.perf_counter() - started)

    def _pick(
        self,
        targets: Sequence[RouteTarget],
        prompt: PromptKey,
        session_key: str | None,
        exclude: frozenset[str],
    ) -> Pick | None:
        limit = self.config.routing.max_in_flight_per_endpoint
        adapter = prompt.adapter
        copies = self.adapter_copies.get(adapter) if adapter is not None else None
        for target in targets:
            eps = [ep for ep in self.endpoints.of_backends(target.backends) if self.available(ep)]
            if adapter is not None and copies is not None and copies.max_copies is not None:
                # Counted over every available pod, tried or not: a retry never loads one copy too many.
                eps = within_max_copies(adapter, eps, copies.max_copies)
            eps = [ep for ep in eps if ep.id not in exclude]
            if not eps:
                continue
            # The request was admitted already (the gate): a retry may exceed the in-flight limit rather
            # than fail, so only the endpoints below it are matched when there are any.
            below = [ep for ep in eps if ep.in_flight < limit]
            eps = below or eps
            if prompt.adapter is not None:  # the pods holding the adapter, unless they are busy
                drains = self.adapter_drains
                if drains:
                    drains.settle(eps, self.clock())
                eps = adapter_candidates(prompt.adapter, eps, self.config.routing.balance, drains)
            matches, num_blocks, approx = self._prefix_matches(eps, prompt, target.model)
            followers = self._followers  # only the candidates' (kv_events_live() would build all of them)
            states = [
                EndpointState(
                    ep.id,
                    ep.reported_load,
                    ep.in_flight,
                    ep.kv_cache_usage,
                    (f := followers.get(ep.id)) is not None and f.live,
                )
                for ep in eps
            ]
            first = next((h[0] for h in approx.values() if h), b"")
            verdict = decide(
                self.strategy, RouteQuery(num_blocks, session_key, first), states, matches, limit, True
            )
            decision = verdict.decision
            assert decision is not None  # admitted: some endpoint always takes it
            if target.fallback:
                decision = Decision(decision.endpoint_id, "fallback", decision.prefix_blocks)
            ep = self.endpoints.by_id[decision.endpoint_id]
            return Pick(ep, decision, target, num_blocks, tuple(approx.get(ep.id, ())))
        return None

    def _prefix_matches(
        self, eps: Sequence[Endpoint], prompt: PromptKey, model: str
    ) -> tuple[dict[str, int], int, dict[str, list[bytes]]]:
        """Leading cached blocks per endpoint: exact where the pod's event stream is live, else approximate.

        Returns (matches, prompt blocks, approximate-index hashes per endpoint for recording the route).
        """
        hash_cache: dict[tuple, list[bytes]] = {}
        adapter = prompt.adapter
        named = model if adapter is None else adapter  # the router's own names keep adapters apart too

        def hashes(block_size: int, extra: tuple, adapter_key: str | None = None) -> list[bytes]:
            key = (block_size, extra, adapter_key)
            if key not in hash_cache:
                if prompt.token_ids is None:
                    hash_cache[key] = text_block_hashes(prompt.text, named, prompt.cache_salt)
                else:
                    hash_cache[key] = token_block_hashes(
                        prompt.token_ids, block_size, extra, prompt.cache_salt, adapter_key
                    )
            return hash_cache[key]

        # Endpoints are grouped by the hashes they are matched on, so each index is walked once per group
        # for all its endpoints (O(prompt blocks)), not once per endpoint.
        backends = {b.name: b for b in self.config.backends}
        approx: dict[str, list[bytes]] = {}
        exact_groups: dict[tuple, list[str]] = {}  # (block size, extra, approx key) -> live endpoints
        approx_groups: dict[tuple, list[str]] = {}  # approx key -> endpoints without a live stream
        for ep in eps:
            backend = backends.get(ep.backend)
            default_bs = backend.block_size if backend else 16
            if prompt.token_ids is None:
                approx_key: tuple = (0, ())
            else:
                approx_key = (default_bs, approx_extra(ep.model if adapter is None else adapter))
            approx[ep.id] = hashes(*approx_key)
            follower = self._followers.get(ep.id)
            # An adapter's blocks are hashed with the key the pod reports for it: none (not loaded there),
            # and nothing of that pod can match exactly.
            adapter_key = None if adapter is None else ep.lora_adapters.get(adapter)
            live = follower is not None and follower.live and follower.position
            if prompt.token_ids is not None and live and (adapter is None or adapter_key is not None):
                pos = follower.position
                group = (pos.block_size, pos.hash_extra, adapter_key, approx_key)
                exact_groups.setdefault(group, []).append(ep.id)
            else:
                approx_groups.setdefault(approx_key, []).append(ep.id)
        matches: dict[str, int] = {}
        num_blocks = 0
        for (block_size, extra, adapter_key, approx_key), ids in exact_groups.items():
            exact_h = hashes(block_size, extra, adapter_key)
            # Same block units: add what this router sent there that is still being prefilled.
            same_units = block_size == approx_key[0]
            matches |= exact_matches(
                ids,
                exact_h,
                self.exact,
                self.scheduled,
                self.recent if same_units else None,
                hashes(*approx_key) if same_units else None,
            )
            num_blocks = max(num_blocks, len(exact_h))
        for approx_key, ids in approx_groups.items():
            approx_h = hashes(*approx_key)
            matches |= self.approx.match(approx_h, ids)
            num_blocks = max(num_blocks, len(approx_h))
        return matches, num_blocks, approx

    def record_route(self, pick: Pick) -> None:
        """The prompt went to this endpoint: the approximate index remembers it (exact learns from events)."""
        if pick.approx_hashes:
            self.approx.record(pick.endpoint.id, pick.approx_hashes)
            self.recent.record(pick.endpoint.id, pick.approx_hashes)


def _adapter_copies(config: RouterConfig) -> dict[str, AdapterCopies]:
    """Each adapter's copies bounds, from the backends that set them (the first one naming it wins)."""
    out: dict[str, AdapterCopies] = {}
    for backend in config.backends:
        for name, copies in backend.adapter_copies.items():
            out.setdefault(name, copies)
    return out
