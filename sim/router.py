"""The router's decision on the virtual clock, built from the router's own parts.

The strategy (`scoring.make_strategy`: round-robin, least-load, prefix-affinity with the work bound and the
hot-spot guard, session affinity), the exact prefix index fed by the replicas' real KV events, the two
recent-routes bridges (this router's own routes, and the prefixes pods announce when they start a request;
both on the simulation clock, both forgotten for a pod that reports an eviction), the work bound's counts
(provisional per routed request, confirmed by the pod's announcement, settled when a request ends) and the
prompt block hashes (`prompt_blocks.token_block_hashes`) are the router's code. What this file adds is what
`Fleet.pick` does around them without its network parts: the candidates' load is max(the pod's last polled
running + waiting, the router's own in-flight count), as the router computes it; every pod's event stream
is live (`reports_work`); an endpoint at `max_in_flight_per_endpoint` is skipped while another is below
it, and when all are at the limit (or none is ready) the request waits in the router's queue in
(priority, arrival) order until one frees up.

The rendezvous tie-break key is the prompt's first block hash under the pod's hash extra (the router uses
its own "approx" extra for that key): a different but equally fixed name for the same prefix.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tokenfleet.runtime.engine.kv_cache.block_hash import encode_extra, extend_block_hashes, hash_extra
from tokenfleet.runtime.engine.kv_cache.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    PrefillScheduled,
)
from tokenfleet.runtime.router.config import RoutingSpec
from tokenfleet.runtime.router.fleet import RECENT_ROUTES_TTL_S
from tokenfleet.runtime.router.prefix_index import ExactPrefixIndex, RecentRoutes
from tokenfleet.runtime.router.prompt_blocks import token_block_hashes
from tokenfleet.runtime.router.scoring import Candidate, RouteQuery, WorkBound, make_strategy
from tokenfleet.sim.workload import SimRequest


@dataclass(slots=True)
class EndpointView:
    """The router's view of one pod: last polled load report plus its own in-flight count."""

    name: str
    role: str = "both"  # both | prefill | decode
    reported_load: int = 0
    kv_usage: float = 0.0
    in_flight: int = 0

    @property
    def load(self) -> int:
        return max(self.reported_load, self.in_flight)


class SimRouter:
    def __init__(
        self,
        spec: RoutingSpec,
        block_size: int,
        model_name: str,
        clock: Callable[[], float],
        index_blocks: int = 200_000,
    ) -> None:
        self.spec = spec
        self.block_size = block_size
        self.extra = hash_extra(model_name)
        self._extra_bytes = encode_extra(self.extra)
        # On the simulation's clock: the work bound's provisional entries expire on it.
        self.strategy = make_strategy(spec, clock=clock)
        self.recent = RecentRoutes(index_blocks, RECENT_ROUTES_TTL_S, clock)
        self.scheduled = RecentRoutes(index_blocks, RECENT_ROUTES_TTL_S, clock)
        self.exact = ExactPrefixIndex(on_removal=self._evicted)
        self._prefix_hashes: dict[str, list[bytes]] = {}
        self.endpoints: dict[str, EndpointView] = {}
        self._queues: dict[str, list[tuple[int, float, int, SimRequest, object]]] = {}
        self.num_queued = 0
        self._order = 0
        self.decisions: dict[str, int] = {}

    @property
    def work(self) -> WorkBound | None:
        return self.strategy.work

    # ---- membership and reports -----------------------------------------------------------------------

    def add_endpoint(self, name: str, role: str = "both") -> None:
        self.endpoints[name] = EndpointView(name, role)

    def remove_endpoint(self, name: str) -> None:
        self.endpoints.pop(name, None)
        self.exact.clear(name)
        self.recent.forget(name)
        self.scheduled.forget(name)

    def _evicted(self, name: str) -> None:
        """The pod reported an eviction: from now on its events alone say what it holds."""
        self.recent.forget(name)
        self.scheduled.forget(name)

    def report(self, name: str, load: int, kv_usage: float) -> None:
        ep = self.endpoints.get(name)
        if ep is not None:
            ep.reported_load = load
            ep.kv_usage = kv_usage

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

    def hash_prompt(self, sreq: SimRequest) -> None:
        """The prompt's block hashes (`token_block_hashes`), extending hashes already computed for its
        leading tokens — the same values, since each hash covers exactly the tokens up to its block."""
        if sreq.block_hashes:
            return
        bs, prompt = self.block_size, sreq.prompt
        base: list[bytes] = []
        parent = sreq.parent
        sreq.parent = None  # one turn back is all it needs: do not keep whole conversations alive
        if parent is not None and parent.block_hashes:
            base = parent.block_hashes
        elif sreq.prefix_key is not None and sreq.prefix_len >= bs:
            base = self._prefix_hashes.get(sreq.prefix_key)
            if base is None:
                base = token_block_hashes(prompt[: sreq.prefix_len], bs, self.extra, None)
                self._prefix_hashes[sreq.prefix_key] = base
        if not base or len(base) * bs > len(prompt):
            sreq.block_hashes = token_block_hashes(prompt, bs, self.extra, None)
        else:
            sreq.block_hashes = extend_block_hashes(list(base), prompt, bs, self._extra_bytes)

    def pick(self, sreq: SimRequest, role: str = "both") -> str | None:
        """The endpoint of `role` for this request, or None: none below the in-flight limit (it must queue).

        A decode pod is chosen as the router chooses it: by load and KV usage alone (the prompt's KV comes
        with the request, so no prefix term, no prompt key, no session)."""
        limit = self.spec.max_in_flight_per_endpoint
        eps = [ep for ep in self.endpoints.values() if ep.role == role and ep.in_flight < limit]
        if not eps:
            return None
        if role == "decode":
            candidates = [Candidate(ep.name, ep.load, ep.kv_usage, 0, True) for ep in eps]
            decision = self.strategy.choose(RouteQuery(0, None, b""), candidates)
        else:
            self.hash_prompt(sreq)
            hashes = sreq.block_hashes
            ids = [ep.name for ep in eps]
            matched = self.exact.match(hashes, ids)
            self.scheduled.raise_matches(hashes, matched)
            self.recent.raise_matches(hashes, matched)
            candidates = [
                # ep.load inlined (no property or max() call per endpoint: this runs for every candidate)
                Candidate(
                    name,
                    a if (a := ep.reported_load) >= (b := ep.in_flight) else b,
                    ep.kv_usage,
                    matched[name],
                    True,
                )
                for ep, name in zip(eps, ids, strict=True)
            ]
            first = hashes[0] if hashes else b""
            decision = self.strategy.choose(RouteQuery(len(hashes), sreq.session, first), candidates)
            self.recent.record(decision.endpoint_id, hashes)
        self.endpoints[decision.endpoint_id].in_flight += 1
        self.decisions[decision.reason] = self.decisions.get(decision.reason, 0) + 1
        return decision.endpoint_id

    def release(self, name: str) -> None:
        ep = self.endpoints.get(name)
        if ep is not None:
            ep.in_flight -= 1
            if self.work is not None:
                self.work.settle(name, ep.in_flight)

    # ---- the router's queue ------------------------------------------------------------------------------

    def enqueue(self, sreq: SimRequest, role: str = "both", item: object = None) -> None:
        """Hold a request (or `item`, a request between its phases) until an endpoint of `role` has room."""
        self._order += 1
        queue = self._queues.setdefault(role, [])
        heapq.heappush(queue, (sreq.priority, sreq.arrival, self._order, sreq, item))
        self.num_queued += 1

    def dispatch_queued(self) -> list[tuple[SimRequest, str, str, object]]:
        """Route queued requests, best first, while endpoints have room: (request, endpoint, role, item).
        Each role's requests wait in (priority, arrival) order for that role's endpoints."""
        out = []
        for role, queue in self._queues.items():
            while queue:
                sreq, item = queue[0][3], queue[0][4]
                name = self.pick(sreq, role)
                if name is None:
                    break
                heapq.heappop(queue)
                self.num_queued -= 1
                out.append((sreq, name, role, item))
        return out
