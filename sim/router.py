"""The router on the virtual clock: the live router's decision (`runtime/router/decision.py`) and queue policy
(`priority.WaitQueue`), fed by the simulated pods instead of the network.

What is the router's code: the decision (`decision.decide`: the in-flight limit, load = max(the pod's last
polled running + waiting brought up to date with the router's own starts and ends, its in-flight count),
the strategy from `scoring.make_strategy` with its work bound and hot-spot guard), the prefix-match merge
(`decision.exact_matches`: the exact index fed by the replicas' real KV events, raised by the prefixes pods
announce and by this router's own recent routes, both on the simulation clock and both forgotten for a pod
that reports an eviction), the prompt block hashes (`prompt_blocks.token_block_hashes`), the tie-break key (`decision.approx_extra`) and the
queue (`WaitQueue`: (priority, arrival) order, at most `max_queued` waiting, each for at most
`queue_timeout_seconds`, from the same RoutingPolicy fields the router reads) and, with `fairShare.enabled`,
the fair share between tenants (`fair_share.FairShare` with the policy's weights, the queue ordered by its
counters as `Fleet` orders it: (priority, tenant's counter, arrival)). A request's tenant is its
`SimRequest.tenant` (the live router's API key or tenant header; none counts as ""); it joins when it
reaches the router, its prompt is charged when it is sent to a pod, its output when it ends, and it
leaves then (served, or refused by the router or a pod), as `handle_generate` does. What this file adds is
what `Fleet` does around them without its network parts: every pod's event stream is live
(`reports_work`), and endpoints join and leave as the simulation says.

LoRA: a request naming an adapter is placed by `lora.placement` — `placement` is the router's own rule
(`adapter_placement.adapter_candidates`, unchanged, over the endpoints below the in-flight limit as
`Fleet._pick_in` calls it), `affinity` the adapter's holders whenever any is below the limit, `none` every
endpoint — and then decided as any request. What a pod holds, and how many adapters it could load now, is
what its last load report listed (`lora_adapters`, `lora_room`, polled every `probe_interval_s`). Its prompt is hashed under the adapter's key
(`token_block_hashes(..., adapter_key)`, as the pod hashes it), so its blocks never match the base model's
or another adapter's, and its tie-break key is named after the adapter as `Fleet` names it. Unlike the
live router, which matches a pod that does not list the adapter through its approximate index only, the
exact match is taken on every candidate (the simulator has no approximate index; the hashes are exact).

A request the queue refuses (full, or its deadline passed) is rejected as the router rejects it: 429, or
503 when no endpoint of its role was ready. The decode phase of a disaggregated request is picked like the
router picks it (`Fleet.pick` for an admitted request: the in-flight limit is passed rather than fail) and
waits only while no decode pod exists at all.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from tokenfleet.runtime.engine.fair_share import FairShare
from tokenfleet.runtime.engine.kv_cache.block_hash import (
    encode_extra,
    extend_block_hashes,
    hash_extra,
    with_adapter,
)
from tokenfleet.runtime.engine.kv_cache.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    PrefillScheduled,
)
from tokenfleet.runtime.router.adapter_placement import AdapterDrains, adapter_candidates, within_max_copies
from tokenfleet.runtime.router.config import RoutingSpec
from tokenfleet.runtime.router.decision import (
    AT_CAPACITY,
    NO_READY_ENDPOINT,
    approx_extra,
    decide,
    exact_matches,
    load_of,
    refusal_status,
    within_limit,
)
from tokenfleet.runtime.router.fleet import RECENT_ROUTES_TTL_S
from tokenfleet.runtime.router.prefix_index import ExactPrefixIndex, RecentRoutes
from tokenfleet.runtime.router.priority import QueueFull, Waiter, WaitQueue
from tokenfleet.runtime.router.prompt_blocks import token_block_hashes
from tokenfleet.runtime.router.scoring import RouteQuery, WorkBound, make_strategy
from tokenfleet.sim.adapters import sim_adapter
from tokenfleet.sim.workload import SimRequest

PLACEMENTS = ("placement", "affinity", "none")


@dataclass(slots=True)
class EndpointView:
    """The router's view of one pod: last polled load report plus its own in-flight count. It has
    `decision.EndpointState`'s fields, so `decide` reads it as is (no copy per candidate per pick)."""

    endpoint_id: str
    role: str = "both"  # both | prefill | decode
    reported_load: int = 0  # polled_load + since_report, at least 0 (kept, not derived: read on every pick)
    kv_usage: float = 0.0
    in_flight: int = 0
    reports_work: bool = True  # every simulated pod's event stream is followed
    polled_load: int = 0
    since_report: int = 0  # this router's starts - ends since the last report, as `Endpoint` counts them
    lora_adapters: dict[str, str] = field(default_factory=dict)  # the last report's: name -> key
    lora_room: int | None = None  # the last report's: adapters it could load now (free or idle places)
    lora_active: frozenset[str] = frozenset()  # the last report's adapters in flight, plus those sent since
    lora_slots: int | None = None  # the last report's: distinct adapters per step

    def count(self, started: int) -> None:
        """One request of this router's started here (1) or ended (-1)."""
        self.in_flight += started
        self.since_report += started
        n = self.polled_load + self.since_report
        self.reported_load = n if n > 0 else 0

    @property
    def name(self) -> str:
        return self.endpoint_id

    @property
    def id(self) -> str:
        return self.endpoint_id

    @property
    def load(self) -> int:
        return load_of(self)


class SimRouter:
    def __init__(
        self,
        spec: RoutingSpec,
        block_size: int,
        model_name: str,
        clock: Callable[[], float],
        index_blocks: int = 200_000,
        placement: str = "placement",
        max_copies: int | None = None,
        min_copies: Mapping[str, int] | None = None,
    ) -> None:
        assert placement in PLACEMENTS, placement
        self.spec = spec
        self.placement = placement
        self.max_copies = (
            max_copies  # every adapter's maxCopies, with `placement` (as Fleet._pick applies it)
        )
        self.clock = clock
        self.drains = AdapterDrains()  # places being made for refused adapters (placement only)
        self.min_copies = dict(min_copies or {})  # the adapters' minCopies: no drain goes below them
        self.model_name = model_name
        self.block_size = block_size
        self.extra = hash_extra(model_name)
        self._extra_bytes = encode_extra(self.extra)
        self._approx_extra = approx_extra(model_name)
        self._first_keys: dict[tuple, bytes] = {}
        # On the simulation's clock: the work bound's provisional entries expire on it.
        self.strategy = make_strategy(spec, clock=clock)
        self.recent = RecentRoutes(index_blocks, RECENT_ROUTES_TTL_S, clock)
        self.scheduled = RecentRoutes(index_blocks, RECENT_ROUTES_TTL_S, clock)
        self.exact = ExactPrefixIndex(on_removal=self._evicted)
        self._prefix_hashes: dict[tuple[str, str | None], list[bytes]] = {}
        self._adapter_extras: dict[str, tuple[tuple, bytes]] = {}  # adapter -> its hash extra, and encoded
        self.endpoints: dict[str, EndpointView] = {}
        self._by_role: dict[str, list[EndpointView]] = {}  # role -> its endpoints (every pick reads them)
        # Fair share as `Fleet._set_fair_share` sets it up; None when off (then nothing is counted).
        fair = spec.fair_share
        self.fair: FairShare | None = None
        if fair.enabled:
            self.fair = FairShare(fair.input_token_weight, fair.output_token_weight, fair.tier_weights)
        # New requests, bounded as the router bounds them; decode phases (admitted already) apart.
        self.queue: WaitQueue[tuple[SimRequest, str, object]] = WaitQueue(
            spec.max_queued, clock, self.fair.counter if self.fair is not None else None
        )
        self.handoff_queue: WaitQueue[tuple[SimRequest, str, object]] = WaitQueue(1 << 62, clock)
        self._queued_roles: set[str] = set()  # roles that new requests have waited for
        self.decisions: dict[str, int] = {}

    @property
    def work(self) -> WorkBound | None:
        return self.strategy.work

    # ---- membership and reports -----------------------------------------------------------------------

    def add_endpoint(self, name: str, role: str = "both") -> None:
        self.endpoints[name] = EndpointView(name, role)
        self._by_role.clear()

    def remove_endpoint(self, name: str) -> None:
        self.endpoints.pop(name, None)
        self._by_role.clear()
        self.exact.clear(name)
        self.recent.forget(name)
        self.scheduled.forget(name)

    def _evicted(self, name: str) -> None:
        """The pod reported an eviction: from now on its events alone say what it holds."""
        self.recent.forget(name)
        self.scheduled.forget(name)

    def report(
        self,
        name: str,
        load: int,
        kv_usage: float,
        lora_adapters: dict[str, str] | None = None,
        lora_room: int | None = None,
        lora_active: frozenset[str] | None = None,
        lora_slots: int | None = None,
    ) -> None:
        ep = self.endpoints.get(name)
        if ep is not None:
            ep.polled_load, ep.reported_load, ep.kv_usage, ep.since_report = load, load, kv_usage, 0
            if lora_adapters is not None:
                ep.lora_adapters = lora_adapters
                ep.lora_room = lora_room
                ep.lora_active = lora_active or frozenset()
                ep.lora_slots = lora_slots

    def apply_events(self, name: str, events: Sequence[KVEvent]) -> None:
        """One step's KV events, in order. Runs of consecutive stored (or removed) events are applied as one
        call: the index is a set per endpoint, so only the order between a stored run and a removed run
        matters, and each `removed` call makes the index tell both recent-route memories to forget the
        endpoint (a step under eviction pressure emits many)."""
        if name not in self.endpoints:
            return
        run: list[bytes] = []
        run_type: type | None = None
        exact = self.exact
        for ev in events:
            t = type(ev)
            if t is run_type:
                run.extend(ev.block_hashes)
                continue
            if run:
                (exact.stored if run_type is BlockStored else exact.removed)(name, run)
            if t is BlockStored or t is BlockRemoved:
                run, run_type = list(ev.block_hashes), t
                continue
            run, run_type = [], None
            if t is PrefillScheduled:
                self.announced(name, ev)
            elif t is AllBlocksCleared:
                exact.clear(name)
        if run:
            (exact.stored if run_type is BlockStored else exact.removed)(name, run)

    def announced(self, name: str, ev: PrefillScheduled) -> None:
        """A pod started a request: its prefix is being computed there, and it counts as work there."""
        if name not in self.endpoints:
            return
        if ev.block_hashes:
            self.scheduled.record(name, ev.block_hashes)
        if self.work is not None:
            self.work.observed(name)

    # ---- routing ----------------------------------------------------------------------------------------

    def _extras(self, adapter: str | None) -> tuple[tuple, bytes]:
        """The hash extra of a prompt under `adapter` (the base model's when None), and its encoding."""
        if adapter is None:
            return self.extra, self._extra_bytes
        extras = self._adapter_extras.get(adapter)
        if extras is None:
            extra = with_adapter(tuple(self.extra), None, sim_adapter(adapter).cache_key)
            extras = self._adapter_extras[adapter] = (extra, encode_extra(extra))
        return extras

    def hash_prompt(self, sreq: SimRequest) -> None:
        """The prompt's block hashes (`token_block_hashes`, under its adapter's key if it names one),
        extending hashes already computed for its leading tokens — the same values, since each hash covers
        exactly the tokens up to its block."""
        if sreq.block_hashes:
            return
        bs, prompt, adapter = self.block_size, sreq.prompt, sreq.adapter
        adapter_key = None if adapter is None else sim_adapter(adapter).cache_key
        base: list[bytes] = []
        parent = sreq.parent
        sreq.parent = None  # one turn back is all it needs: do not keep whole conversations alive
        if parent is not None and parent.block_hashes and parent.adapter == adapter:
            base = parent.block_hashes
        elif sreq.prefix_key is not None and sreq.prefix_len >= bs:
            key = (sreq.prefix_key, adapter)  # a shared prompt's blocks differ per adapter
            base = self._prefix_hashes.get(key)
            if base is None:
                base = token_block_hashes(prompt[: sreq.prefix_len], bs, self.extra, None, adapter_key)
                self._prefix_hashes[key] = base
        if not base or len(base) * bs > len(prompt):
            sreq.block_hashes = token_block_hashes(prompt, bs, self.extra, None, adapter_key)
        else:
            sreq.block_hashes = extend_block_hashes(list(base), prompt, bs, self._extras(adapter)[1])

    def prefix_key(self, sreq: SimRequest) -> bytes:
        """The tie-break key: the prompt's first block under the router's own extra, as `Fleet` names it.
        Remembered per first block (shared system prompts and sessions repeat it), up to a bound."""
        bs = self.block_size
        if len(sreq.prompt) < bs:
            return b""
        first = tuple(sreq.prompt[:bs])
        adapter = sreq.adapter
        memo = first if adapter is None else (adapter, first)
        key = self._first_keys.get(memo)
        if key is None:
            if len(self._first_keys) >= 65536:
                self._first_keys.clear()
            # An adapter's requests are named after the adapter, as `Fleet` names them.
            extra = self._approx_extra if adapter is None else approx_extra(adapter)
            key = self._first_keys[memo] = token_block_hashes(first, bs, extra, None)[0]
        return key

    def pick(self, sreq: SimRequest, role: str = "both", tried: frozenset[str] = frozenset()) -> str | None:
        """The endpoint of `role` for this request, or None: it must wait (or, with `tried` — the endpoints
        that refused it before its first byte — its retries have nowhere left to go).

        A decode pod is chosen as the router chooses it: by load and KV usage alone (the prompt's KV comes
        with the request, so no prefix term, no prompt key, no session), among all decode pods (the
        request was admitted already)."""
        states = self._states(role)
        if sreq.adapter is not None and self.placement == "placement" and self.max_copies is not None:
            # Counted over every pod, tried or not, as Fleet._pick counts them: a retry loads no extra copy.
            states = within_max_copies(sreq.adapter, states, self.max_copies)  # type: ignore[assignment,arg-type]
        if tried:
            states = [s for s in states if s.endpoint_id not in tried]
        limit = self.spec.max_in_flight_per_endpoint
        if role == "decode":
            verdict = decide(self.strategy, RouteQuery(0, None, b""), states, {}, limit, admitted=True)
        else:
            self.hash_prompt(sreq)
            hashes = sreq.block_hashes
            if sreq.adapter is not None and self.placement != "none":
                states = self._adapter_candidates(sreq.adapter, states, limit)
            # Only the endpoints that may take it are matched (the limit filters them first anyway).
            ids = [s.endpoint_id for s in states if s.in_flight < limit]
            matched = exact_matches(ids, hashes, self.exact, self.scheduled, self.recent) if ids else {}
            query = RouteQuery(len(hashes), sreq.session, self.prefix_key(sreq))
            verdict = decide(self.strategy, query, states, matched, limit)
        decision = verdict.decision
        if decision is None:
            return None
        if role != "decode":
            self.recent.record(decision.endpoint_id, sreq.block_hashes)
            if self.fair is not None and not tried:  # sent: its prompt counts now, once (not per retry)
                self.fair.charge_prompt(sreq.tenant or "", len(sreq.prompt))
        ep = self.endpoints[decision.endpoint_id]
        ep.count(1)
        adapter = sreq.adapter
        if adapter is not None and adapter not in ep.lora_active:
            ep.lora_active = ep.lora_active | {adapter}  # as Fleet.acquire marks it
        self.decisions[decision.reason] = self.decisions.get(decision.reason, 0) + 1
        return decision.endpoint_id

    def _adapter_candidates(self, adapter: str, states: list[EndpointView], limit: int) -> list[EndpointView]:
        """Where a request for `adapter` may go, by `placement`, among the endpoints below the in-flight
        limit (as `Fleet._pick_in` narrows them before the placement rule); all of `states` when none is."""
        below = [s for s in states if s.in_flight < limit]
        if not below:
            return states
        if self.placement == "placement":  # the router's own rule (reads lora_adapters/_room, load)
            drains = self.drains
            if drains:
                drains.settle(states, self.clock())  # type: ignore[arg-type]
            return adapter_candidates(adapter, below, self.spec.balance, drains)  # type: ignore[arg-type]
        holders = [s for s in below if adapter in s.lora_adapters]
        return holders or below

    def _states(self, role: str) -> list[EndpointView]:
        states = self._by_role.get(role)
        if states is None:
            states = self._by_role[role] = [ep for ep in self.endpoints.values() if ep.role == role]
        return states

    def _has_room(self, role: str) -> bool:
        """Whether a request of `role` could be sent now (`decide`'s own test: an endpoint below the limit,
        or any endpoint for an admitted decode phase)."""
        limit = self.spec.max_in_flight_per_endpoint
        return bool(within_limit(self._states(role), limit, admitted=role == "decode"))

    def adapter_busy(self, name: str) -> None:
        """The pod refused to load an adapter (503 `lora_slots_busy`): no room there until its next report,
        as `Fleet.adapter_busy` records it."""
        ep = self.endpoints.get(name)
        if ep is not None:
            ep.lora_room = 0

    def release(self, name: str) -> None:
        ep = self.endpoints.get(name)
        if ep is not None:
            ep.count(-1)
            if self.work is not None:
                self.work.settle(name, ep.in_flight)

    # ---- tenants (fair share) ----------------------------------------------------------------------------

    def arrived(self, sreq: SimRequest) -> None:
        """A new request reached the router: its tenant is active until it ends (waiting or in flight)."""
        if self.fair is not None:
            self.fair.join(sreq.tenant or "")

    def streamed(self, tokens_by_tenant: Counter[str]) -> None:
        """Tokens a pod's step generated, per tenant: charged as they pass, as `handle_generate`'s meter
        charges a stream's events."""
        assert self.fair is not None
        for tenant, n in tokens_by_tenant.items():
            self.fair.charge_output(tenant, n)

    def ended(self, sreq: SimRequest) -> None:
        """A request is over for its client (served, or refused by the router or a pod); its output was
        charged as it was generated (`streamed`)."""
        if self.fair is not None:
            self.fair.leave(sreq.tenant or "")

    # ---- the router's queue ------------------------------------------------------------------------------

    @property
    def num_queued(self) -> int:
        return len(self.queue) + len(self.handoff_queue)

    def enqueue(self, sreq: SimRequest, role: str = "both", item: object = None) -> Waiter | str:
        """Hold a request (or `item`, a request between its phases) until an endpoint of `role` has room.
        Returns its waiter, or why the router refuses it at once ("429 ...": `max_queued` are waiting).
        A new request's deadline is `queue_timeout_seconds` on; a decode phase waits for a pod to exist."""
        if role == "decode":
            return self.handoff_queue.push((sreq, role, item), sreq.priority, float("inf"), role)
        self._queued_roles.add(role)
        try:
            return self.queue.push(
                (sreq, role, item), sreq.priority, self.spec.queue_timeout_seconds, role, sreq.tenant or ""
            )
        except QueueFull as e:
            return f"router 429: {e}"

    def adapter_refused(self, sreq: SimRequest, role: str) -> None:
        """No pod tried had room for the request's adapter (the client gets the 503): with the router's own
        placement, a place is made for its next requests (`Fleet.make_adapter_place`); the baselines, routers
        that read no adapter room, make none."""
        if self.placement == "placement" and sreq.adapter is not None:
            states = self._states(role)
            self.drains.make_place(sreq.adapter, states, self.clock(), self.min_copies)  # type: ignore[arg-type]

    def timed_out(self, waiter: Waiter) -> str | None:
        """`waiter`'s deadline has come: if it still waits, it leaves the queue and this is the status the
        router answers it with (429 when endpoints of its role were up but busy, 503 when none was ready);
        None when it was sent before. As in the live gate, where each waiter's own timeout removes it."""
        if not self.queue.remove(waiter):
            return None
        role = waiter.item[1]
        ready = any(ep.role == role for ep in self.endpoints.values())
        status = refusal_status(AT_CAPACITY if ready else NO_READY_ENDPOINT)
        why = "all endpoints at capacity" if ready else "no ready endpoint"
        return f"router {status}: waited {self.spec.queue_timeout_seconds:g}s, {why}"

    def dispatch_queued(self) -> list[tuple[SimRequest, str, str, object]]:
        """Route queued requests, best first, while endpoints have room: (request, endpoint, role, item).
        Requests wait in (priority, arrival) order — (priority, tenant's counter, arrival) with fair share;
        one that cannot go holds back only its own role's (as the live gate wakes the first waiter whose own
        endpoints can take it)."""
        out = []
        for queue, roles in ((self.handoff_queue, ("decode",)), (self.queue, self._queued_roles)):
            if not len(queue):
                continue
            # Roles with no room are blocked before the order is taken: while a flood waits, every arrival
            # would otherwise sort the whole queue for nothing.
            blocked = {role for role in roles if not self._has_room(role)}
            if len(blocked) == len(roles):
                continue
            waiters = queue.ordered() if queue.order is None else self._fair_order(queue)
            for w in waiters:
                sreq, role, item = w.item
                if role in blocked:
                    continue
                name = self.pick(sreq, role)
                if name is None:
                    blocked.add(role)
                    if len(blocked) == len(roles):
                        break
                    continue
                queue.remove(w)
                out.append((sreq, name, role, item))
        return out

    @staticmethod
    def _fair_order(queue: WaitQueue) -> Iterator[Waiter]:
        """`queue.ordered()` as it would be taken again after each request sent: a send charges its
        tenant, which may let another tenant's waiters go first (the live gate takes the order anew at each
        wake-up). Only the sender's counter moves, so each tenant's own waiters keep their order ((priority,
        arrival), as `ordered` sorts them) and the next to go is the best of the tenants' first waiters —
        without sorting the whole queue again after every send."""
        mine: dict[str, deque[Waiter]] = {}
        for w in queue.ordered():
            mine.setdefault(w.tenant, deque()).append(w)
        rank = queue.order
        assert rank is not None
        while mine:
            tenant = min(mine, key=lambda t: (mine[t][0].priority, rank(t), mine[t][0].arrival))
            waiting = mine[tenant]
            w = waiting.popleft()
            if not waiting:
                del mine[tenant]
            yield w
