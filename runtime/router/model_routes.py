"""Model routing: which backends may serve a request for model M, in order of preference.

A `modelRoutes` entry for M (a served model name or an alias) names its backends — a pool (`backends`), or
a weighted `split` of which each request takes one (a canary) — and an ordered `fallback` list of other
model names. A model with no route is served by the backends of that model. A fallback's own route applies
too (its split, its fallbacks), depth first, at most MAX_FALLBACK_DEPTH hops from the model the client
named; config validation rejects cycles and longer chains, so an operator reading the policy can follow
every place a request can end up.

A split is decided by a draw in [0, 1) per request: a hash of its session key, so a session stays on one
backend (a conversation does not flip between model versions and keeps its prefix cache), or a random
number without one. The same draw decides every split along the chain.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

from tokenfleet.runtime.router.config import MAX_FALLBACK_DEPTH, Backend, ModelRoute, RoutingSpec


@dataclass(frozen=True, slots=True)
class RouteTarget:
    """A set of backends a request may go to. `model` is the name their pods serve (what the router
    tokenizes for, counts pending requests under, and asks the pods for), not the alias the client sent."""

    model: str
    backends: tuple[str, ...]
    fallback: bool


def session_draw(session_key: str) -> float:
    """A session's fixed point in [0, 1): the same key picks the same side of every split."""
    digest = hashlib.blake2b(session_key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


def split_choice(route: ModelRoute, draw: float) -> str:
    """The backend of `route.split` that `draw` falls on, in proportion to the weights."""
    point = draw * sum(w.weight for w in route.split)
    chosen = next(w for w in route.split if w.weight > 0)
    for w in route.split:
        if w.weight <= 0:
            continue
        chosen = w
        if point < w.weight:
            break
        point -= w.weight
    return chosen.backend


def _pool(model: str, route: ModelRoute | None, backends: Sequence[Backend], draw: float) -> tuple[str, ...]:
    if route is not None and route.split:
        return (split_choice(route, draw),)
    if route is not None and route.backends:
        return route.backends
    return tuple(b.name for b in backends if b.model == model or model in b.adapters)


def split_draws(spec: RoutingSpec) -> tuple[float, ...]:
    """One draw inside each stretch of [0, 1) over which every split of `spec` picks the same side: between
    them they reach every combination of sides a request may take (every split along a chain uses the
    same draw), so "can some request for M be served" is asked of these draws alone."""
    cuts = {0.0, 1.0}
    for route in spec.model_routes:
        total = sum(w.weight for w in route.split if w.weight > 0)
        point = 0.0
        for w in route.split:
            if w.weight > 0:
                point += w.weight
                cuts.add(min(point / total, 1.0))
    return tuple((a + b) / 2 for a, b in pairwise(sorted(cuts)) if b > a)


def route_targets(
    model: str, spec: RoutingSpec, backends: Sequence[Backend], draw: float = 0.0
) -> list[RouteTarget]:
    """Targets for `model`, primary first, then the fallbacks depth first; empty when nothing serves it
    (the caller answers 404)."""
    routes = {r.model: r for r in spec.model_routes}
    served_by = {b.name: b.model for b in backends}
    targets: list[RouteTarget] = []
    visited: set[str] = set()

    def add(name: str, depth: int) -> None:
        if name in visited:
            return
        visited.add(name)
        route = routes.get(name)
        pool = tuple(b for b in _pool(name, route, backends, draw) if b in served_by)
        if pool and all(t.backends != pool for t in targets):
            targets.append(RouteTarget(served_by[pool[0]], pool, depth > 0))
        if depth < MAX_FALLBACK_DEPTH and route is not None:
            for fb in route.fallback:
                add(fb, depth + 1)

    add(model, 0)
    return targets


def served_models(spec: RoutingSpec, backends: Sequence[Backend]) -> list[str]:
    """Every model name a client may ask for: the backends' models, their adapters and the routes' names."""
    names = {b.model for b in backends} | {a for b in backends for a in b.adapters}
    names |= {r.model for r in spec.model_routes}
    return sorted(names)


def route_of(model: str, spec: RoutingSpec) -> ModelRoute | None:
    return next((r for r in spec.model_routes if r.model == model), None)
