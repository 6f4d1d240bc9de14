"""Routing strategies: pick one endpoint among healthy candidates. Chosen from a registry by name.

Every scorer maps a candidate to [0, 1] (higher = better):
- prefix:  leading prompt blocks the pod holds / prompt blocks (exact or approximate index);
- queue:   min-max normalised load, (max - load) / (max - min), 1 for everyone when loads are equal;
- kvUsage: 1 - the pod's KV cache usage (a full cache is about to evict what we would reuse).
`prefix-affinity` ranks by the weighted sum; `least-load` is the same sum without the prefix term.

Two hot-spot guards keep affinity from skewing load. Routing strictly for cache hits sends a popular
prefix to one pod until it drowns:
- the work bound (bounded loads, as in consistent hashing with bounded loads, but on the work routed):
  among the last `balance.window` decisions, a candidate that was sent more than `max_ratio` x (the
  least-served candidate's count + 1) is not eligible. It acts on every request, also while queues are
  short. The overflow of a popular prefix goes to the best eligible pod, and the prefix term then keeps
  it on that same second pod, which now holds the prefix too. Bounding by the least-served pod rather
  than by the mean is what keeps max/min low: a mean bound caps the top but lets a pod starve (measured
  on a Zipf tenant mix, 16 pods: max/min 1.6-3.1 with a 1.1x mean bound, 1.3-1.6 with a 1.4x min bound);
- the instantaneous guard (SGLang's rule): when max load - min load > `absolute` AND max load >
  `relative` * min load, load alone decides (ties broken by prefix).

A candidate's load is max(pod's waiting + running, router's own in-flight): the router's count is fresh
but blind to other router replicas, the pod's figure is complete but one poll old (the router adds its own
starts and ends since the poll to it).
"""

from __future__ import annotations

import hashlib
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from operator import itemgetter
from typing import NamedTuple

from tokenfleet.runtime.router.config import Balance, RoutingSpec, Weights
from tokenfleet.runtime.router.consistent_hash import BoundedLoadRing


class Candidate(NamedTuple):
    """One endpoint as the strategy sees it. A tuple, not a dataclass: one is built per endpoint per pick,
    and a frozen dataclass costs several times as much to build."""

    endpoint_id: str
    load: int
    kv_usage: float = 0.0
    prefix_blocks: int = 0
    reports_work: bool = False  # its KV-event stream is followed: it announces each request it starts


class RouteQuery(NamedTuple):
    num_blocks: int = 0
    session_key: str | None = None
    prefix_key: bytes = b""  # the prompt's first block hash: ties go where every router sends this prefix


class Decision(NamedTuple):
    endpoint_id: str
    reason: str  # prefix_hit | load | round_robin | session | hotspot_guard | work_bound
    prefix_blocks: int = 0


def is_imbalanced(loads: Sequence[int], balance: Balance) -> bool:
    if len(loads) < 2:
        return False
    lo, hi = min(loads), max(loads)
    return hi - lo > balance.absolute and hi > balance.relative * lo


def queue_scores(loads: Sequence[int]) -> list[float]:
    lo, hi = min(loads), max(loads)
    if hi == lo:
        return [1.0] * len(loads)
    return [(hi - x) / (hi - lo) for x in loads]


def combined_scores(
    candidates: Sequence[Candidate], query: RouteQuery, weights: Weights, loads: Sequence[int] | None = None
) -> list[float]:
    """The weighted sum per candidate (`loads`: the candidates' loads, when the caller has them already)."""
    q = queue_scores([c.load for c in candidates] if loads is None else loads)
    total = max(query.num_blocks, 1)
    wp, wq, wkv = weights.prefix, weights.queue, weights.kv_usage
    # min(x, 1.0) and min(max(u, 0.0), 1.0) as comparisons (the same values; no builtin call per candidate).
    return [
        wp * (p if (p := c.prefix_blocks / total) <= 1.0 else 1.0)
        + wq * qs
        + wkv * (1.0 - (u if 0.0 <= (u := c.kv_usage) <= 1.0 else min(max(u, 0.0), 1.0)))
        for c, qs in zip(candidates, q, strict=True)
    ]


def _rendezvous(key: bytes, endpoint_id: str) -> bytes:
    return hashlib.blake2b(key + endpoint_id.encode(), digest_size=8).digest()


def _endpoint_id(c: Candidate) -> str:
    return c.endpoint_id


_load = itemgetter(1)  # Candidate.load, at C speed (every pick reads every candidate's)


def least_loaded(candidates: Sequence[Candidate]) -> Candidate:
    return min(candidates, key=lambda c: (c.load, -c.prefix_blocks, c.kv_usage, c.endpoint_id))


class Strategy:
    """Base: subclasses implement `_choose` over a non-empty candidate list.

    `clock` is what the strategy's history ages on (the work bound's provisional entries): the live
    router's monotonic clock, or a simulation's virtual one. `work` is the work bound, where the strategy
    keeps one (the caller feeds it the pods' announcements and settles it as requests end)."""

    work: WorkBound | None = None

    def __init__(self, spec: RoutingSpec, clock: Callable[[], float] = time.monotonic) -> None:
        self.spec = spec
        self.clock = clock

    def update(self, spec: RoutingSpec) -> None:
        """A live policy change of the same strategy: new weights and bounds, the history kept."""
        self.spec = spec

    def choose(self, query: RouteQuery, candidates: Sequence[Candidate]) -> Decision:
        if not candidates:
            raise ValueError("no candidates")
        return self._choose(query, candidates)

    def _choose(self, query: RouteQuery, candidates: Sequence[Candidate]) -> Decision:
        raise NotImplementedError


class RoundRobin(Strategy):
    def __init__(self, spec: RoutingSpec, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(spec, clock)
        self._next = 0

    def _choose(self, query: RouteQuery, candidates: Sequence[Candidate]) -> Decision:
        ordered = sorted(candidates, key=lambda c: c.endpoint_id)
        c = ordered[self._next % len(ordered)]
        self._next += 1
        return Decision(c.endpoint_id, "round_robin", c.prefix_blocks)


class WorkBound:
    """The requests the candidates were recently sent: the last `window` of them, per endpoint.

    For a pod whose KV events this router follows, the count comes from the pod itself: one `scheduled`
    event per request it starts, whoever routed it, so every router replica counts the same work and
    bounds it the same way (own counts would diverge across replicas and split a popular prefix over
    more pods). This router's own decision for such a pod counts provisionally until the pod announces a
    request, or until this router no longer has more requests in flight there than provisional entries
    (`settle`). A pod announces a request only when it first schedules it, which on a busy pod can be many
    seconds after it arrived; a fixed short expiry undercounted exactly the busiest pod and sent it more.
    `provisional_s` is only a backstop for decisions that were never forwarded. For other pods the
    router's decisions are the count.
    """

    def __init__(self, window: int, provisional_s: float = 300.0, clock=time.monotonic) -> None:
        self._recent: deque[str] = deque(maxlen=window)
        self._counts: Counter[str] = Counter()
        self._provisional: dict[str, deque[float]] = {}
        self._provisional_s = provisional_s
        self._clock = clock

    def _push(self, endpoint_id: str) -> None:
        if len(self._recent) == self._recent.maxlen:
            gone = self._recent[0]
            self._counts[gone] -= 1
            if not self._counts[gone]:
                del self._counts[gone]
        self._recent.append(endpoint_id)
        self._counts[endpoint_id] += 1

    def record(self, endpoint_id: str, reported: bool = False) -> None:
        """This router sent a request there; `reported`: the pod's own events will count it."""
        if reported:
            pending = self._provisional.get(endpoint_id)
            if pending is None:
                pending = self._provisional[endpoint_id] = deque()
            pending.append(self._clock())
        else:
            self._push(endpoint_id)

    def observed(self, endpoint_id: str) -> None:
        """The pod started a request (its `scheduled` event)."""
        self._push(endpoint_id)
        pending = self._provisional.get(endpoint_id)
        if pending:
            pending.popleft()

    def settle(self, endpoint_id: str, in_flight: int) -> None:
        """A request to `endpoint_id` ended here, `in_flight` remain: at most that many can still be
        waiting for the pod's announcement (an unannounced one failed, or its event is still on the way
        and will count when it comes)."""
        pending = self._provisional.get(endpoint_id)
        while pending and len(pending) > max(in_flight, 0):
            pending.popleft()

    def count(self, endpoint_id: str) -> int:
        pending = self._provisional.get(endpoint_id)
        if pending:
            horizon = self._clock() - self._provisional_s
            while pending and pending[0] < horizon:
                pending.popleft()
        return self._counts[endpoint_id] + (len(pending) if pending else 0)

    def eligible(self, candidates: Sequence[Candidate], max_ratio: float) -> Sequence[Candidate]:
        """Candidates whose count + 1 stays within max_ratio x (least count + 1); never empty (the
        least-served candidate always is). `candidates` itself when all are."""
        count = self._counts.get
        provisional = self._provisional
        # `count` per candidate, inlined: this runs on every pick for every candidate.
        ns = [
            self.count(c.endpoint_id) if provisional.get(c.endpoint_id) else count(c.endpoint_id, 0)
            for c in candidates
        ]
        cap = max_ratio * (min(ns) + 1)
        if max(ns) + 1 <= cap:
            return candidates
        return [c for c, n in zip(candidates, ns, strict=True) if n + 1 <= cap]


class WeightedScore(Strategy):
    """Work bound, hot-spot guard, then the weighted sum of scorers; `use_prefix` False gives least-load.

    Ties (typically: idle pods, none holding the prefix) are broken by rendezvous hashing of the prompt's
    first block over the tied endpoints: new prefixes spread over the fleet even before load figures move,
    and every router replica sends the same prefix (and its overflow) to the same pod. Prompts without a
    full block rotate.
    """

    use_prefix = True

    def __init__(self, spec: RoutingSpec, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(spec, clock)
        self._ties = 0
        self.work = WorkBound(spec.balance.window, clock=clock)
        self._weights = self._weights_of(spec)

    def _weights_of(self, spec: RoutingSpec) -> Weights:
        return spec.weights if self.use_prefix else spec.weights.model_copy(update={"prefix": 0.0})

    def update(self, spec: RoutingSpec) -> None:
        if spec.balance.window != self.spec.balance.window:
            self.work = WorkBound(spec.balance.window, clock=self.clock)
        super().update(spec)
        self._weights = self._weights_of(spec)

    def _choose(self, query: RouteQuery, candidates: Sequence[Candidate]) -> Decision:
        decision, chosen = self._decide(query, candidates)
        self.work.record(decision.endpoint_id, chosen.reports_work)
        return decision

    def _decide(self, query: RouteQuery, candidates: Sequence[Candidate]) -> tuple[Decision, Candidate]:
        loads = list(map(_load, candidates))
        if is_imbalanced(loads, self.spec.balance):
            c = least_loaded(candidates)
            return Decision(c.endpoint_id, "hotspot_guard", c.prefix_blocks), c
        max_ratio = self.spec.balance.max_ratio
        if self.use_prefix and max_ratio is not None:
            eligible = self.work.eligible(candidates, max_ratio)
            if len(eligible) < len(candidates):
                best_prefix = max(c.prefix_blocks for c in candidates)
                decision, c = self._score(query, eligible)
                if best_prefix > decision.prefix_blocks:  # the holder was over the bound
                    return Decision(decision.endpoint_id, "work_bound", decision.prefix_blocks), c
                return decision, c
        return self._score(query, candidates, loads)

    def _score(
        self, query: RouteQuery, candidates: Sequence[Candidate], loads: Sequence[int] | None = None
    ) -> tuple[Decision, Candidate]:
        weights = self._weights
        scores = combined_scores(candidates, query, weights, loads)
        top = max(scores)
        floor = top - 1e-9
        best = [c for c, s in zip(candidates, scores, strict=True) if s >= floor]
        if len(best) == 1:
            c = best[0]
        elif query.prefix_key:
            key = query.prefix_key
            c = max(sorted(best, key=_endpoint_id), key=lambda c: _rendezvous(key, c.endpoint_id))
        else:
            best.sort(key=_endpoint_id)
            c = best[self._ties % len(best)]
            self._ties += 1
        reason = "prefix_hit" if self.use_prefix and c.prefix_blocks > 0 and weights.prefix > 0 else "load"
        return Decision(c.endpoint_id, reason, c.prefix_blocks), c


class LeastLoad(WeightedScore):
    use_prefix = False


class PrefixAffinity(WeightedScore):
    use_prefix = True


class SessionAffinity(Strategy):
    """A session key -> consistent hashing with bounded load; requests without a key use prefix-affinity."""

    epsilon = 0.25

    def __init__(self, spec: RoutingSpec, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(spec, clock)
        self._ring = BoundedLoadRing(())
        self._fallback = PrefixAffinity(spec, clock)

    @property
    def work(self) -> WorkBound:
        return self._fallback.work

    def update(self, spec: RoutingSpec) -> None:
        super().update(spec)
        self._fallback.update(spec)

    def _choose(self, query: RouteQuery, candidates: Sequence[Candidate]) -> Decision:
        if query.session_key is None:
            return self._fallback.choose(query, candidates)
        ids = tuple(sorted(c.endpoint_id for c in candidates))
        if ids != self._ring.nodes:
            self._ring = BoundedLoadRing(ids)
        loads = {c.endpoint_id: c.load for c in candidates}
        chosen = self._ring.lookup(query.session_key, loads, self.epsilon)
        c = next(c for c in candidates if c.endpoint_id == chosen)
        return Decision(c.endpoint_id, "session", c.prefix_blocks)


STRATEGIES: dict[str, type[Strategy]] = {
    "round-robin": RoundRobin,
    "least-load": LeastLoad,
    "prefix-affinity": PrefixAffinity,
    "session-affinity": SessionAffinity,
}


def make_strategy(
    spec: RoutingSpec, current: Strategy | None = None, clock: Callable[[], float] = time.monotonic
) -> Strategy:
    """The strategy `spec` names, on `clock`; `current` is updated in place when it is already that
    strategy (keeping its history and its clock)."""
    cls = STRATEGIES[spec.strategy]
    if current is not None and type(current) is cls:
        current.update(spec)
        return current
    return cls(spec, clock)
