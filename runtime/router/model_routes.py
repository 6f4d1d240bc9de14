"""Model routing: which backends may serve a request for model M, in order of preference.

A `modelRoutes` entry for M names its backends (or, when empty, every backend whose model is M) and a
`fallback` list of other model names tried in order when none of M's endpoints is healthy. A model with no
route is served by the backends of that model. Fallbacks are not followed transitively: an operator reading
the policy sees every place a request can end up.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tokenfleet.runtime.router.config import Backend, RoutingSpec


@dataclass(frozen=True, slots=True)
class RouteTarget:
    model: str
    backends: tuple[str, ...]
    fallback: bool


def _backends_of(model: str, spec: RoutingSpec, backends: Sequence[Backend]) -> tuple[str, ...]:
    route = next((r for r in spec.model_routes if r.model == model), None)
    if route is not None and route.backends:
        return route.backends
    return tuple(b.name for b in backends if b.model == model)


def route_targets(model: str, spec: RoutingSpec, backends: Sequence[Backend]) -> list[RouteTarget]:
    """Targets for `model`, primary first; empty when nothing serves it (the caller answers 404)."""
    targets = []
    primary = _backends_of(model, spec, backends)
    if primary:
        targets.append(RouteTarget(model, primary, False))
    route = next((r for r in spec.model_routes if r.model == model), None)
    for fb in route.fallback if route is not None else ():
        names = _backends_of(fb, spec, backends)
        if names:
            targets.append(RouteTarget(fb, names, True))
    return targets


def served_models(spec: RoutingSpec, backends: Sequence[Backend]) -> list[str]:
    """Every model name a client may ask for: the backends' models and the routes' names."""
    names = {b.model for b in backends} | {r.model for r in spec.model_routes}
    return sorted(names)
