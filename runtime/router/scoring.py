"""Routing strategies: pick one endpoint among healthy candidates. Chosen from a registry by name.

Every scorer maps a candidate to [0, 1] (higher = better):
- prefix:  leading prompt blocks the pod holds / prompt blocks (exact or approximate index);
- queue:   min-max normalised load, (max - load) / (max - min), 1 for everyone when loads are equal;
- kvUsage: 1 - the pod's KV cache usage (a full cache is about to evict what we would reuse).
`prefix-affinity` ranks by the weighted sum; `least-load` is the same sum without the prefix term.

The hot-spot guard comes first (SGLang's rule): when max load - min load > `absolute` AND max load >
`relative` * min load, load alone decides (ties broken by prefix). Routing strictly for cache hits sends a
popular prefix to one pod until it drowns; this bounds how far affinity may skew load.

A candidate's load is max(pod's waiting + running, router's own in-flight): the router's count is fresh
but blind to other router replicas, the pod's figure is complete but one poll old.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tokenfleet.runtime.router.config import Balance, RoutingSpec, Weights
from tokenfleet.runtime.router.consistent_hash import BoundedLoadRing


@dataclass(frozen=True, slots=True)
class Candidate:
    endpoint_id: str
    load: int
    kv_usage: float = 0.0
    prefix_blocks: int = 0


@dataclass(frozen=True, slots=True)
class RouteQuery:
    num_blocks: int = 0
    session_key: str | None = None


@dataclass(frozen=True, slots=True)
class Decision:
    endpoint_id: str
    reason: str  # prefix_hit | load | round_robin | session | hotspot_guard
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


def combined_scores(candidates: Sequence[Candidate], query: RouteQuery, weights: Weights) -> list[float]:
    q = queue_scores([c.load for c in candidates])
    total = max(query.num_blocks, 1)
    return [
        weights.prefix * min(c.prefix_blocks / total, 1.0)
        + weights.queue * qs
        + weights.kv_usage * (1.0 - min(max(c.kv_usage, 0.0), 1.0))
        for c, qs in zip(candidates, q, strict=True)
    ]


def least_loaded(candidates: Sequence[Candidate]) -> Candidate:
    return min(candidates, key=lambda c: (c.load, -c.prefix_blocks, c.kv_usage, c.endpoint_id))


class Strategy:
    """Base: subclasses implement `_choose` over a non-empty candidate list."""

    def __init__(self, spec: RoutingSpec) -> None:
        self.spec = spec

    def choose(self, query: RouteQuery, candidates: Sequence[Candidate]) -> Decision:
        if not candidates:
            raise ValueError("no candidates")
        return self._choose(query, candidates)

    def _choose(self, query: RouteQuery, candidates: Sequence[Candidate]) -> Decision:
        raise NotImplementedError


class RoundRobin(Strategy):
    def __init__(self, spec: RoutingSpec) -> None:
        super().__init__(spec)
        self._next = 0

    def _choose(self, query: RouteQuery, candidates: Sequence[Candidate]) -> Decision:
        ordered = sorted(candidates, key=lambda c: c.endpoint_id)
        c = ordered[self._next % len(ordered)]
        self._next += 1
        return Decision(c.endpoint_id, "round_robin", c.prefix_blocks)


class WeightedScore(Strategy):
    """Hot-spot guard, then the weighted sum of scorers; `use_prefix` False gives least-load.

    Ties (typically: idle pods, none holding the prefix) rotate instead of always going to the first id, so
    new prefixes spread over the fleet even before load figures move.
    """

    use_prefix = True

    def __init__(self, spec: RoutingSpec) -> None:
        super().__init__(spec)
        self._ties = 0

    def _choose(self, query: RouteQuery, candidates: Sequence[Candidate]) -> Decision:
        if is_imbalanced([c.load for c in candidates], self.spec.balance):
            c = least_loaded(candidates)
            return Decision(c.endpoint_id, "hotspot_guard", c.prefix_blocks)
        weights = (
            self.spec.weights if self.use_prefix else self.spec.weights.model_copy(update={"prefix": 0.0})
        )
        scores = combined_scores(candidates, query, weights)
        top = max(scores)
        best = sorted(
            (c for c, s in zip(candidates, scores, strict=True) if s >= top - 1e-9),
            key=lambda c: c.endpoint_id,
        )
        c = best[self._ties % len(best)]
        self._ties += len(best) > 1
        reason = "prefix_hit" if self.use_prefix and c.prefix_blocks > 0 and weights.prefix > 0 else "load"
        return Decision(c.endpoint_id, reason, c.prefix_blocks)


class LeastLoad(WeightedScore):
    use_prefix = False


class PrefixAffinity(WeightedScore):
    use_prefix = True


class SessionAffinity(Strategy):
    """A session key -> consistent hashing with bounded load; requests without a key use prefix-affinity."""

    epsilon = 0.25

    def __init__(self, spec: RoutingSpec) -> None:
        super().__init__(spec)
        self._ring = BoundedLoadRing(())
        self._fallback = PrefixAffinity(spec)

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


def make_strategy(spec: RoutingSpec) -> Strategy:
    return STRATEGIES[spec.strategy](spec)
